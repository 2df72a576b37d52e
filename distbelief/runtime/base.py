"""The runtime interface: how roles (shards, replicas) are placed and called.

Algorithms and the trainer talk only to this interface. Two implementations: :mod:`inprocess` (threads, for fast
deterministic tests) and :mod:`ray_runtime` (one Ray actor process per role, local or on a cluster).
"""

from __future__ import annotations

import random
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

import numpy as np

from distbelief.exceptions import ConfigError, RoleFailedError


class Future(ABC):
    """A pending remote call. ``result`` raises RemoteTimeoutError or RoleFailedError; it never waits forever."""

    @abstractmethod
    def result(self, timeout_s: float) -> Any: ...

    @abstractmethod
    def done(self) -> bool: ...

    def as_arg(self) -> Any:
        """What to pass to another remote call so the value moves role-to-role without visiting the driver."""
        return self.result(3600.0)


class Done(Future):
    """A call that already finished (a result, or the error it raised)."""

    def __init__(self, value=None, error: BaseException | None = None):
        self._value, self._error = value, error

    def result(self, timeout_s: float):
        if self._error is not None:
            raise self._error
        return self._value

    def done(self) -> bool:
        return True


class _Chained(Future):
    """A push followed by a fetch issued right after it (the default ``push_fetch_async``): the result is the
    fetch's, once both are done, within one overall timeout."""

    def __init__(self, push: Future, fetch: Future):
        self.push, self.fetch = push, fetch

    def result(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        self.push.result(timeout_s)
        return self.fetch.result(max(0.0, deadline - time.monotonic()))

    def done(self) -> bool:
        return self.push.done() and self.fetch.done()


class _Mapped(Future):
    """Another future's result passed through ``fn``."""

    def __init__(self, inner: Future, fn):
        self.inner, self.fn = inner, fn

    def result(self, timeout_s: float):
        return self.fn(self.inner.result(timeout_s))

    def done(self) -> bool:
        return self.inner.done()


class SplitFuture(Future):
    """A call whose method returns ``(part_0, ..., part_{n-1}, summary)`` (see ``Runtime.call_split``).

    ``result`` returns only the small ``summary``: waiting for the call, and learning that it failed, costs no bulk
    transfer. ``part(k)`` is what to hand on to the role that consumes part k (``Runtime.call_with_parts``)."""

    @abstractmethod
    def part(self, k: int) -> Any: ...


class _WholeSplit(SplitFuture):
    """The default split call: the whole answer comes back through ``Runtime.call`` (fine in one process)."""

    def __init__(self, inner: Future):
        self.inner, self._value = inner, None

    def result(self, timeout_s: float):
        self._value = self.inner.result(timeout_s)
        return self._value[-1]

    def done(self) -> bool:
        return self.inner.done()

    def part(self, k: int):
        if self._value is None:
            raise RuntimeError("part() before result(): wait for the split call first")
        return self._value[k]


def part_values(part):
    """A gradient part as ``ParameterShard.apply_mean`` reads it: flat float32 values. A part ``(values, rows)``
    (a model with embedding tables: the shard's rows of the gradient ride with its range, downpour/replica.py
    ``sync_step``) keeps its rows as they are; an encoded part (a compressed push, distbelief/compression: it knows
    its own range and decodes itself) passes as it is."""
    if hasattr(part, "decode"):
        return part
    if isinstance(part, tuple):
        return part_values(part[0]), part[1]
    return np.asarray(part, dtype=np.float32).reshape(-1)


class Role:
    """A placed role: its kind ("shard", "replica"), id, and the runtime's private handle."""

    def __init__(self, kind: str, role_id: int, handle: Any):
        self.kind, self.role_id, self.handle = kind, role_id, handle
        self.node_hint: str | None = None  # the node the runtime asked for, when it chose one (placement)

    @property
    def name(self) -> str:
        return f"{self.kind} {self.role_id}"


class ShardClient(ABC):
    """A replica's (or the driver's) connection to all parameter shards.

    ``fetch_async().result(t)`` -> ``(parts, versions)``: ``parts`` is ``[(lo, values), ...]`` with one entry per
    shard (values must not be written by the caller), ``versions[k]`` the shard's version.
    ``push_async(grad, versions, num_examples)`` sends each shard its own range of the flat ``grad`` (copied
    before the call returns, so the caller may reuse the buffer).

    When a shard dies, calls to it are not lost: they wait (bounded by the call's timeout) until the trainer
    installs the restarted shard with ``replace_shard`` and are then re-sent to it. ``acked[k]`` is the highest
    version shard k acknowledged to this client (used to count updates lost in a shard failure).
    """

    def __init__(self, handles: list, layout):
        self.handles = list(handles)
        self.layout = layout
        self.acked = [0] * len(self.handles)
        self._replaced = threading.Condition()
        # Pushes carry (session, seq) so that a shard can recognise a push it already applied when it is re-sent.
        self.session = random.getrandbits(62) | 1
        self.seq = 0
        # How this client's fetches ask (set by its replica, from --compress-fetch): float16 values, or per
        # shard the (token, version) of its last fetch there, for only the values changed since (a delta).
        self.fetch_half = False
        self.fetch_since: list[tuple[str, int]] | None = None

    def fetch_args(self) -> list[tuple]:
        """Per shard, the arguments of its ``fetch`` call (ps/shard.py ``fetch``)."""
        if self.fetch_since is not None:
            return [(self.replica_id, False, self.fetch_since[k]) for k in range(len(self.handles))]
        if self.fetch_half:
            return [(self.replica_id, True)] * len(self.handles)
        return [(self.replica_id,)] * len(self.handles)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def replace_shard(self, shard_id: int, handle) -> int:
        """Install a restarted shard. Returns the highest version the old one acknowledged to this client (the
        trainer counts the updates its failure lost from it); ``acked`` starts again for the new one."""
        with self._replaced:
            old, self.acked[shard_id] = self.acked[shard_id], 0
            self.handles[shard_id] = handle
            self._replaced.notify_all()
        return old

    # Per shard, a handle applying this client's pushes to the shard's memory directly (ps/colocated.py), or
    # None: every call goes to the shard's process.
    colocated: list | None = None
    # How calls and bytes reach the shards (on Ray: runtime/transports/), for the run's summary.
    transport_name: str = "in-process"

    # Replicas wait for a restarted shard; the driver's own client must not, because the driver is the one that
    # restarts shards (it would wait for itself). Its calls fail at once and the trainer restarts, then retries.
    wait_for_replacement = True

    def await_replacement(self, shard_id: int, old, deadline: float):
        """Block until shard ``shard_id``'s handle is no longer ``old``; RoleFailedError at ``deadline``."""
        if not self.wait_for_replacement:
            raise RoleFailedError(f"parameter shard {shard_id} died")
        with self._replaced:
            while self.handles[shard_id] is old:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RoleFailedError(
                        f"parameter shard {shard_id} died and was not restarted in time (remote_timeout_s)")
                self._replaced.wait(min(left, 0.5))
            return self.handles[shard_id]

    def _ack(self, versions) -> None:
        for k, v in enumerate(versions):
            if v is not None and v > self.acked[k]:
                self.acked[k] = v

    @abstractmethod
    def fetch_async(self) -> Future: ...

    @abstractmethod
    def push_async(self, grad, versions: Sequence[int] | None, num_examples: int, rows=None) -> Future:
        """``rows`` (a model with embedding tables, ps/slicer.py): per row group None or ``(keys, values)``, the
        row-sparse gradient — sorted unique keys (int64) and their summed values (float32 ``(len(keys), dim)``).
        Each shard gets its own rows with its dense range, as one update."""

    # -- embedding-table rows (the layout is then a ps.slicer.Slicer)
    def fetch_rows_async(self, requests: list) -> Future:
        """``requests[g]``: sorted unique keys of row group ``g`` (None: none). ``result`` is, per group, a float32
        ``(len(keys), dim)`` array of those rows' current values (None where nothing was asked)."""
        per_shard, places = self._split_requests(requests)
        answers = self._fetch_rows_calls(per_shard)
        return _Mapped(answers, lambda replies: self._assemble_rows(requests, places, replies))

    def _fetch_rows_calls(self, per_shard: list[list]) -> Future:
        """One ``fetch_rows`` call per shard (``per_shard[k]``: its local ids per table); the result is the list
        of the shards' ``(values, version)`` answers."""
        raise NotImplementedError(f"{type(self).__name__} cannot fetch embedding-table rows")

    def check_rows(self, rows_or_ids: list) -> None:
        """ValueError naming the table for a key outside its row group (nothing has been sent yet). The replica
        checks each table's ids against the table before it turns them into keys (downpour/sparse.py)."""
        for g, (group, entry) in enumerate(zip(self.layout.groups, rows_or_ids)):
            if entry is None:
                continue
            ids = entry[0] if isinstance(entry, tuple) else entry
            if len(ids) and (int(ids[0]) < 0 or int(ids[-1]) >= group.num_rows):
                bad = ids[(ids < 0) | (ids >= group.num_rows)][0]
                raise ValueError(self.layout.describe_key(g, int(bad)))

    def _split_push_rows(self, rows) -> list:
        """Per shard, its part of a push's ``rows`` (None for every shard when there are none)."""
        if rows is None:
            return [None] * len(self.handles)
        self.check_rows(rows)
        return self.layout.split_rows(rows)

    def _split_requests(self, requests: list) -> tuple[list[list], list[list]]:
        self.check_rows(requests)
        per_shard = [[None] * len(requests) for _ in self.handles]
        places = [[None] * len(requests) for _ in self.handles]
        for t, ids in enumerate(requests):
            if ids is None:
                continue
            for k, (pos, local) in enumerate(self.layout.split_ids(np.asarray(ids, dtype=np.int64))):
                if pos.size:
                    per_shard[k][t], places[k][t] = local, pos
        return per_shard, places

    def _assemble_rows(self, requests: list, places: list[list], replies: list) -> list:
        out = [None if ids is None else np.empty((len(ids), group.dim), dtype=np.float32)
               for ids, group in zip(requests, self.layout.groups)]
        for k, (values, _version) in enumerate(replies):
            for t, pos in enumerate(places[k]):
                if pos is not None:
                    out[t][pos] = values[t]
        return out

    def push_fetch_async(self, grad, versions: Sequence[int] | None, num_examples: int, rows=None) -> Future:
        """Push, then fetch the parameters that result: ``result`` is the fetch's ``(parts, versions)``.

        A replica that fetches before every step and pushes after it (no prefetch) issues this instead of a push
        and the next step's fetch. Each shard sees the fetch right after the push (calls from one caller to one
        shard run in order), as if the two were sent separately; runtimes that can, do both in one call per
        shard. Until ``result`` returns, the caller must leave ``grad`` unchanged (it may be read in place)."""
        return _Chained(self.push_async(grad, versions, num_examples, rows=rows), self.fetch_async())

    def shared_buffers(self):
        """``(params, grads)``: float32 numpy buffers that fetches write into and pushes may read from in place,
        or None. A replica in the fused push-fetch loop binds its model to them and so skips two copies of the
        parameter vector per step."""
        return None


class Runtime(ABC):
    name: str = "runtime"

    @abstractmethod
    def create_shard(self, shard_id: int, factory: Callable[[], Any]) -> Role:
        """Place a shard built by ``factory()`` (called where the shard lives)."""

    @abstractmethod
    def create_replica(
        self, replica_id: int, factory: Callable[[ShardClient], Any], shards: list[Role], layout, threads: int
    ) -> Role:
        """Place a replica built by ``factory(client)``, where ``client`` connects it to ``shards``."""

    @abstractmethod
    def call(self, role: Role, method: str, *args, **kwargs) -> Future:
        """Call ``method`` on the role's object asynchronously."""

    def call_split(self, role: Role, method: str, num_parts: int, *args) -> SplitFuture:
        """Call ``method``, which returns ``num_parts`` arrays and then a small summary, so that each part can go
        on to a different role (``call_with_parts``) without visiting the driver. On Ray every part is an object
        of its own, left where it was made; here the whole answer comes back as one value."""
        return _WholeSplit(self.call(role, method, *args))

    def call_with_parts(self, role: Role, method: str, parts: list, lo: int) -> Future:
        """Call ``method(*parts, offset=lo)`` on ``role``: ``parts`` are ``SplitFuture.part`` values, all covering
        flat ``[lo, lo + len)`` of a vector that is zero elsewhere (``ParameterShard.apply_mean``). Only the parts
        travel, and no full-length vector is built: for a Fig. 4 shard that took a third of its time in a sync
        step."""
        return self.call(role, method, *[part_values(p) for p in parts], offset=lo)

    @abstractmethod
    def shard_client(self, shards: list[Role], layout, replica_id: int = -1) -> ShardClient:
        """A client usable in the driver process (evaluation, checkpoints)."""

    @abstractmethod
    def kill(self, role: Role) -> None:
        """Kill a role abruptly (fault injection and cleanup)."""

    def release(self, role: Role) -> None:
        """``role`` finished its work (a run's end): stop it. A runtime that keeps idle processes for the next
        run (Ray's warm pool, runtime/warm.py) may keep its process instead."""
        self.kill(role)

    @abstractmethod
    def wait_any(self, futures: list[Future], timeout_s: float) -> list[Future]:
        """Return the subset of ``futures`` that are done, waiting at most ``timeout_s`` for at least one."""

    def check_capacity(self, num_replicas: int, partitions: int = 1, log: Callable[[str], None] | None = None
                       ) -> str | None:
        """Before any worker starts: refuse (ConfigError) a job this runtime cannot place, or adapt to it and
        return the one line that said so; None when it fits. Threads in one process always fit."""
        return None

    def create_partition_group(self, replica_id: int, factory: Callable, shards: list[Role] | None, layout,
                               threads: int, num_partitions: int) -> Role:
        """Place a model-parallel replica as ``num_partitions`` partitions; returns its replica role, which
        answers the calls a replica answers (``run``, ``stop``, ``pause``, ``resume``, ``stats``, ``kill``,
        ``replace_shard``) plus ``params``.

        ``factory(partition_id, client_for, transport)`` builds each partition where it lives;
        ``client_for(lo, hi)`` gives a client for the shards holding ``[lo, hi)`` (None when ``shards`` is None:
        the partitions then update their parameters locally). When one partition dies the group's ``run`` fails
        promptly, and ``kill(role)`` tears the whole group down."""
        raise ConfigError("partitions", f"the {self.name} runtime cannot place partitioned replicas")

    def kill_partition(self, role: Role, partition_id: int) -> None:
        """Fault injection: kill one partition of the partitioned replica ``role`` abruptly; the group's ``run``
        then fails as for any replica failure."""
        raise ConfigError("kill_partition_id", f"the {self.name} runtime cannot kill a single partition")

    def create_backup(self, shard_id: int, factory: Callable[[], Any], away_from: Role) -> Role:
        """Place a backup of shard ``shard_id`` (``--durability replicate``, ps/replication.py): a shard like any
        other, on another node than ``away_from`` where the cluster has one."""
        return self.create_shard(shard_id, factory)

    def avoidably_together(self, a: Role, b: Role) -> bool:
        """Whether roles ``a`` and ``b`` share a machine (that could fail with both) although the cluster has
        another one that could host a shard. False when unknown, and always in one process."""
        return False

    def backup_link(self, backup: Role) -> Any:
        """What a primary shard forwards its updates through to ``backup`` (``ReplicatedShard.attach_backup``):
        picklable, with the link protocol of ps/replication.py (``call``, ``push``, ``version_of``, ``handoff``),
        each raising RoleFailedError or RemoteTimeoutError when the backup is gone, never hanging."""
        raise ConfigError("durability", f"the {self.name} runtime cannot replicate parameter shards")

    def create_clocks(self, bound: int):
        """The clock table of a stale-synchronous run (``runtime/clocks.py``): a ClockGate that replicas built
        by this runtime can use wherever they live."""
        raise ConfigError("consistency", f"the {self.name} runtime cannot run stale-synchronous replicas")

    def free_replica_slots(self) -> int | None:
        """How many more replicas the runtime could place right now (elastic Downpour); None: no limit (threads
        in one process)."""
        return None

    def driver_spare_cpus(self, replicas: list[Role], threads_per_replica: int) -> float:
        """Cores on the driver's machine left free by the replicas placed there; the driver evaluates on them
        while training goes on when at least one is free. None by default: roles share the driver's cores."""
        return 0.0

    def shutdown(self) -> None:
        """Release the runtime's roles."""
