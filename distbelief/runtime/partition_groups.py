"""Placing a model-parallel replica: its P partitions as one replica role.

``create_partition_group`` is the one entry point the trainer uses; it places the group on whichever runtime it
is given. In process, the partitions are threads connected by mailboxes; on Ray (``partition_ray``) they are
actors in one placement group, exchanging numpy buffers actor to actor.

Either way the group answers the calls a replica role answers (``run``, ``stop``, ``stats``, ``kill``,
``replace_shard``) plus ``params``, so the trainer drives it exactly like a one-process replica.

Failure is per group, as for a one-process replica: when one partition dies, the group's ``run`` fails promptly
(the surviving partitions' receives are woken with an error, never left to wait out their timeouts), and
``runtime.kill(role)`` tears the whole group down (all its partitions; on Ray also its placement group), so the
trainer restarts the replica as a fresh group that fetches the server's parameters.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any, Callable

from distbelief.downpour.replica import ReplicaKilled
from distbelief.exceptions import ConfigError, RoleFailedError
from distbelief.partition.replica import PartitionReplica, merge_partition_stats
from distbelief.partition.transport import InProcessTransport
from distbelief.runtime.base import Role, Runtime
from distbelief.runtime.base import Done
from distbelief.runtime.inprocess import InProcessRuntime, InProcessShardClient, _Locked


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

    def push_async(self, grad, versions, num_examples: int):
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
        self.parts: list[PartitionReplica] = []
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


def create_partition_group(runtime: Runtime, replica_id: int, factory: Callable, shards: list[Role] | None,
                           layout, threads: int, num_partitions: int) -> Role:
    """Place model replica ``replica_id`` as ``num_partitions`` partitions; returns its replica role.

    ``factory(partition_id, client_for, transport)`` builds each PartitionReplica where it lives;
    ``client_for(lo, hi)`` gives a client for the shards holding ``[lo, hi)`` (None when ``shards`` is None:
    the partitions then update their parameters locally).
    """
    timeout_s = getattr(runtime, "remote_timeout_s", 120.0)
    if isinstance(runtime, InProcessRuntime):
        group = InProcessPartitionGroup(replica_id, factory, shards, layout, num_partitions, timeout_s)
        return Role("replica", replica_id, _Locked(group))
    if runtime.name == "ray":
        from distbelief.runtime.partition_ray import create_ray_partition_group

        return create_ray_partition_group(runtime, replica_id, factory, shards, layout, threads, num_partitions)
    raise ConfigError("partitions", f"the {runtime.name} runtime cannot place partitioned replicas")


def kill_partition(runtime: Runtime, role: Role, partition_id: int) -> None:
    """Fault injection: kill one partition of the partitioned replica ``role`` abruptly (on Ray its actor's
    process; in process, the partition stops as if its process had died). The group's ``run`` then fails and the
    trainer replaces the whole group, as for any replica failure."""
    if isinstance(runtime, InProcessRuntime):
        role.handle.obj.kill_partition(partition_id)
        return
    if runtime.name == "ray":
        from distbelief.runtime.partition_ray import kill_ray_partition

        kill_ray_partition(role, partition_id)
        return
    raise ConfigError("kill_partition_id", f"the {runtime.name} runtime cannot kill a single partition")
