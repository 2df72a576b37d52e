"""In-process runtime: every role is a Python object in this process; long calls run on threads.

A model-parallel replica here is P partition threads connected by mailboxes (``InProcessPartitionGroup``).

Shards are guarded by a lock each (a Ray actor executes one call at a time; this reproduces that). Client calls
from replicas are executed synchronously, so with one replica the schedule is fully deterministic — the basis
of the oracle tests.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Any, Callable

from distbelief.exceptions import RemoteTimeoutError, ReplicaKilled, RoleFailedError
from distbelief.runtime.group_stats import merge_partition_stats
from distbelief.runtime.base import Done, Future, Role, Runtime, ShardClient, _WholeSplit
from distbelief.runtime.clocks import LocalClocks
from distbelief.runtime.transport import InProcessTransport


WAIT_POLL_S = 0.002  # how often wait_any looks at the futures it waits on


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


class _LocalLink:
    """A primary shard's link to its backup in this process (ps/replication.py): a call under the backup's lock."""

    def __init__(self, box: _Locked, name: str):
        self.box, self.name = box, name

    def call(self, method: str, *args):
        with self.box.lock:
            if self.box.dead:
                raise RoleFailedError(f"{self.name} is dead")
            return getattr(self.box.obj, method)(*args)

    def push(self, grad, offset: int, based_on_version: int, num_examples: int, session: int, seq: int, mapped,
             rows=None):
        """Applied before it returns: the acknowledgement is the backup's version after it."""
        return self.call("push", -1, grad, offset, based_on_version, num_examples, session, seq, rows)

    def version_of(self, ack: int, wait: bool) -> int:
        return ack

    def handoff(self, ack: int) -> None:
        return None


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
        for k, args in enumerate(self.fetch_args()):
            obj, (values, version) = self._call(k, "fetch", *args)
            # copied under the shard's lock: a consistent snapshot (a delta fetch's answer is a copy already)
            parts.append((obj.lo, values if hasattr(values, "token") else values.copy()))
            versions.append(version)
        return Done((parts, versions))

    def push_async(self, grad, versions, num_examples: int, rows=None) -> Future:
        g = grad.numpy() if hasattr(grad, "numpy") else grad
        per_shard = self._split_push_rows(rows)  # checked before anything is sent
        acked = []
        seq = self.next_seq()
        for k in range(len(self.handles)):
            lo, hi = self.layout.range(k)
            acked.append(self._call(k, "push", self.replica_id, g[lo:hi], lo, versions[k] if versions else 0,
                                    num_examples, self.session, seq, per_shard[k])[1])
        self._ack(acked)
        return Done(acked)

    def _fetch_rows_calls(self, per_shard: list[list]) -> Future:
        return Done([self._call(k, "fetch_rows", per_shard[k], self.replica_id)[1] for k in range(len(self.handles))])


class InProcessRangeClient(InProcessShardClient):
    """A partition's connection to the shards holding its flat parameter range ``[lo, hi)`` — and only those.

    ``fetch_async() -> (parts, versions)`` with ``parts = [(start, values), ...]`` covering ``[lo, hi)`` and
    ``versions = {shard_id: version}``; ``push_async(grad, versions, n)`` sends each of those shards its
    intersection of ``grad`` (which covers ``[lo, hi)``).
    """

    def __init__(self, shards: list[Role], layout, replica_id: int, timeout_s: float, lo: int, hi: int):
        super().__init__(shards, layout, replica_id, timeout_s)
        self.lo, self.hi = lo, hi
        self.shard_ids = layout.shards_overlapping(lo, hi)

    def fetch_async(self):
        parts, versions = [], {}
        for k in self.shard_ids:
            _, (start, values, version) = self._call(k, "fetch_range", self.lo, self.hi, self.replica_id)
            parts.append((start, values.copy()))  # copied under the shard's lock
            versions[k] = version
        return Done((parts, versions))

    def push_async(self, grad, versions, num_examples: int, rows=None):
        g = grad.numpy() if hasattr(grad, "numpy") else grad
        acked: list[int | None] = [None] * len(self.handles)
        seq = self.next_seq()
        for k in self.shard_ids:
            s_lo, s_hi = self.layout.range(k)
            a, b = max(s_lo, self.lo), min(s_hi, self.hi)
            # (session, seq): a push re-sent to a restarted shard that already applied it is not applied twice
            acked[k] = self._call(k, "push", self.replica_id, g[a - self.lo: b - self.lo], a,
                                  versions[k] if versions else 0, num_examples, self.session, seq)[1]
        self._ack(acked)
        return Done(acked)


class InProcessPartitionGroup:
    """A model replica as P partition threads of this process (the in-process runtime's partition group)."""

    def __init__(self, replica_id: int, factory: Callable, shards: list[Role] | None, layout,
                 num_partitions: int, timeout_s: float):
        self.replica_id, self.timeout_s = replica_id, timeout_s
        self.transports = InProcessTransport.group(num_partitions, f"replica {replica_id}")
        self.parts: list[Any] = []  # each partition's ModelReplica, built by the factory
        def client_for(lo: int, hi: int) -> InProcessRangeClient:
            return InProcessRangeClient(shards, layout, replica_id, timeout_s, lo, hi)

        for p in range(num_partitions):
            self.parts.append(factory(p, client_for if shards is not None else None, self.transports[p]))
        self._pool = cf.ThreadPoolExecutor(max_workers=num_partitions,
                                           thread_name_prefix=f"distbelief-r{replica_id}-partition")

    def run(self, max_steps: int | None = None, max_seconds: float | None = None) -> dict[str, Any]:
        for t in self.transports[:1]:
            for box in t.mailboxes:
                box.clear()
        futs = [self._pool.submit(part.run, max_steps, max_seconds) for part in self.parts]
        error: BaseException | None = None
        for f in cf.as_completed(futs):
            if f.exception() is not None and error is None:
                error = f.exception()
                # Wake the partitions blocked on messages from the failed one, so the whole group ends now.
                self.transports[0].fail_all(RoleFailedError(
                    f"replica {self.replica_id}: another partition failed: {error}"))
        if error is not None:
            raise error
        return self.stats()

    def stop(self) -> None:
        self.parts[0].stop()  # the head ends the lockstep for everyone

    def pause(self, timeout_s: float) -> bool:
        return self.parts[0].pause(timeout_s)  # the head holds the lockstep for everyone

    def resume(self) -> None:
        self.parts[0].resume()

    def kill(self) -> None:
        """Tear the whole group down: every partition stops, blocked receives fail, the threads are released."""
        for part in self.parts:
            if hasattr(part, "kill"):
                part.kill()
        self.transports[0].fail_all(RoleFailedError(f"replica {self.replica_id} was killed"))
        self._pool.shutdown(wait=False, cancel_futures=True)

    def kill_partition(self, partition_id: int) -> None:
        """Fault injection: partition ``partition_id`` dies as its process would. It stops at its next step or
        receive, whichever comes first, and its failure then ends the group's ``run`` (see ``run``)."""
        self.parts[partition_id].kill()
        self.transports[partition_id].mailboxes[partition_id].fail(ReplicaKilled(
            f"replica {self.replica_id} partition {partition_id} was killed (fault injection)"))

    def replace_shard(self, shard_id: int, handle) -> int:
        return max([part.replace_shard(shard_id, handle) or 0 for part in self.parts] + [0])

    def stats(self) -> dict[str, Any]:
        return merge_partition_stats([part.stats() for part in self.parts])

    def params(self) -> list[tuple[int, Any]]:
        return [part.params() for part in self.parts]

    def broadcast(self, method: str, *args) -> list:
        """Call ``method`` on every partition at once (they run in lockstep) and return their answers."""
        futs = [self._pool.submit(getattr(part, method), *args) for part in self.parts]
        return [f.result(timeout=self.timeout_s * 4) for f in futs]


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

    def backup_link(self, backup: Role) -> _LocalLink:
        return _LocalLink(backup.handle, f"backup of parameter shard {backup.role_id}")

    def create_clocks(self, bound: int) -> LocalClocks:
        return LocalClocks(bound)

    def create_partition_group(self, replica_id, factory, shards, layout, threads, num_partitions) -> Role:
        group = InProcessPartitionGroup(replica_id, factory, shards, layout, num_partitions, self.remote_timeout_s)
        return Role("replica", replica_id, _Locked(group))

    def kill_partition(self, role: Role, partition_id: int) -> None:
        role.handle.obj.kill_partition(partition_id)

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
        # A split call wraps its thread's future (base._WholeSplit): wait on that one, so a split call counts as
        # done only once it is (a straggler's answer must not look as early as a quick replica's).
        threads, other = set(), []
        for f in futures:
            t = f.inner if isinstance(f, _WholeSplit) else f
            if isinstance(t, _ThreadFuture):
                threads.add(t._fut)
            else:
                other.append(f)
        done = [f for f in futures if f.done()]
        if done or other:  # (a future with no thread of its own to wait on is returned as it is: the caller asks)
            return list(dict.fromkeys(done + other))
        # Polled, not cf.wait: cf.wait takes every future's lock in a Python loop, and a Ctrl-C or SIGTERM landing
        # inside it leaves one held, so the thread finishing that future blocks for ever and the interrupted run's
        # clean-up waits out remote_timeout_s. (A suite run once saw an interrupted in-process Sandblaster run
        # hang that long; this is the lock on its path that an interrupt can leave held.)
        deadline = time.monotonic() + timeout_s
        while not any(t.done() for t in threads):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, WAIT_POLL_S))
        return [f for f in futures if f.done()]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
