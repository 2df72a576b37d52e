"""Pipelined shard replication on Ray (``--durability replicate``, ps/replication.py).

A primary shard answers a push once it has applied it and *sent* it on to its backup. Its answer then carries the
backup's pending acknowledgement (``Forwarded``), and the replica counts the push as done only when both are in
(``settle``). The primary and its backup so apply the same update at the same time, on two cores or two machines,
instead of one after the other.
"""

from __future__ import annotations

import time

import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError

from distbelief.exceptions import RemoteTimeoutError


class Forwarded:
    """A shard's answer to a push (``value``) plus its backup's acknowledgement of that push (``ack``, an object
    reference owned by the primary's process)."""

    __slots__ = ("value", "ack")

    def __init__(self, value, ack):
        self.value, self.ack = value, ack

    def __reduce__(self):
        return Forwarded, (self.value, self.ack)


def answer(obj, value):
    """(In a shard's actor, after a push) ``value``, with the backup's acknowledgement attached when the shard
    forwarded the push without waiting for it."""
    take = getattr(obj, "take_handoff", None)
    ack = take() if take is not None else None
    return value if ack is None else Forwarded(value, ack)


def settle(value, deadline: float, what: str):
    """``(answer, resend)`` for a reply read from a shard: wait for its backup's acknowledgement, if it carries one.

    ``resend`` is True when the primary died before its backup's acknowledgement could be read (it is owned by
    the primary's process): the push must be re-sent to the shard that replaces it, which recognises it if it
    already has it. A backup that failed instead does not fail the push: the primary applied it, drops that backup
    and the driver gives it a new one."""
    if not isinstance(value, Forwarded):
        return value, False
    try:
        ray.get(value.ack, timeout=max(0.0, deadline - time.monotonic()))
    except GetTimeoutError:
        raise RemoteTimeoutError(f"{what}: the shard's backup did not acknowledge in time (raise remote_timeout_s if "
                                 f"it is slow)") from None
    except ObjectLostError:  # its owner, the primary, died
        return None, True
    except (RayActorError, RayTaskError):
        pass
    return value.value, False
