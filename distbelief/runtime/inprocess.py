"""In-process runtime: every role is a Python object in this process; long calls run on threads.

Shards are guarded by a lock each (a Ray actor executes one call at a time; this reproduces that). Client calls
from replicas are executed synchronously, so with one replica the schedule is fully deterministic — the basis
of the oracle tests.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Any, Callable

from distbelief.exceptions import RemoteTimeoutError, RoleFailedError
from distbelief.runtime.base import Done, Future, Role, Runtime, ShardClient


class _ThreadFuture(Future):
    def __init__(self, fut: cf.Future, role_name: str):
        self._fut, self._role_name = fut, role_name

    def result(self, timeout_s: float):
        try:
            return self._fut.result(timeout=timeout_s)
        except cf.TimeoutError:
            raise RemoteTimeoutError(
                f"{self._role_name} did not answer within {timeout_s:.0f}s (raise remote_timeout_s if it is slow)"
            ) from None
        except Exception as e:  # noqa: BLE001 - re-raised with the role's name
            raise RoleFailedError(f"{self._role_name} failed: {type(e).__name__}: {e}") from e

    def done(self) -> bool:
        return self._fut.done()


class _Locked:
    """A role object plus the lock that serialises calls into it; ``dead`` simulates a killed process."""

    def __init__(self, obj):
        self.obj, self.lock, self.dead = obj, threading.Lock(), False


class InProcessShardClient(ShardClient):
    def __init__(self, shards: list[Role], layout, replica_id: int, timeout_s: float = 120.0):
        super().__init__([r.handle for r in shards], layout)
        self.replica_id, self.timeout_s = replica_id, timeout_s

    def _call(self, k: int, method: str, *args):
        deadline = time.monotonic() + self.timeout_s
        box: _Locked = self.handles[k]
        while True:
            with box.lock:
                if not box.dead:
                    return box.obj, getattr(box.obj, method)(*args)
            box = self.await_replacement(k, box, deadline)

    def fetch_async(self) -> Future:
        parts, versions = [], []
        for k in range(len(self.handles)):
            obj, (values, version) = self._call(k, "fetch", self.replica_id)
            parts.append((obj.lo, values.copy()))  # copied under the shard's lock: a consistent snapshot
            versions.append(version)
        return Done((parts, versions))

    def push_async(self, grad, versions, num_examples: int) -> Future:
        g = grad.numpy() if hasattr(grad, "numpy") else grad
        acked = []
        seq = self.next_seq()
        for k in range(len(self.handles)):
            lo, hi = self.layout.range(k)
            acked.append(self._call(k, "push", self.replica_id, g[lo:hi], lo, versions[k] if versions else 0,
                                    num_examples, self.session, seq)[1])
        self._ack(acked)
        return Done(acked)


class InProcessRuntime(Runtime):
    name = "inprocess"

    def __init__(self, max_workers: int = 64, remote_timeout_s: float = 120.0):
        self.remote_timeout_s = remote_timeout_s
        self._pool = cf.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="distbelief-role")

    def create_shard(self, shard_id: int, factory: Callable[[], Any]) -> Role:
        return Role("shard", shard_id, _Locked(factory()))

    def create_replica(self, replica_id, factory, shards, layout, threads) -> Role:
        client = InProcessShardClient(shards, layout, replica_id, self.remote_timeout_s)
        return Role("replica", replica_id, _Locked(factory(client)))

    def call(self, role: Role, method: str, *args, **kwargs) -> Future:
        box: _Locked = role.handle
        if role.kind == "shard":

            def locked():
                with box.lock:
                    if box.dead:
                        raise RoleFailedError(f"{role.name} is dead")
                    return getattr(box.obj, method)(*args, **kwargs)

            return _ThreadFuture(self._pool.submit(locked), role.name)
        # Replicas are thread-safe by design: run() in one thread, stop()/stats() from others.
        return _ThreadFuture(self._pool.submit(getattr(box.obj, method), *args, **kwargs), role.name)

    def shard_client(self, shards, layout, replica_id: int = -1) -> ShardClient:
        client = InProcessShardClient(shards, layout, replica_id, self.remote_timeout_s)
        client.wait_for_replacement = False  # the driver's client (see ShardClient.wait_for_replacement)
        return client

    def kill(self, role: Role) -> None:
        role.handle.dead = True
        obj = role.handle.obj
        if hasattr(obj, "kill"):
            obj.kill()

    def wait_any(self, futures, timeout_s):
        if not futures:
            return []
        inner = {f._fut: f for f in futures if isinstance(f, _ThreadFuture)}
        done = [f for f in futures if not isinstance(f, _ThreadFuture)]
        if done:
            return done + [f for f in futures if isinstance(f, _ThreadFuture) and f.done()]
        finished, _ = cf.wait(list(inner), timeout=timeout_s, return_when=cf.FIRST_COMPLETED)
        return [inner[f] for f in finished]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
