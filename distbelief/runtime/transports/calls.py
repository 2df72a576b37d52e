"""Calls to parameter shards on Ray, and the one place where a call to a shard that died is sent again.

Every transport that talks to a shard's process (the object store, the shared-memory plane) and a partition's
range client send their calls through :class:`ShardCalls`; the co-located transport makes none.
"""

from __future__ import annotations

import time

import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayError, RayTaskError

from distbelief.exceptions import RemoteTimeoutError, RoleFailedError
from distbelief.runtime import forwarded
from distbelief.runtime.base import Future


class RayFuture(Future):
    """One Ray reference (``many``: a list of them) turned into a Future with the runtime's errors."""

    def __init__(self, refs, role_name: str, many: bool = False, transform=None):
        self.refs, self.role_name, self.many, self.transform = refs, role_name, many, transform

    def result(self, timeout_s: float):
        try:
            value = ray.get(self.refs, timeout=timeout_s)
        except GetTimeoutError:
            raise RemoteTimeoutError(
                f"{self.role_name} did not answer within {timeout_s:.0f}s (raise remote_timeout_s if it is slow)"
            ) from None
        except RayActorError as e:
            raise RoleFailedError(f"{self.role_name} died: {e.__class__.__name__}") from e
        except RayTaskError as e:
            raise RoleFailedError(f"{self.role_name} failed: {e}") from e
        except RayError as e:
            raise RoleFailedError(f"{self.role_name}: {e}") from e
        return self.transform(value) if self.transform else value

    def done(self) -> bool:
        refs = self.refs if self.many else [self.refs]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready) == len(refs)

    def as_arg(self):
        return self.refs


class ShardCalls(Future):
    """One call per shard in ``sends`` (``{shard id: (actor method, args)}``); ``result`` is the list of their
    answers in that order, passed through ``transform``.

    Failover, written once: a call to a shard whose process died is sent again, with the same arguments, to the
    shard that replaces it (``client.await_replacement``, within the call's timeout); so is a push whose primary
    died before its backup's acknowledgement could be read (runtime/forwarded.py), and a call whose reply was lost
    with the node that stored it. A re-sent push carries the same (session, seq), so a shard that already applied
    it answers without applying it twice (ps/shard.py)."""

    def __init__(self, client, method: str, sends: dict[int, tuple[str, tuple]], transform=None):
        """``method`` names the call in errors; ``client`` is a ShardClient (its ``handles`` and
        ``await_replacement``)."""
        self.client, self.method, self.sends, self.transform = client, method, sends, transform
        self.ids = list(sends)
        self.handles = {k: client.handles[k] for k in self.ids}
        self.refs = {k: self._send(k) for k in self.ids}

    def _send(self, k: int):
        actor_method, args = self.sends[k]
        return getattr(self.handles[k], actor_method).remote(*args)

    def result(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        out = []
        for k in self.ids:
            while True:
                try:
                    reply = ray.get(self.refs[k], timeout=max(0.0, deadline - time.monotonic()))
                    value, resend = forwarded.settle(reply, deadline, f"parameter shard {k}")
                    if resend:  # the primary died after answering, before its backup's acknowledgement was read
                        self.handles[k] = self.client.await_replacement(k, self.handles[k], deadline)
                        self.refs[k] = self._send(k)
                        continue
                    out.append(value)
                    break
                except GetTimeoutError:
                    raise RemoteTimeoutError(
                        f"parameter shard {k} did not answer {self.method} within {timeout_s:.0f}s "
                        f"(raise remote_timeout_s if it is slow)") from None
                except RayActorError:
                    self.handles[k] = self.client.await_replacement(k, self.handles[k], deadline)
                    self.refs[k] = self._send(k)
                except RayTaskError as e:
                    if not self._send_again_after(k, e):
                        raise RoleFailedError(f"parameter shard {k} failed in {self.method}: {e}") from e
                    self.refs[k] = self._send(k)
                except ObjectLostError:
                    # The reply lived in the object store of a node that just died. Ask again: a live shard
                    # answers (a re-sent push is recognised by its sequence number), a dead one raises
                    # RayActorError above and we wait for its replacement.
                    if time.monotonic() >= deadline:
                        raise RoleFailedError(f"parameter shard {k}: reply to {self.method} lost") from None
                    self.handles[k] = self.client.handles[k]
                    self.refs[k] = self._send(k)
        return self.transform(out) if self.transform else out

    def _send_again_after(self, k: int, error: RayTaskError) -> bool:
        """Whether shard ``k``'s call is sent again after it raised ``error`` (a transport's own failure, which
        its ``_send`` avoids the second time); a shard's failure fails the call."""
        return False

    def done(self) -> bool:
        refs = list(self.refs.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready) == len(refs)

    def as_arg(self):
        return [self.refs[k] for k in self.ids]


def calls(client, method: str, args_per_shard, actor_method: str = "call", transform=None) -> ShardCalls:
    """:class:`ShardCalls` to every shard of ``client``; ``args_per_shard[k]``: shard k's arguments. With
    ``actor_method="call"`` the actor runs ``method`` on the shard object."""
    prefix = (method,) if actor_method == "call" else ()
    sends = {k: (actor_method, (*prefix, *args)) for k, args in enumerate(args_per_shard)}
    return ShardCalls(client, method, sends, transform)
