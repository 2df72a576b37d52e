"""Ray runtime: one actor process per role, on a local Ray instance or an existing cluster (``address``).

Why it is fast enough: arrays cross process boundaries through Ray's shared-memory object store (a fetched slice
is a zero-copy read-only numpy view in the replica); each push sends every shard only its own range; fetches and
pushes are non-blocking ``.remote()`` calls that overlap the replica's compute. Calls from one caller to one
(single-threaded) shard actor execute in submission order, which makes a replica's push-then-fetch sequence
consistent.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import socket
import sys
import threading
from typing import Any, Callable

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distbelief.exceptions import ClusterUnreachableError, ConfigError, RemoteTimeoutError, RoleFailedError
from distbelief.runtime import forwarded, ray_notice, shm, streams, transports
from distbelief.runtime.base import Future, Role, Runtime, ShardClient, SplitFuture, _Mapped, part_values
from distbelief.runtime.clocks import ClockGate
from distbelief.runtime.partition_ray import create_ray_partition_group, kill_ray_partition
from distbelief.runtime.ray_settings import SYSTEM_CONFIG
from distbelief.runtime.transports.backup import BackupLink
from distbelief.runtime.transports.calls import RayFuture as _RayFuture
from distbelief.runtime.warm import WarmKey, WarmPool


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast (Ray itself retries for ~14 minutes) when nothing listens at HOST:PORT."""
    if address in ("auto", "local") or address.startswith("ray://"):
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError("address", f"{address!r} is not HOST:PORT (e.g. 10.0.0.5:6379)")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ClusterUnreachableError(
            f"no Ray cluster reachable at --address {address}: {e}. Start one with `RAY_AUTH_MODE=token ray "
            f"start --head --port={port}` on that host (docs/cluster.md), or omit --address to run locally."
        ) from None


# The node id of the local Ray instance that connect() started in this process (None: none, or it was shut down).
_local_node_id: str | None = None


def started_locally() -> bool:
    """True when the Ray this process is connected to is the local instance connect() started (not a cluster
    joined with --address, nor one the caller initialised). Only there may a job run oversubscribed."""
    return ray.is_initialized() and _local_node_id is not None and (
        ray.get_runtime_context().get_node_id() == _local_node_id)


def use_token_if_available() -> bool:
    """Token authentication for joining a cluster with ``--address``, the way a local Ray does it.

    ``ray start --head`` (Ray >= 2.59) turns token authentication on where the machine has a token (a local
    ``ray.init()`` makes one on first use; ``ray get-auth-token --generate`` does too), and ``ray start`` and a
    local ``ray.init()`` use the token found in ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
    ``~/.ray/auth_token``; but Ray's ``ray.init(address=...)`` does not look unless ``RAY_AUTH_MODE=token`` is
    set, and without it the cluster refuses the connection. So: when the mode is unset and a token is there, use it. An explicit
    ``RAY_AUTH_MODE`` is respected. True when token authentication is on."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None:
        return mode.lower() == "token"
    if not ray_notice.token_present():
        return False
    try:  # Ray's own switch (it also refreshes Ray's cached configuration); pinned Ray version
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        return maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    except ImportError:
        os.environ["RAY_AUTH_MODE"] = "token"
        return True


def connect(address: str | None = None, num_cpus: int | None = None) -> None:
    """Start (or join) Ray once per process. A Ray already initialised by the caller is reused as it is."""
    global _local_node_id
    if ray.is_initialized():
        return
    ray_notice.install()  # Ray's token-authentication notice: once per machine, in our words
    common = dict(logging_level="WARNING", log_to_driver=True, configure_logging=True)
    if address:
        _check_reachable(address)
        token = use_token_if_available()
        try:
            ray.init(address=address, **common)
        except (ConnectionError, RuntimeError) as e:
            if "auth" not in str(e).lower() and "token" not in str(e).lower():
                raise
            hint = ("the token this machine has was refused: copy the cluster's (`ray get-auth-token` on its head "
                    "node) to ~/.ray/auth_token" if token else
                    "it requires token authentication: copy its token (`ray get-auth-token` on its head node) to "
                    "~/.ray/auth_token, or set RAY_AUTH_TOKEN")
            raise ClusterUnreachableError(f"could not join the Ray cluster at --address {address}: {hint} "
                                          f"({e})") from None
    else:
        ray.init(
            # "local": always a fresh instance of our own, never a cluster someone left running on this machine
            # (plain ray.init() would join one started by `ray start`); --address joins a cluster on purpose.
            address="local",
            num_cpus=num_cpus or os.cpu_count(),
            include_dashboard=False,
            dashboard_host="127.0.0.1",
            _system_config=SYSTEM_CONFIG,
            **common,
        )
        _local_node_id = ray.get_runtime_context().get_node_id()


# The idle role processes of finished runs on the local instance, for the next run's roles (runtime/warm.py).
_WARM = WarmPool()
RETIRE_TIMEOUT_S = 10.0  # how long a finished run waits for its roles to say they are idle (else: stopped)


def _kill_all(actors) -> None:
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone, or its Ray instance is
            pass


def release_workers() -> int:
    """Stop the warm role processes that finished runs left idle (runtime/warm.py); returns how many.
    ``ray.shutdown()`` stops them too, with the rest of the local Ray instance."""
    idle = _WARM.evict(_local_node_id, holding_only=False)
    _kill_all(idle)
    return len(idle)


def warm_workers() -> int:
    """How many idle role processes wait in the warm pool for the next run on this local Ray instance."""
    return _WARM.size(_local_node_id)


def _warm_key(stream_calls: int, options: dict) -> WarmKey:
    strategy = options.get("scheduling_strategy")
    node = getattr(strategy, "node_id", None)
    if node is not None:
        node = f"{node} {'soft' if strategy.soft else 'strict'}"
    elif strategy is not None:
        node = str(strategy)
    return WarmKey(stream_calls, float(options.get("num_cpus") or 0.0), float(options.get("num_gpus") or 0.0),
                   int(options.get("max_concurrency", 1)), tuple(sorted((options.get("resources") or {}).items())),
                   node)


# Shard placement. A node started with this custom resource (`ray start --resources='{"distbelief_shard": 1}'`)
# is dedicated to parameter shards: when the cluster has any, every shard asks for a sliver of it and so lands on
# one of them. Each shard asks for 1/1000, so a dedicated node can host up to 1000 shards.
SHARD_NODE_RESOURCE = "distbelief_shard"
SHARD_NODE_REQUEST = 0.001


def shard_nodes(shard_cpus: float, dedicated: bool) -> list[str]:
    """Ids of the alive nodes that could ever host a shard (enough CPUs in all; the dedicated resource when the
    cluster has dedicated shard nodes), in a stable order."""
    out = []
    for n in ray.nodes():
        total = n.get("Resources", {})
        if not n.get("Alive") or total.get("CPU", 0.0) + 1e-9 < shard_cpus:
            continue
        if dedicated and total.get(SHARD_NODE_RESOURCE, 0.0) < SHARD_NODE_REQUEST:
            continue
        out.append(n["NodeID"])
    return sorted(out)


def least_loaded(candidates: list[str], placed: list[str]) -> str | None:
    """The candidate node hosting the fewest of ``placed`` (the nodes of the other shards); first one on ties."""
    if not candidates:
        return None
    return min(candidates, key=lambda node: (placed.count(node), candidates.index(node)))


def _array_bytes(args) -> int:
    return sum(a.nbytes for a in args if isinstance(a, np.ndarray))


def _part_bytes(part) -> int:
    """Bytes of a split part (Runtime.call_with_parts): its range, and with embedding tables (``(values, rows)``)
    its rows' ids and values; an encoded part (a compressed push) its payload."""
    if hasattr(part, "decode"):
        return part.nbytes
    if isinstance(part, tuple):
        return _part_bytes(part[0]) + sum(_array_bytes(entry) for entry in part[1] if entry is not None)
    return _array_bytes([part])


def stream_threads(replicas: int) -> int:
    """Threads a shard's stream calls need for ``replicas`` replicas: each may have a push and a fetch waiting at
    once, and a fetch that waits for its replica's push must leave a thread for that push (else it would wait
    until its timeout and fall back to the object store). Ray starts them with the actor."""
    return min(256, max(8, 2 * replicas + 2))


_ACTOR_CLASSES: dict[int, Any] = {}


def role_actor(stream_calls: int = 1):
    """The Ray actor class that hosts a role, with ``stream_calls`` threads for stream calls (a shard's; other
    roles make none). Ray takes a concurrency group's size from the class, not from ``.options()``."""
    if stream_calls not in _ACTOR_CLASSES:
        _ACTOR_CLASSES[stream_calls] = ray.remote(
            concurrency_groups={"streams": stream_calls, "control": 1})(RoleActor)
    return _ACTOR_CLASSES[stream_calls]


class RoleActor:
    """Hosts one role object. The object is built here, inside the actor process.

    A shard's calls run one at a time (``max_concurrency = 1``), except its stream calls (runtime/streams.py):
    they run in a group of their own so that waiting for a push's bytes holds no one, and then apply under
    ``_serial``, which every call that touches the shard holds once a stream is open.

    A warm process (runtime/warm.py) hosts one role after another: ``retire`` empties it once its role is idle,
    ``become`` builds the next role in it. Every call that touches the role waits while one is being built, and
    counts itself in flight, so that ``retire`` never empties a process that is answering a call."""

    BECOME_TIMEOUT_S = 180.0  # how long a call waits for the role a warm process is building (become)

    def __init__(self, threads: int, factory: Callable, *args):
        import torch

        # The default generator's state in a fresh process: every role built here starts from it, as it would
        # in a process of its own (a role that draws from the global generator draws the same numbers).
        self._rng0 = torch.random.get_rng_state()
        self._count_lock = threading.Lock()
        self._inflight = 0
        self._built = threading.Event()
        self._become_error: BaseException | None = None
        self._setup(threads, factory, args)
        self._built.set()

    def _setup(self, threads: int, factory: Callable, args: tuple) -> None:
        import torch

        torch.set_num_threads(max(1, threads))
        torch.random.set_rng_state(self._rng0)
        self.obj = factory(*args)
        self._shm = shm.Attached()
        # Bytes of the arrays that arrived as call arguments: what really reached this process (a shard's own
        # counters count what it read, which is its range even when it was handed a whole vector).
        self.received = 0
        self._streams: dict[str, Any] = {}  # a shard's ends of replicas' streams (runtime/streams.py), by name
        self._stream_timeout_s = 120.0
        self._serial: Any = contextlib.nullcontext()  # a lock once a stream call can run beside the others

    @contextlib.contextmanager
    def _active(self):
        """Around every call that touches the role: waits while the role is being built (``become``) and
        counts the call in flight."""
        while True:
            if not self._built.wait(self.BECOME_TIMEOUT_S):
                raise RuntimeError("this worker process hosts no role (it is idle in the warm pool)")
            with self._count_lock:
                if self._built.is_set():
                    self._inflight += 1
                    break
        try:
            if self._become_error is not None:
                raise RuntimeError(f"this role could not be built: {self._become_error!r}")
            yield
        finally:
            with self._count_lock:
                self._inflight -= 1

    @ray.method(concurrency_group="control")
    def become(self, threads: int, factory: Callable, *args) -> int:
        """Build the next role in this warm process (emptied by ``retire``), as the constructor built the first;
        returns the pid. Calls that arrive meanwhile wait for it (the control group leaves them their threads)."""
        if self._built.is_set():
            raise RuntimeError("become: this process still hosts a role")
        try:
            self._become_error = None
            self._setup(threads, factory, args)
        except BaseException as e:
            self._become_error = e
            raise
        finally:
            self._built.set()
        return os.getpid()

    def retire(self) -> bool:
        """Empty this process for the warm pool, if its role is idle: no call in flight, no stream open, no
        thread of the role's still running (a background snapshot). False, leaving everything as it is,
        otherwise (the runtime then stops the process)."""
        with self._count_lock:
            if self._inflight or self._streams or self._become_error is not None or not self._built.is_set():
                return False
            if any(t.is_alive() and t.name.startswith("distbelief") for t in threading.enumerate()):
                return False
            self._built.clear()
        self.obj = None
        self._shm = shm.Attached()  # (its mappings of the run's buffers go with the old one)
        gc.collect()  # the role's arrays (and mapped buffers) now, not at some later collection
        return True

    def call(self, method: str, *args, **kwargs):
        with self._active(), self._serial:
            self.received += _array_bytes(args)
            value = getattr(self.obj, method)(*args, **kwargs)
            return forwarded.answer(self.obj, value) if method == "push" else value

    def push_fetch(self, num_push_args: int, *args):
        """A shard's ``push`` (the first ``num_push_args`` of ``args``; flat, so that Ray resolves an object
        reference among them) and then its ``fetch`` (the rest) in one call, the object-store transport's fused
        step: ``(version after the push, fetch's answer)``, with the backup's acknowledgement of the push if one."""
        push_args, fetch_args = args[:num_push_args], args[num_push_args:]
        with self._active(), self._serial:
            self.received += _array_bytes(push_args)
            pushed = self.obj.push(*push_args)
            return forwarded.answer(self.obj, (pushed, self.obj.fetch(*fetch_args)))

    def call_placed(self, method: str, lo: int, *parts):
        """``method(*parts, offset=lo)``, the parts covering flat ``[lo, lo + len)`` (Runtime.call_with_parts):
        only the parts crossed the network."""
        with self._active(), self._serial:
            self.received += sum(_part_bytes(p) for p in parts)
            return getattr(self.obj, method)(*[part_values(p) for p in parts], offset=lo)

    def received_bytes(self) -> int:
        with self._active():
            return self.received

    # The shared-memory data plane (runtime/shm.py): the bulk bytes of a push or fetch are in a replica's buffer.
    def push_shm(self, path: str, size: int, *push_args):
        with self._active(), self._serial:
            return forwarded.answer(self.obj, self._shm.push(self.obj, path, size, *push_args))

    def fetch_shm(self, path: str, size: int, replica_id: int):
        with self._active(), self._serial:
            return self._shm.fetch(self.obj, path, size, replica_id)

    def push_fetch_shm(self, push_path: str, fetch_path: str, size: int, *push_args):
        with self._active(), self._serial:
            return forwarded.answer(self.obj, self._shm.push_fetch(self.obj, push_path, fetch_path, size,
                                                                   *push_args))

    # The stream data plane (runtime/streams.py): the bulk bytes of a push or fetch come by a replica's stream.
    def stream_open(self, name: str, host: str, port: int, size: int, timeout_s: float) -> bool:
        """Join the stream ``name`` that a replica is opening at the same time (its store at ``host:port``)."""
        with self._active():
            if not self._streams:
                # (here, in the default group, no other call runs: from now on stream calls can, so calls
                # serialise)
                self._serial = threading.RLock()
            for old in [n for n, end in self._streams.items() if end.error is not None]:
                self._streams.pop(old).close()  # replicas that are gone
            store = streams.open_store(host, port, False, timeout_s)
            pg = streams.open_pair(store, name, 1, ray.util.get_node_ip_address(), timeout_s, streams.FOREVER)
            self._streams[name] = streams.ShardEnd(pg, size, f"stream {name}", store)
            self._stream_timeout_s = timeout_s
            return True

    def _stream(self, name: str):
        end = self._streams.get(name)
        if end is None:
            raise streams.StreamBroken(f"no stream {name} here (this shard was restarted)")
        return end

    def _pushed(self, end, index: int, g, push_args: tuple):
        """(Under ``_serial``) apply push ``index`` of stream ``end``, whose gradient ``g`` came by the stream."""
        self.received += g.nbytes
        replica_id, *rest = push_args
        try:
            return self.obj.push(replica_id, g, *rest)
        finally:  # (a push refused, e.g. non-finite, counts as done too: the replica's next fetch may go on)
            end.applied(index)

    def _fetched(self, end, index: int, replica_id: int) -> int:
        """(Under ``_serial``) answer a fetch on stream ``end``: a copy of the values is queued there."""
        values, version = self.obj.fetch(replica_id)
        end.send_fetch(index, values, self._stream_timeout_s)
        return version

    @ray.method(concurrency_group="streams")
    def push_stream(self, name: str, index: int, after_fetches: int, *push_args):
        """``push`` with the gradient taken from stream ``name`` (its push number ``index``), once the stream's
        first ``after_fetches`` fetches (those the replica sent before it) are answered; ``push_args`` are push's
        other arguments in order (replica id, offset, version, examples, session, seq)."""
        with self._active():
            end = self._stream(name)
            g = end.take_push(index, self._stream_timeout_s)
            end.await_answered(after_fetches, self._stream_timeout_s)
            with self._serial:
                return forwarded.answer(self.obj, self._pushed(end, index, g, push_args))

    @ray.method(concurrency_group="streams")
    def fetch_stream(self, name: str, index: int, after_pushes: int, replica_id: int) -> int:
        """``fetch``, its values sent on stream ``name`` (its fetch number ``index``) once the stream's first
        ``after_pushes`` pushes (those the replica sent before it) are applied; returns the version. (Calls of one
        stream so keep the order the replica sent them in, as Ray keeps one caller's calls to an actor.)"""
        with self._active():
            end = self._stream(name)
            end.await_applied(after_pushes, self._stream_timeout_s)
            with self._serial:
                return self._fetched(end, index, replica_id)

    @ray.method(concurrency_group="streams")
    def push_fetch_stream(self, name: str, push_index: int, fetch_index: int, *push_args):
        """``push_stream`` then ``fetch_stream`` in one call (its fetch is the stream's next: ``fetch_index - 1``
        fetches came before the push)."""
        with self._active():
            end = self._stream(name)
            g = end.take_push(push_index, self._stream_timeout_s)
            end.await_answered(fetch_index - 1, self._stream_timeout_s)
            with self._serial:
                pushed = self._pushed(end, push_index, g, push_args)
                return forwarded.answer(self.obj, (pushed, self._fetched(end, fetch_index, push_args[0])))

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


@ray.remote(num_cpus=0)
class ClockActor:
    """The clock table of a stale-synchronous run (runtime/clocks.py) as an asyncio actor: a replica that must
    wait holds no thread, and every clock change wakes the waiters."""

    def __init__(self, bound: int):
        import asyncio

        from distbelief.runtime.clocks import ClockTable

        self.table = ClockTable(bound)
        self.changed = asyncio.Condition()

    async def join(self, rid: int) -> int:
        async with self.changed:
            start = self.table.join(rid)
            self.changed.notify_all()
            return start

    async def report(self, rid: int, clock: int) -> int:
        async with self.changed:
            low = self.table.report(rid, clock)
            self.changed.notify_all()
            return low

    async def enter(self, rid: int, clock: int, timeout_s: float, first_try: bool) -> bool:
        import asyncio

        async with self.changed:
            if self.table.enter(rid, clock, first_try):
                self.changed.notify_all()
                return True
            self.changed.notify_all()  # our progress may let others go
            if timeout_s <= 0:
                return False
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.table.enter(rid, clock, False)),
                                       timeout_s)
            except asyncio.TimeoutError:
                return False
            return True

    async def retire(self, rid: int) -> None:
        async with self.changed:
            self.table.retire(rid)
            self.changed.notify_all()

    async def stats(self) -> dict:
        return self.table.stats()


class RayClocks(ClockGate):
    """A handle on a ClockActor (picklable: it travels to the replicas with their recipe)."""

    def __init__(self, actor, bound: int, timeout_s: float):
        self.actor, self.bound, self.timeout_s = actor, bound, timeout_s

    def join(self, rid: int) -> int:
        return _RayFuture(self.actor.join.remote(rid), "the clock table").result(self.timeout_s)

    def report(self, rid: int, clock: int) -> Future:
        return _RayFuture(self.actor.report.remote(rid, clock), "the clock table")

    def wait(self, rid: int, clock: int, timeout_s: float, first_try: bool = False) -> bool:
        return _RayFuture(self.actor.enter.remote(rid, clock, timeout_s, first_try), "the clock table").result(
            timeout_s + self.timeout_s)

    def retire(self, rid: int) -> None:
        self.actor.retire.remote(rid)

    def stats(self, timeout_s: float) -> dict:
        return _RayFuture(self.actor.stats.remote(), "the clock table").result(timeout_s)


def _build_replica(shard_handles, layout, replica_id, timeout_s, factory, shm_prefix=None, colocate=True,
                   stream=False):
    return factory(RayShardClient(shard_handles, layout, replica_id, timeout_s, shm_prefix, colocate, stream))


class _RaySplit(SplitFuture):
    """A call made with ``num_returns = parts + 1``: every part is an object of its own, stored where the role made
    it; only the last return (the small summary) is ever fetched by the driver."""

    def __init__(self, refs: list, role_name: str):
        self.refs, self.role_name = refs, role_name
        self.summary = _RayFuture(refs[-1], role_name)

    def result(self, timeout_s: float):
        return self.summary.result(timeout_s)

    def done(self) -> bool:
        return self.summary.done()

    def part(self, k: int):
        return self.refs[k]  # a reference: Ray moves the bytes from the producer to the consumer


class RayShardClient(ShardClient):
    """A replica's (or the driver's) client of the shards on Ray: the bookkeeping every transport shares (versions,
    sequence numbers, a push's table rows checked and split by shard once, acknowledgements) over one transport
    (runtime/transports/), the fastest that works where the client runs."""

    def __init__(self, shard_handles, layout, replica_id: int, timeout_s: float = 120.0,
                 shm_prefix: str | None = None, colocate: bool = True, stream: bool = False):
        super().__init__(shard_handles, layout)
        self.replica_id, self.timeout_s = replica_id, timeout_s
        self.transport = transports.choose(self, shm_prefix, colocate, stream)

    @property
    def colocated(self) -> list | None:
        return getattr(self.transport, "shards", None)

    @property
    def transport_name(self) -> str:
        return self.transport.name

    def _prepare(self, grad, versions, rows) -> tuple:
        g = grad.numpy() if hasattr(grad, "numpy") else grad
        vs = [versions[k] if versions else 0 for k in range(len(self.handles))]
        return g, vs, self.next_seq(), (None if rows is None else self._split_push_rows(rows))

    def _acked(self, versions_after):
        self._ack(versions_after)
        return versions_after

    def fetch_async(self) -> Future:
        return self.transport.fetch()

    def push_async(self, grad, versions, num_examples: int, rows=None) -> Future:
        g, vs, seq, per_shard = self._prepare(grad, versions, rows)
        return _Mapped(self.transport.push(g, vs, num_examples, seq, per_shard), self._acked)

    def push_fetch_async(self, grad, versions, num_examples: int, rows=None) -> Future:
        if not self.transport.fuses_push_fetch:  # a push, then a fetch
            return super().push_fetch_async(grad, versions, num_examples, rows)
        g, vs, seq, per_shard = self._prepare(grad, versions, rows)
        fused = self.transport.push_fetch(g, vs, num_examples, seq, per_shard)

        def unpack(reply):
            self._ack(reply[0])
            return reply[1]

        return _Mapped(fused, unpack)

    def _fetch_rows_calls(self, per_shard: list[list]) -> Future:
        return self.transport.fetch_rows(per_shard)

    def shared_buffers(self):
        return self.transport.shared_buffers()

    def replace_shard(self, shard_id: int, handle):
        """Install a restarted shard; returns the highest version this client had from the old one."""
        return self.transport.replace_shard(shard_id, handle)


def _warn(message: str, log: Callable[[str], None] | None) -> None:
    """One warning line through the run's log, or on stderr without one."""
    if log is not None:
        log(f"warning: {message}")
    else:
        print(f"[distbelief] warning: {message}", file=sys.stderr, flush=True)


class RayRuntime(Runtime):
    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: int | None = None, replica_cpus: float = 1.0,
                 shard_cpus: float = 0.0, startup_timeout_s: float = 180.0, remote_timeout_s: float = 120.0,
                 use_shm: bool = True, colocate: bool = True, use_streams: bool = True, reuse_workers: bool = True):
        connect(address, num_cpus)
        # Build roles in the warm processes of finished runs, and leave this run's there when it ends (local
        # instance only: runtime/warm.py).
        self.reuse_workers = reuse_workers
        self._warm_keys: dict[Any, WarmKey] = {}  # by actor id: the options each role process was started with
        self._becoming: dict[Any, Any] = {}  # by actor id: the ``become`` call of a role built in a warm process
        self._gone: set = set()  # ids of the actors that kill() stopped
        self.replica_cpus, self.shard_cpus = replica_cpus, shard_cpus
        self.partition_cpus = 1.0  # each partition actor of a partitioned replica (partition_ray)
        # GPUs each replica actor asks Ray for (device = "cuda": 1; Ray then shows it only that GPU). With
        # ``replica_gpus_if_free`` (device = "auto"), check_capacity asks for one each when the cluster has a GPU
        # per replica, and none otherwise (the replicas then see no GPU and compute on the CPU).
        self.replica_gpus = 0.0
        self.replica_gpus_if_free = False
        self._shard_node: dict[int, str] = {}  # where each shard was asked to go (spreading the next ones)
        self._backup_node: dict[int, str] = {}  # ... and each shard's backup (--durability replicate)
        self.startup_timeout_s, self.remote_timeout_s = startup_timeout_s, remote_timeout_s
        self._actors: list[Any] = []
        self._groups: list[Role] = []  # partitioned replicas (partition_ray.RayPartitionGroupRole)
        # Replicas on the driver's machine exchange bulk bytes with shards through /dev/shm (runtime/shm.py).
        self.shm_prefix = shm.new_prefix() if use_shm and shm.available() else None
        # ... and apply their pushes to the shards' memory themselves (ps/colocated.py), unless told not to.
        self.colocate = colocate
        # Across nodes, dense replicas move their bulk bytes on gloo streams to the shards (runtime/streams.py).
        self.streams = use_streams
        self._replicas_hint = 0  # the most replicas this runtime may run at once (check_capacity)
        if self.shm_prefix:
            shm.remove_stale()  # buffers of runs whose driver was killed before it could remove them

    def check_capacity(self, num_replicas: int, partitions: int = 1, log: Callable[[str], None] | None = None
                       ) -> str | None:
        """Before any worker starts, make sure every replica (each of its ``partitions`` partitions when > 1) can
        be scheduled at once.

        On a cluster joined with --address, refuse a job that does not fit: its capacity is what it is, and a
        replica that cannot be placed would wait forever. On the local Ray we started, run it oversubscribed
        instead (a laptop's 2 cores can still run 4 replicas): each replica or partition asks for an equal
        share of the CPUs, and one line through ``log`` (stderr without one) says so. Returns that line, or None
        when the job fits.

        GPUs are never shared: replicas that ask for one each (``replica_gpus``) and outnumber the cluster's GPUs
        are refused, local Ray or not (ConfigError naming ``device``)."""
        self._check_gpus(num_replicas if partitions == 1 else 0, log)
        cpus = ray.cluster_resources().get("CPU", 0.0)
        unit = "partition" if partitions > 1 else "replica"
        per_unit = self.partition_cpus if partitions > 1 else self.replica_cpus
        # (as many replicas as the cluster holds may come and go in an elastic run: the shards' stream threads)
        self._replicas_hint = max(self._replicas_hint, num_replicas, int(cpus / max(per_unit, 1e-3)))
        units = num_replicas * partitions
        if units * per_unit <= cpus + 1e-9:
            return None
        what = f"{num_replicas} replicas" + (f" x {partitions} partitions" if partitions > 1 else "")
        if not started_locally() or cpus < 1e-3:
            raise ConfigError(
                "partitions" if partitions > 1 else "replicas",
                f"{what} x {per_unit:g} CPU each need {units * per_unit:g} CPUs but the Ray cluster has {cpus:g}; "
                f"use fewer {unit}s, or add nodes to the cluster",
            )
        share = math.floor(cpus / units * 1e4) / 1e4  # Ray counts resources in units of 1/10000
        if partitions > 1:
            self.partition_cpus = share
        else:
            self.replica_cpus = share
        message = (f"{what} on {cpus:g} cores: running oversubscribed (each {unit} gets a share of a core; expect "
                   f"less than linear speed-up)")
        _warn(message, log)
        return message

    def _check_gpus(self, num_replicas: int, log: Callable[[str], None] | None) -> None:
        """The GPU side of check_capacity: settle ``replica_gpus`` for device "auto", refuse a job whose replicas
        need more GPUs than the cluster has."""
        gpus = ray.cluster_resources().get("GPU", 0.0)
        if self.replica_gpus_if_free:
            self.replica_gpus = 1.0 if num_replicas and gpus >= num_replicas else 0.0
            if num_replicas and gpus and not self.replica_gpus:
                _warn(f"device auto: {num_replicas} replicas but {gpus:g} GPUs in the Ray cluster; the replicas "
                      f"compute on the CPU", log)
            return
        need = num_replicas * self.replica_gpus
        if need > gpus + 1e-9:
            raise ConfigError(
                "device",
                f"{num_replicas} replicas x {self.replica_gpus:g} GPU each need {need:g} GPUs but the Ray cluster has "
                f"{gpus:g}; use fewer replicas, device = \"auto\" (the CPU when GPUs are short) or \"cpu\", or add "
                f"GPU nodes",
            )

    def _warm_here(self) -> bool:
        return self.reuse_workers and started_locally()

    def _start_role(self, stream_calls: int, options: dict, threads: int, factory: Callable, *args):
        """A RoleActor with ``options`` hosting ``factory(*args)``: built in a warm process started with the
        same options if the pool has one, else in a new process."""
        key = _warm_key(stream_calls, options)
        actor = None
        if self._warm_here():
            actor = _WARM.take(_local_node_id, key)
            if actor is None and key.holds_resources:
                _kill_all(_WARM.evict(_local_node_id))  # idle processes must not keep this one waiting for a CPU
        if actor is None:
            actor = role_actor(stream_calls).options(**options).remote(threads, factory, *args)
        else:
            self._becoming[actor._actor_id] = actor.become.remote(threads, factory, *args)
        self._actors.append(actor)
        self._warm_keys[actor._actor_id] = key
        return actor

    def _retire_idle(self, actors: list) -> list:
        """Empty this run's role processes into the warm pool, if every one of them is idle (a role still busy
        -- an interrupted or failed run -- may yet touch the others: then none is kept); returns those kept."""
        roles = [a for a in actors if a._actor_id in self._warm_keys and a._actor_id not in self._gone]
        if not roles:
            return []
        try:
            idle = ray.get([a.retire.remote() for a in roles], timeout=RETIRE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - one died, or did not answer: keep none
            return []
        if not all(idle):
            return []
        _kill_all(_WARM.give(_local_node_id, [(self._warm_keys[a._actor_id], a) for a in roles]))
        return roles

    def create_partition_group(self, replica_id, factory, shards, layout, threads, num_partitions) -> Role:
        if self._warm_here():  # its placement group must not wait for CPUs that idle processes hold
            _kill_all(_WARM.evict(_local_node_id))
        role = create_ray_partition_group(self, replica_id, factory, shards, layout, threads, num_partitions,
                                          adopt=self._actors.append)
        self._groups.append(role)  # shutdown() releases its placement group too
        return role

    def kill_partition(self, role: Role, partition_id: int) -> None:
        kill_ray_partition(role, partition_id)

    def _ready(self, actor, role_name: str) -> None:
        becoming = self._becoming.pop(actor._actor_id, None)
        if becoming is not None:  # built in a warm process: its failure is the become call's
            _RayFuture(becoming, role_name).result(self.startup_timeout_s)
        _RayFuture(actor.pid.remote(), role_name).result(self.startup_timeout_s)

    def _shard_placement(self, shard_id: int, away_from: Role | None = None) -> dict:
        """Ray options that place shard ``shard_id`` on the node hosting the fewest other shards, so K shards land
        on K distinct nodes when there are that many (their traffic, memory and CPU never pile up on one
        machine), and only on dedicated shard nodes (SHARD_NODE_RESOURCE) where the cluster has any.

        Why not Ray's "SPREAD" strategy: it is best effort, and on a 3-node cluster it put 2 of 3 shards on one
        node. The node is a soft preference (a node that died or is full spills the shard to another) where the
        shard requests resources; Ray ignores a soft preference of an actor that requests none (measured: 2 of 3
        such actors elsewhere), so then it is strict: such an actor never lacks room on the alive node chosen.

        ``away_from``: place a backup of shard ``shard_id`` (``--durability replicate``) instead, on another node
        than that role's where there is one (else on any: it still survives the role's process)."""
        dedicated = ray.cluster_resources().get(SHARD_NODE_RESOURCE, 0.0) > 0
        placed = self._backup_node if away_from is not None else self._shard_node
        others = [node for k, node in placed.items() if k != shard_id]
        candidates = shard_nodes(self.shard_cpus, dedicated)
        if away_from is not None:
            others += list(self._shard_node.values())
            avoid = getattr(away_from, "node_hint", None)  # where it was asked to go: no wait for it to start
            if avoid is None:
                try:
                    avoid = self.node_of(away_from)
                except (RoleFailedError, RemoteTimeoutError):  # died already: the driver finds out next
                    avoid = None
            candidates = [n for n in candidates if n != avoid]
        node = least_loaded(candidates, others)
        options: dict = {"resources": {SHARD_NODE_RESOURCE: SHARD_NODE_REQUEST}} if dedicated else {}
        if node is None:
            options["scheduling_strategy"] = "SPREAD"
            return options
        placed[shard_id] = node
        soft = self.shard_cpus > 0 or dedicated
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=soft, _spill_on_unavailable=soft)
        return options

    def create_shard(self, shard_id: int, factory) -> Role:
        return self._place_shard(shard_id, factory, self._shard_placement(shard_id))

    def create_backup(self, shard_id: int, factory, away_from: Role) -> Role:
        return self._place_shard(shard_id, factory, self._shard_placement(shard_id, away_from=away_from))

    def _place_shard(self, shard_id: int, factory, placement: dict) -> Role:
        actor = self._start_role(stream_threads(self._replicas_hint),
                                 dict(num_cpus=self.shard_cpus, max_concurrency=1, max_restarts=0, **placement), 1,
                                 factory)
        role = Role("shard", shard_id, actor)
        strategy = placement.get("scheduling_strategy")
        role.node_hint = getattr(strategy, "node_id", None)  # the node it was asked to go to, if one
        return role

    def backup_link(self, backup: Role) -> BackupLink:
        return BackupLink(backup.handle, f"backup of parameter shard {backup.role_id}", self.remote_timeout_s)

    def create_replica(self, replica_id, factory, shards, layout, threads) -> Role:
        handles = [s.handle for s in shards]
        # A replica whose pushes are encoded (compressed) sends them as call arguments, the object store's way:
        # the shared-memory planes move dense float32 vectors.
        dense = not getattr(factory, "pushes_encoded", False)
        actor = self._start_role(
            1, dict(num_cpus=self.replica_cpus, num_gpus=self.replica_gpus, max_concurrency=4, max_restarts=0),
            threads, _build_replica, handles, layout, replica_id, self.remote_timeout_s, factory,
            self.shm_prefix if dense else None, self.colocate and dense, self.streams and dense)
        return Role("replica", replica_id, actor)

    def free_replica_slots(self) -> int:
        """Replicas the cluster's free CPUs (and GPUs, for replicas that ask for one) would hold now."""
        free = ray.available_resources()
        # (the CPUs idle warm processes hold are free: a new replica takes one, or stops them)
        cpus = free.get("CPU", 0.0) + (_WARM.idle_cpus(_local_node_id) if self._warm_here() else 0.0)
        slots = int(cpus / self.replica_cpus + 1e-6) if self.replica_cpus > 0 else 1 << 20
        if self.replica_gpus > 0:
            slots = min(slots, int(free.get("GPU", 0.0) / self.replica_gpus + 1e-6))
        return slots

    def create_clocks(self, bound: int) -> RayClocks:
        actor = ClockActor.options(max_restarts=0).remote(bound)
        self._actors.append(actor)
        return RayClocks(actor, bound, self.remote_timeout_s)

    def wait_ready(self, roles: list[Role]) -> None:
        for r in roles:
            self._ready(r.handle, r.name)

    def call(self, role: Role, method: str, *args, **kwargs) -> Future:
        return _RayFuture(role.handle.call.remote(method, *args, **kwargs), role.name)

    def call_split(self, role: Role, method: str, num_parts: int, *args) -> SplitFuture:
        refs = role.handle.call.options(num_returns=num_parts + 1).remote(method, *args)
        return _RaySplit(list(refs), role.name)

    def call_with_parts(self, role: Role, method: str, parts: list, lo: int) -> Future:
        # ``parts`` are object references, resolved by Ray for the receiving actor: a part larger than
        # max_direct_call_object_size (SYSTEM_CONFIG) is fetched from the node that made it; a smaller one was
        # returned inline to its owner (the driver's Ray core worker, never deserialised there) and travels
        # inline with this call, which for small messages is cheaper than a transfer of its own.
        return _RayFuture(role.handle.call_placed.remote(method, lo, *parts), role.name)

    def bytes_received(self, role: Role, timeout_s: float = 30.0) -> int:
        """Bytes of array arguments that reached ``role``'s process so far (placement and traffic checks)."""
        return _RayFuture(role.handle.received_bytes.remote(), role.name).result(timeout_s)

    def shard_client(self, shards, layout, replica_id: int = -1) -> ShardClient:
        client = RayShardClient([s.handle for s in shards], layout, replica_id, self.remote_timeout_s)
        client.wait_for_replacement = False  # the driver's client (see ShardClient.wait_for_replacement)
        return client

    def kill(self, role: Role) -> None:
        release = getattr(role, "release", None)
        if release is not None:  # a partitioned replica: its partition actors and placement group go too
            release()
        else:
            self._gone.add(role.handle._actor_id)
            ray.kill(role.handle, no_restart=True)

    def release(self, role: Role) -> None:
        if getattr(role, "release", None) is not None or not self._warm_here():
            self.kill(role)
        # else: it stays up; shutdown() empties it into the warm pool, if every role then is idle

    def avoidably_together(self, a: Role, b: Role) -> bool:
        try:
            node = self.node_of(a)
            if node != self.node_of(b):
                return False
        except (RoleFailedError, RemoteTimeoutError):  # one is dead: the driver finds out on its next check
            return False
        dedicated = ray.cluster_resources().get(SHARD_NODE_RESOURCE, 0.0) > 0
        return any(n != node for n in shard_nodes(self.shard_cpus, dedicated))

    def node_of(self, role: Role, timeout_s: float = 30.0) -> str:
        """The Ray node id hosting ``role`` (for placement checks and node-loss tests)."""
        return _RayFuture(role.handle.node_id.remote(), role.name).result(timeout_s)

    def driver_spare_cpus(self, replicas: list[Role], threads_per_replica: int) -> float:
        """Cores of the driver's machine that the replicas placed on it leave free (for out-of-band evaluation).

        A local instance shares this machine's cores with every replica; on a cluster only the replicas that
        landed on the driver's node count. Partitioned replicas count as one (their partitions' threads add up
        to about the same)."""
        here = ray.get_runtime_context().get_node_id()
        if started_locally():
            cores = float(os.cpu_count() or 1)
            busy = len(replicas) * threads_per_replica
        else:
            node = next((n for n in ray.nodes() if n.get("NodeID") == here), None)
            cores = float((node or {}).get("Resources", {}).get("CPU", 0.0))
            busy = 0
            for r in replicas:
                try:
                    on_driver_node = self.node_of(r, self.remote_timeout_s) == here
                except (RoleFailedError, RemoteTimeoutError, AttributeError):
                    on_driver_node = True  # unknown (e.g. a partition group): assume the worst
                busy += threads_per_replica if on_driver_node else 0
        return cores - busy

    def wait_any(self, futures, timeout_s):
        if not futures:
            return []
        by_ref = {}
        for f in futures:
            if isinstance(f, _RaySplit):  # done when its summary is (the parts are returned with it)
                by_ref[f.summary.refs] = f
            else:
                by_ref[f.refs if not f.many else f.refs[0]] = f
        ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=timeout_s)
        done = [by_ref[r] for r in ready]
        done += [f for f in futures if f not in done and f.done()]
        return done

    def shutdown(self) -> None:
        for g in self._groups:
            g.release()
        self._groups.clear()
        actors, self._actors = self._actors, []
        kept = {a._actor_id for a in (self._retire_idle(actors) if self._warm_here() else [])}
        _kill_all([a for a in actors if a._actor_id not in kept])
        self._becoming.clear()
        if self.shm_prefix:
            shm.remove_all(self.shm_prefix)
