"""Model-parallel replicas on Ray: one actor per partition, a replica's partitions in one placement group.

Layout of one replica::

    PartitionGroupActor (0 CPU: the replica role the trainer calls — run / stop / stats / kill)
      └─ placement group, P bundles, PACK (co-located where the cluster has room)
           PartitionActor 0 (head) ... PartitionActor P-1   (1 CPU each; a share of one when the local Ray runs
                                                             oversubscribed, see RayRuntime.check_capacity)

Transport choice (measured with an actor ping-pong, numbers in docs/partitioning.md): a partition sends a
boundary tensor as a plain numpy array argument of a one-way ``deliver`` call on the destination actor. Ray
serialises a numpy array as a raw buffer (pickle protocol 5 out-of-band data, not a pickled Python object), and
on one node a large one goes through the shared-memory object store and is mapped, not copied, by the receiver.
The call needs no rendezvous: the sender never waits for the receiver to post a matching receive, which keeps
the forward and backward passes free of deadlocks by construction.

Failures: when one partition actor dies, the group actor's ``run`` sees its call fail, aborts the others' waits
and fails at once. The replica role (:class:`RayPartitionGroupRole`) holds the handles of the partition actors and
the placement group as well as the group actor's, so ``runtime.kill(role)`` releases all of them immediately;
the trainer then places a fresh group. Why explicitly: the partition actors would die with the group actor that
created them, but its placement group would not (Ray 2.60 keeps a placement group made by a killed actor until
the job ends), and the fresh group needs those CPUs.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Hashable

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from distbelief.exceptions import ConfigError, RemoteTimeoutError, RoleFailedError
from distbelief.runtime.base import Future, Role, ShardClient
from distbelief.runtime.group_stats import merge_partition_stats
from distbelief.runtime.transport import Mailbox, Transport
from distbelief.runtime.transports.calls import ShardCalls

PARTITION_CPUS = 1.0  # the default; the runtime's ``partition_cpus`` is what a partition asks for


def _to_tensor(arr: np.ndarray) -> torch.Tensor:
    """A torch view of a received buffer. Buffers mapped from the object store are read-only; partitions never
    write received tensors (they are autograd leaves), so a zero-copy view is safe."""
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    return torch.frombuffer(memoryview(arr).cast("B"), dtype=torch.float32).view(arr.shape)


class RayTransport(Transport):
    """Sends are one-way actor calls carrying numpy buffers; receives wait on this actor's mailbox."""

    def __init__(self, partition_id: int, mailbox: Mailbox):
        self.partition_id, self.mailbox = partition_id, mailbox
        self.peers: list[Any] = []

    def send(self, dst: int, key: Hashable, tensor: torch.Tensor) -> None:
        # Fire and forget: a lost message surfaces as the receiver's timeout, naming the sender and the key.
        self.peers[dst].deliver.remote(self.partition_id, key, tensor.detach().numpy())

    def recv(self, src: int, key: Hashable, timeout_s: float) -> torch.Tensor:
        return _to_tensor(self.mailbox.take(src, key, timeout_s))


class RayRangeClient(ShardClient):
    """A partition's client for the shards holding its flat range ``[lo, hi)`` — only those are ever called."""

    def __init__(self, shard_handles: list, layout, replica_id: int, timeout_s: float, lo: int, hi: int):
        super().__init__(shard_handles, layout)
        self.replica_id, self.timeout_s, self.lo, self.hi = replica_id, timeout_s, lo, hi
        self.shard_ids = layout.shards_overlapping(lo, hi)

    transport_name = "object-store"

    def fetch_async(self) -> Future:
        def split(out):
            return [(o[0], o[1]) for o in out], {k: o[2] for k, o in zip(self.shard_ids, out)}

        sends = {k: ("call", ("fetch_range", self.lo, self.hi, self.replica_id)) for k in self.shard_ids}
        return ShardCalls(self, "fetch_range", sends, transform=split)

    def push_async(self, grad, versions, num_examples: int, rows=None) -> Future:
        g = grad.numpy() if hasattr(grad, "numpy") else grad
        sends = {}
        seq = self.next_seq()
        for k in self.shard_ids:
            s_lo, s_hi = self.layout.range(k)
            a, b = max(s_lo, self.lo), min(s_hi, self.hi)
            # Each slice is serialised right here, so the caller may reuse its gradient buffer. (session, seq) let
            # a restarted shard recognise a re-sent push it had already applied before it died.
            sends[k] = ("call", ("push", self.replica_id, g[a - self.lo: b - self.lo], a,
                                 versions[k] if versions else 0, num_examples, self.session, seq))

        def ack(out):
            by_shard = dict(zip(self.shard_ids, out))
            acked = [by_shard.get(k) for k in range(len(self.handles))]
            self._ack(acked)
            return acked

        return ShardCalls(self, "push", sends, transform=ack)


@ray.remote(concurrency_groups={"io": 1})
class PartitionActor:
    """Hosts one partition. Two threads: the default one runs the partition (``call``: run, step, params); the
    ``io`` one takes deliveries and control calls (``control``: stats, stop, replace_shard) while ``run`` waits
    for messages. One thread each, not a pool: measured round trips are 2x shorter than with 8 threads."""

    def __init__(self, threads: int, factory: Callable, partition_id: int, replica_id: int, shard_handles,
                 layout, timeout_s: float):
        torch.set_num_threads(max(1, threads))
        self.mailbox = Mailbox(f"replica {replica_id} partition {partition_id}")
        self.transport = RayTransport(partition_id, self.mailbox)

        def client_for(lo: int, hi: int) -> RayRangeClient:
            return RayRangeClient(shard_handles, layout, replica_id, timeout_s, lo, hi)

        self.obj = factory(partition_id, client_for if shard_handles is not None else None, self.transport)

    def connect(self, peers: list) -> int:
        self.transport.peers = peers
        return os.getpid()

    @ray.method(concurrency_group="io")
    def deliver(self, src: int, key: Hashable, array: np.ndarray) -> None:
        self.mailbox.put(src, key, array)

    @ray.method(concurrency_group="io")
    def abort(self, reason: str) -> None:
        self.mailbox.fail(RoleFailedError(reason))

    @ray.method(concurrency_group="io")
    def control(self, method: str, *args):
        return getattr(self.obj, method)(*args)

    def call(self, method: str, *args, **kwargs):
        return getattr(self.obj, method)(*args, **kwargs)


@ray.remote
class PartitionGroupActor:
    """A model replica made of P partition actors; answers the calls of a replica role."""

    def __init__(self, replica_id: int, factory: Callable, shard_handles, layout, num_partitions: int,
                 threads: int, timeout_s: float, startup_timeout_s: float, partition_cpus: float = PARTITION_CPUS):
        self.replica_id, self.timeout_s = replica_id, timeout_s
        # PACK: all partitions of a replica on one node when it has room (their messages then stay in shared
        # memory), spread over nodes otherwise.
        self.pg = placement_group([{"CPU": partition_cpus}] * num_partitions, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=startup_timeout_s)
        except GetTimeoutError:
            raise RemoteTimeoutError(
                f"replica {replica_id}: no room for {num_partitions} partitions x {partition_cpus:g} CPU within "
                f"{startup_timeout_s:.0f}s; use fewer partitions or replicas") from None
        self.actors = [
            PartitionActor.options(
                num_cpus=partition_cpus, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=p),
            ).remote(threads, factory, p, replica_id, shard_handles, layout, timeout_s)
            for p in range(num_partitions)
        ]
        ray.get([a.connect.remote(self.actors) for a in self.actors], timeout=startup_timeout_s)

    def _all(self, method: str, *args, control: bool = False) -> list:
        refs = [(a.control if control else a.call).remote(method, *args) for a in self.actors]
        return ray.get(refs, timeout=self.timeout_s)

    def call(self, method: str, *args, **kwargs):
        return getattr(self, f"_{method}")(*args, **kwargs)

    def pid(self) -> int:
        return os.getpid()

    def members(self) -> tuple[list, Any]:
        """The partition actors and the placement group, for the driver's role (see RayPartitionGroupRole)."""
        return self.actors, self.pg

    def _run(self, max_steps: int | None = None, max_seconds: float | None = None) -> dict:
        refs = [a.call.remote("run", max_steps, max_seconds) for a in self.actors]
        partition_of = {r: p for p, r in enumerate(refs)}
        pending = list(refs)
        while pending:
            # Short waits in a loop: the partitions' own receive timeouts bound how long a stuck group lives.
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for r in ready:
                try:
                    ray.get(r, timeout=self.timeout_s)
                except Exception as e:  # noqa: BLE001 - one partition failed: end the others' waits now
                    p = partition_of[r]
                    if isinstance(e, RayActorError):
                        reason = f"partition {p}'s process died ({type(e).__name__})"
                    else:
                        reason = f"partition {p} failed: {getattr(e, 'cause', None) or e}"
                    for a in self.actors:
                        a.abort.remote(f"replica {self.replica_id}: {reason}")
                    raise RoleFailedError(f"replica {self.replica_id}: {reason}") from e
        return self._stats()

    def _stop(self) -> None:
        ray.get(self.actors[0].control.remote("stop"), timeout=self.timeout_s)

    def _pause(self, timeout_s: float) -> bool:
        # Polled with zero-wait calls: the head's control calls share one thread with its message deliveries,
        # which the head may still need to finish the step it is in.
        deadline = time.monotonic() + timeout_s
        while not ray.get(self.actors[0].control.remote("pause", 0.0), timeout=self.timeout_s):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def _resume(self) -> None:
        ray.get(self.actors[0].control.remote("resume"), timeout=self.timeout_s)

    def _stats(self) -> dict:
        return merge_partition_stats(self._all("stats", control=True))

    def _replace_shard(self, shard_id: int, handle) -> int:
        return max([v or 0 for v in self._all("replace_shard", shard_id, handle, control=True)] + [0])

    def _params(self) -> list:
        return self._all("params")

    def _close(self) -> None:
        """Release the partitions and their placement group now (killing this actor also does, eventually)."""
        for a in self.actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(self.pg)

    def _broadcast(self, method: str, *args) -> list:
        """Call ``method`` on every partition at once (they run in lockstep) and return their answers."""
        return self._all(method, *args)


class RayPartitionGroupRole(Role):
    """A partitioned replica's role: calls go to the group actor (``handle``); it also holds the partition actors
    and the placement group, so that killing the role releases everything the group holds, at once (the placement
    group would otherwise outlive the group actor, see the module docstring)."""

    def __init__(self, replica_id: int, leader, partitions: list, pg):
        super().__init__("replica", replica_id, leader)
        self.partitions, self.placement_group = partitions, pg

    def release(self) -> None:
        """Kill the group actor and every partition actor, and remove the placement group (idempotent)."""
        for actor in [self.handle, *self.partitions]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        try:
            remove_placement_group(self.placement_group)
        except Exception:  # noqa: BLE001 - already removed
            pass


def kill_ray_partition(role: RayPartitionGroupRole, partition_id: int) -> None:
    """Fault injection: kill partition ``partition_id``'s actor process (the group actor survives it)."""
    ray.kill(role.partitions[partition_id], no_restart=True)


def create_ray_partition_group(runtime, replica_id: int, factory: Callable, shards: list[Role] | None, layout,
                               threads: int, num_partitions: int, adopt: Callable[[Any], None]
                               ) -> "RayPartitionGroupRole":
    """Place replica ``replica_id`` as ``num_partitions`` partition actors; returns the replica role.
    ``adopt(leader)`` hands the group's actor to the runtime as soon as it exists (its shutdown kills it)."""
    # A static check (CPUs of dead groups come back asynchronously); the placement group's wait covers the rest.
    # A job too big for the local Ray was given shares of a CPU by RayRuntime.check_capacity (oversubscribed).
    cpus = getattr(runtime, "partition_cpus", PARTITION_CPUS)
    total = ray.cluster_resources().get("CPU", 0.0)
    # Replicas 0..replica_id run at the same time, each with its own partitions.
    need = (replica_id + 1) * num_partitions * cpus
    if need > total + 1e-9:
        raise ConfigError("partitions", f"{replica_id + 1} replicas x {num_partitions} partitions x "
                                        f"{cpus:g} CPU need {need:g} CPUs but the Ray cluster has "
                                        f"{total:g}; use fewer partitions or replicas")
    handles = [s.handle for s in shards] if shards is not None else None
    per_partition_threads = max(1, threads // num_partitions)
    startup = getattr(runtime, "startup_timeout_s", 180.0)
    leader = PartitionGroupActor.options(num_cpus=0, max_concurrency=4, max_restarts=0).remote(
        replica_id, factory, handles, layout, num_partitions, per_partition_threads, runtime.remote_timeout_s,
        startup, cpus)
    adopt(leader)  # shutdown() kills it, and with it its partitions
    runtime.wait_ready([Role("replica", replica_id, leader)])
    try:
        partitions, pg = ray.get(leader.members.remote(), timeout=runtime.remote_timeout_s)
    except (GetTimeoutError, RayActorError) as e:
        raise RoleFailedError(f"replica {replica_id}: its partition group did not report its members: {e}") from e
    return RayPartitionGroupRole(replica_id, leader, partitions, pg)
