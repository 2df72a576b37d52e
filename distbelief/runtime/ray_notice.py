"""Ray's token-authentication notice, said once per machine and in our words.

Ray (>= 2.59) turns token authentication on for every Ray instance that ``ray.init()`` starts when
``RAY_AUTH_MODE`` is unset, and logs at every start, in every process that starts or joins one:

    Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out. ...

(``ray/_private/authentication/authentication_token_setup.py``, ``_warn_token_auth_enabled``). A user of
``distbelief train`` sees it at every run, with no word on what it means for them. :func:`install` drops that log
record and, the first time on this machine, prints :data:`NOTICE` instead; a marker file in distbelief's cache
directory (``DISTBELIEF_CACHE``, default ``~/.cache/distbelief``) remembers that it was shown. Nothing about
authentication changes: Ray still uses and creates the token exactly as it would; only the message is ours.
Every other Ray log record passes untouched.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

# The logger Ray's notice is logged on, and how its text starts (checked against Ray's own function by
# tests/unit/test_ray_notice.py, so a Ray upgrade that rewords it fails there, not silently here).
RAY_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_TEXT = "Token authentication is enabled for this Ray cluster"
MARKER = "ray-token-notice-shown"

NOTICE = ("[distbelief] note (shown once per machine): Ray protects the Ray instances it starts with a token "
          "(~/.ray/auth_token, created on first use), so only processes holding it can join or submit work. "
          "Nothing to do on one machine; to join a cluster with --address, see docs/cluster.md, \"Token "
          "authentication\". RAY_AUTH_MODE=disabled turns it off (then anyone who can reach the ports can run code).")


def token_path() -> Path:
    """Where Ray looks for this machine's token file: ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def token_present() -> bool:
    """Whether Ray finds a token here: ``RAY_AUTH_TOKEN`` set, or the file ``token_path()`` names."""
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or token_path().is_file()


def marker_path() -> Path:
    return Path(os.environ.get("DISTBELIEF_CACHE", Path.home() / ".cache" / "distbelief")) / MARKER


class _TokenNotice(logging.Filter):
    """Drops Ray's token notice; prints ours instead the first time on this machine (once per process where the
    marker cannot be written)."""

    def __init__(self) -> None:
        super().__init__()
        self.shown = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(RAY_TEXT):
            return True
        if not self.shown:
            self.shown = True
            marker = marker_path()
            if not marker.exists():
                print(NOTICE, file=sys.stderr, flush=True)
                try:
                    marker.parent.mkdir(parents=True, exist_ok=True)
                    marker.touch()
                except OSError:
                    pass  # a read-only cache: shown once per process instead
        return False


def install() -> None:
    """Put the filter on Ray's authentication logger (once per process; idempotent)."""
    logger = logging.getLogger(RAY_LOGGER)
    if not any(isinstance(f, _TokenNotice) for f in logger.filters):
        logger.addFilter(_TokenNotice())
