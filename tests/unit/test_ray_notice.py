"""Ray's token-authentication notice is replaced by ours, once per machine (distbelief/runtime/ray_notice.py).

Ray's own function logs the notice here, so a Ray upgrade that rewords it fails this test. No Ray instance starts.
"""

import logging

import pytest
from ray._private.authentication import authentication_token_setup as ray_auth

from distbelief.runtime import ray_notice


@pytest.fixture
def ray_log(monkeypatch, tmp_path):
    """A fresh filter on Ray's authentication logger, a cache directory of our own, and the records that reach
    Ray's handlers."""
    monkeypatch.setenv("DISTBELIEF_CACHE", str(tmp_path / "cache"))
    logger = logging.getLogger(ray_notice.RAY_LOGGER)
    saved = list(logger.filters)
    for f in saved:
        logger.removeFilter(f)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        for f in list(logger.filters):
            logger.removeFilter(f)
        for f in saved:
            logger.addFilter(f)


def test_ray_logs_its_notice_on_the_logger_we_filter(ray_log):
    ray_auth._warn_token_auth_enabled()
    assert len(ray_log) == 1 and ray_log[0].startswith(ray_notice.RAY_TEXT)


def test_our_notice_once_per_machine_and_rays_never(ray_log, capsys):
    ray_notice.install()
    ray_notice.install()  # idempotent: one filter
    assert sum(isinstance(f, ray_notice._TokenNotice) for f in logging.getLogger(ray_notice.RAY_LOGGER).filters) == 1
    ray_auth._warn_token_auth_enabled()
    err = capsys.readouterr().err
    assert err.count("[distbelief] note") == 1 and "docs/cluster.md" in err and "RAY_AUTH_MODE=disabled" in err
    assert ray_log == []  # Ray's own line is dropped
    assert ray_notice.marker_path().is_file()
    ray_auth._warn_token_auth_enabled()  # the same process again
    assert capsys.readouterr().err == "" and ray_log == []

    # a new process on the same machine (a fresh filter, the marker there): silent
    logger = logging.getLogger(ray_notice.RAY_LOGGER)
    for f in list(logger.filters):
        logger.removeFilter(f)
    ray_notice.install()
    ray_auth._warn_token_auth_enabled()
    assert capsys.readouterr().err == "" and ray_log == []


def test_other_ray_records_pass(ray_log, capsys):
    ray_notice.install()
    ray_auth._warn_token_auth_disabled()  # a different message on the same logger
    logging.getLogger(ray_notice.RAY_LOGGER).warning("something else")
    assert len(ray_log) == 2 and ray_log[0].startswith("Token authentication is disabled")
    assert "[distbelief] note" not in capsys.readouterr().err
    assert not ray_notice.marker_path().exists()
