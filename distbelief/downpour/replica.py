"""ModelReplica: the paper's Downpour client loop (docs/paper.md "Downpour SGD") — the one loop every Downpour replica
runs, whether it holds a whole model or one partition of a model-parallel replica.

    step = 0; accrued = 0
    loop:
      if step % n_fetch == 0: fetch parameters        (issued one step early when ``overlap``)
      g = gradient(parameters, minibatch)
      accrued += g;  parameters -= alpha * g            (local step between fetches)
      after every n_push gradients: push(accrued) asynchronously; accrued = 0

What the loop trains comes from a **gradient source**: ``WholeModel`` (a model replica in one process) or a
partition's source (``partition/replica.py``: its parameter range, with boundary messages to the other
partitions, and the head's go/stop decision each step so that all partitions stop at the same step). The loop
itself only fetches, computes through the source, accrues and pushes.

Fetch and push are asynchronous handles from a ShardClient (the runtime supplies it): a push is in flight while
the next gradient is computed, and with ``overlap`` the next fetch is too, so the replica's compute never waits
for a round trip unless the network is slower than a step. At most one push is in flight (back-pressure).
``LocalUpdates`` is the client of a replica with no parameter server (it applies an update rule in place).

Without prefetch, fetching before every step and pushing after it (the fig. 4 recipe), a step's push and the
next step's fetch travel as one call per shard (``ShardClient.push_fetch_async``); where the client offers shared
buffers, the model's parameters and gradients are those buffers, so neither side copies the vector in between.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from distbelief.buffers import buffers_of
from distbelief.compression import EncodedPush, ErrorFeedback, make_codec
from distbelief.compression.wire import Fetched
from distbelief.compression.powersgd import tensor_layout
from distbelief.data.batches import BatchSource, StreamBatches, replica_indices
from distbelief.data.loading import stream_of
from distbelief.exceptions import ReplicaKilled
from distbelief.job import materialize
from distbelief.devices import resolve_device
from distbelief.ps.sharding import bind_flat, flatten
from distbelief.runtime.base import Done


@dataclass(frozen=True)
class ReplicaSettings:
    fetch_every: int = 1
    push_every: int = 1
    local_lr: float = 0.0
    overlap: bool = True
    remote_timeout_s: float = 120.0
    # Run after each step with (steps so far, that step's compute seconds): RunHooks.replica_hook (hooks.py).
    step_hook: Callable[[int, float], None] | None = None
    # Compressed pushes (distbelief/compression): the scheme and its parameter, with error feedback.
    compress: str = "none"
    compress_ratio: float = 0.01
    compress_bits: int = 4
    compress_rank: int = 4
    compress_fetch: str = "none"  # "fp16": the shards answer in float16; "delta": only the values changed
    # Where the replica computes: "cpu", "cuda", "cuda:N" or "auto" (RunConfig.device; distbelief/devices.py).
    device: str = "cpu"


class GradientSource(Protocol):
    """What a client loop trains.

    ``flat``: every parameter this process holds, as one vector (fetched parts are copied into it at their flat
    offsets). ``params`` / ``grads``: the range this loop pushes and steps locally (``flat[lo:hi]`` and its
    gradient), at flat offset ``lo``. ``gradient(x, y)`` computes the minibatch gradient into ``grads`` and
    returns the loss (None where this process does not see it). ``agree(step, go)`` returns whether to run step
    ``step`` given this process's own view ``go`` (a lockstep group's members follow their head).
    """

    name: str
    flat: torch.Tensor
    params: torch.Tensor
    grads: torch.Tensor
    lo: int

    def gradient(self, x: torch.Tensor, y: torch.Tensor) -> float | None: ...

    def agree(self, step: int, go: bool) -> bool: ...

    def module_buffers(self) -> dict[str, torch.Tensor]: ...

    def adopt_buffers(self, buffers: tuple) -> bool: ...

    def stats(self) -> dict[str, Any]: ...


class WholeModel:
    """A gradient source holding a whole model.

    ``flat`` / ``grads`` are host (CPU float32) vectors: fetches write ``flat``, pushes read ``grads``. On the CPU
    (the direct path) the model's parameters (and ``.grad``) are views into them (see ``bind_flat``), so a fetch
    writes the model and ``backward()`` writes the push buffer.

    On another ``device`` (or with ``mirror=True``, which takes this path on the CPU so that tests exercise its
    copies) the model lives on the device, bound to device vectors of its own: each ``gradient`` copies ``flat``
    to the device, computes there and copies the device gradient back into ``grads``. ``device`` "auto" is
    resolved here, in the replica's process."""

    lo = 0

    def __init__(self, replica_id: int, model: torch.nn.Module,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: str = "cpu",
                 mirror: bool = False):
        self.name = f"replica {replica_id}"
        self.model, self.loss_fn = model, loss_fn
        self.device = resolve_device(device)
        self.mirrored = mirror or self.device.type != "cpu"
        if self.mirrored:
            self.flat, self.grads = flatten(model), torch.zeros(sum(p.numel() for p in model.parameters()))
            model.to(self.device)
            n = self.flat.numel()
            self._dev_flat, self._dev_grads = bind_flat(
                model, torch.empty(n, dtype=torch.float32, device=self.device),
                torch.zeros(n, dtype=torch.float32, device=self.device))
        else:
            self.flat, self.grads = bind_flat(model)
        self.params = self.flat

    def adopt_buffers(self, buffers: tuple) -> bool:
        """Use the client's shared ``(params, grads)`` buffers as ``flat`` / ``grads`` (zero-copy fetches and
        pushes): the model is bound to them, or on the mirrored path copies to and from them each step."""
        flat, grads = (torch.from_numpy(b) for b in buffers)
        if self.mirrored:
            if flat.dtype != torch.float32 or flat.shape != self.flat.shape or grads.shape != self.grads.shape:
                raise ValueError(f"adopt_buffers: need two float32 vectors of {self.flat.numel()} elements")
            flat.copy_(self.flat)
            self.flat, self.grads = flat, grads.zero_()
        else:
            self.flat, self.grads = bind_flat(self.model, flat, grads)
        self.params = self.flat
        return True

    def gradient(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if not self.mirrored:
            self.grads.zero_()
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            return loss.item()
        # Host -> device: asynchronous where the host memory allows it; the kernels below run after it on the
        # same stream. The gradient comes back with a blocking copy (``grads`` is read as soon as we return).
        self._dev_flat.copy_(self.flat, non_blocking=True)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self._dev_grads.zero_()
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.grads.copy_(self._dev_grads)
        return loss.item()

    def agree(self, step: int, go: bool) -> bool:
        return go

    def module_buffers(self) -> dict[str, torch.Tensor]:
        """The model's buffers as CPU tensors (copies)."""
        return {name: b.cpu() for name, b in buffers_of(self.model).items()}

    def stats(self) -> dict[str, Any]:
        return {}


class LocalUpdates:
    """The client of a replica with no parameter server: a push applies ``optimizer`` (a rule from
    ``ps/optimizers.py``) to ``params`` in place, at once; a fetch has nothing to bring."""

    acked: list[int] = []
    colocated = None
    transport_name = "none"

    def __init__(self, params: torch.Tensor, optimizer):
        self.params, self.optimizer = params, optimizer
        self.state = optimizer.init_state(params.numel())

    def fetch_async(self) -> Done:
        return Done(([], []))

    def push_async(self, grad: torch.Tensor, versions, num_examples: int, rows=None) -> Done:
        self.optimizer.apply(self.params, grad, self.state)
        return Done([])

    def push_fetch_async(self, grad: torch.Tensor, versions, num_examples: int, rows=None) -> Done:
        self.push_async(grad, versions, num_examples)
        return self.fetch_async()

    def shared_buffers(self):
        return None

    def replace_shard(self, shard_id: int, handle) -> int:
        return 0


class ModelReplica:
    """One model replica (or one partition of one): a gradient source, a data subset, and the
    fetch/compute/push loop.

    Thread-safety: ``run`` executes in one thread; ``stop``, ``pause``, ``stats`` and ``kill`` may be called from
    another.
    """

    def __init__(self, replica_id: int, source: GradientSource, batches: BatchSource, client,
                 settings: ReplicaSettings, clocks=None):
        self.replica_id = replica_id
        # Stale-synchronous runs: the run's clock table (runtime/clocks.py); None when fully asynchronous.
        self.clocks = clocks
        self.source = source
        self.batches = batches
        self.client = client
        self.settings = settings
        # Compressed pushes: the codec and the residual it leaves, which lives here (compression/feedback.py).
        self.feedback = self._feedback(settings, client, source)
        client.fetch_half = settings.compress_fetch == "fp16"
        if settings.compress_fetch == "delta":  # nothing fetched yet: the first answers are whole
            client.fetch_since = [("", -1)] * len(client.handles)
        # Fused push-fetch loop: one call per shard per step instead of two (see the module docstring), a
        # compressed push too.
        self.fused = not settings.overlap and settings.fetch_every == 1 and settings.push_every == 1
        shared = client.shared_buffers() if self.fused else None
        self.zero_copy = shared is not None and source.adopt_buffers(shared)
        self.accrued = torch.zeros_like(source.grads)
        # A model with embedding tables (downpour/sparse.py) pushes its row-sparse gradient with the dense one.
        self._take_rows = getattr(source, "take_rows", None)
        self._stop = threading.Event()
        self._go = threading.Event()  # cleared by pause(): the loop waits at its next step boundary
        self._go.set()
        self._paused = threading.Event()  # set while the loop waits there
        self._running = False
        self._killed = False
        self.steps = 0
        self.examples = 0
        self.pushes = 0
        self.push_fetches = 0  # pushes sent fused with the next fetch
        self.loss_ema = math.nan
        self.compute_s = 0.0
        # CPU this process spent in those steps (every thread's): below compute_s where a step waits, as a
        # model-parallel partition does for its neighbours' messages
        self.compute_cpu_s = 0.0
        self.wait_s = 0.0
        self.clock_wait_s = 0.0  # of wait_s: held back by the staleness bound
        self.paused_s = 0.0  # held by pause() (evaluations)
        # When (time.time()) a fetch first came back after this replica's first push: its first push was applied
        # by then (a shard runs one caller's calls in order). Elastic runs time a new replica by it.
        self.first_push_time: float | None = None

    def _feedback(self, s: ReplicaSettings, client, source) -> ErrorFeedback | None:
        if s.compress == "none":
            return None
        layout = client.layout
        model = getattr(source, "model", None)
        codec = make_codec(s.compress, [layout.range(k) for k in range(layout.num_shards)],
                           tensor_layout(model) if model is not None else None, ratio=s.compress_ratio,
                           bits=s.compress_bits, rank=s.compress_rank, seed=1_000_003 * (self.replica_id + 1))
        return ErrorFeedback(codec, source.grads.numel())

    def _encoded(self, buf: torch.Tensor):
        """What a push sends for gradient ``buf``: itself, or its compressed parts (the residual moves on)."""
        if self.feedback is None:
            return buf
        codec = self.feedback.codec
        return EncodedPush(codec.name, self.feedback.compress(buf), codec.ranges)

    # -- control (callable from another thread) --
    def stop(self) -> None:
        self._stop.set()

    def pause(self, timeout_s: float) -> bool:
        """Hold the loop at its next step boundary, once its pushes are applied (the driver evaluates the
        server's parameters meanwhile, off the training clock; a partitioned replica pauses its head, and the
        other partitions then wait for the head's next message). True once it holds (or is not running); False
        if it did not get there within ``timeout_s``."""
        self._go.clear()
        deadline = time.monotonic() + timeout_s
        while self._running and not self._paused.is_set():
            if time.monotonic() >= deadline:
                return False
            self._paused.wait(0.05)
        return True

    def resume(self) -> None:
        self._go.set()

    def _hold_if_paused(self, pending_push):
        """The loop's side of pause() (called once it saw the request): settle the push in flight, then wait for
        resume() (or stop)."""
        paused_at = time.monotonic()
        if pending_push is not None:
            pending_push.result(self.settings.remote_timeout_s)
            pending_push = None
        self._paused.set()
        while not self._go.wait(0.05):
            if self._stop.is_set() or self._killed:
                break
        self._paused.clear()
        self.paused_s += time.monotonic() - paused_at  # a pause is not training time (max_seconds)
        return pending_push

    def kill(self) -> None:
        self._killed = True

    def replace_shard(self, shard_id: int, handle) -> int:
        """Point this replica at a restarted shard; calls waiting on the dead one are re-sent to it. Returns the
        highest version the dead one acknowledged to us (0: none)."""
        return self.client.replace_shard(shard_id, handle)

    def module_buffers(self) -> dict[str, Any]:
        """This replica's module buffers (BatchNorm statistics), as numpy arrays by name (see buffers.py)."""
        return {name: b.numpy() for name, b in self.source.module_buffers().items()}

    def params(self) -> tuple[int, Any]:
        """``(lo, values)``: the parameter range this loop trains, at its flat offset (a copy)."""
        return self.source.lo, self.source.params.numpy().copy()

    def stats(self) -> dict[str, Any]:
        return {
            "acked": list(self.client.acked),
            "replica_id": self.replica_id,
            "steps": self.steps,
            "examples": self.examples,
            "pushes": self.pushes,
            "push_fetches": self.push_fetches,
            "zero_copy": self.zero_copy,
            "colocated": self.client.colocated is not None,
            "transport": self.client.transport_name,
            "loss_ema": self.loss_ema,
            "compute_s": self.compute_s,
            "compute_cpu_s": self.compute_cpu_s,
            "wait_s": self.wait_s,
            "clock_wait_s": self.clock_wait_s,
            "first_push_time": self.first_push_time,
            "compressed_bytes": self.feedback.bytes_sent if self.feedback is not None else None,
            "compress_s": self.feedback.seconds if self.feedback is not None else None,
            **self.source.stats(),
        }

    # -- the client loop --
    def _load(self, fetched) -> Any:
        t0 = time.perf_counter()
        parts, versions = fetched.result(self.settings.remote_timeout_s)
        if self.first_push_time is None and self.pushes:
            self.first_push_time = time.time()
        flat = self.source.flat
        for k, (lo, values) in enumerate(parts):
            if isinstance(values, Fetched):  # a delta fetch's answer (ps/shard.py ``fetch``)
                self.client.fetch_since[k] = (values.token, versions[k])
                values.load_into(flat, lo)
                continue
            src, dst = torch.as_tensor(values), flat[lo : lo + len(values)]
            if src.data_ptr() != dst.data_ptr():  # not already in place (a shard wrote our shared buffer)
                dst.copy_(src)
        if self._take_rows is not None:
            self.source.on_fetch()  # embedding rows are due for a refresh too (downpour/sparse.py)
        self.wait_s += time.perf_counter() - t0
        return versions

    def _agree(self, step: int, go: bool) -> bool:
        t0 = time.perf_counter()
        go = self.source.agree(step, go)
        self.wait_s += time.perf_counter() - t0
        return go

    def run(self, max_steps: int | None = None, max_seconds: float | None = None) -> dict:
        deadline = math.inf if max_seconds is None else time.monotonic() + max_seconds
        limit = math.inf if max_steps is None else max_steps
        self._stop.clear()
        self.paused_s = 0.0
        self._running = True
        try:
            return self._loop(limit, deadline)
        finally:
            self._running = False
            close = getattr(self.batches, "close", None)  # its DataLoader workers, if any: now, not when collected
            if close is not None:
                close()
            if self.clocks is not None:
                self.clocks.retire(self.replica_id)  # finished or failed: it holds no one back

    def _after_step(self, t0: float) -> None:
        """The run's replica hook, if it has one (distbelief/hooks.py), with this step's compute time."""
        if self.settings.step_hook is not None:
            self.settings.step_hook(self.steps + 1, time.perf_counter() - t0)

    def _clock_open(self, clock: int, pending_push):
        """The staleness bound (``consistency = "ssp"``): wait until this replica, having completed ``clock``
        steps, is at most the bound ahead of the slowest live replica. The slowest clock never decreases, so
        while ``clock <= known slowest + bound`` no question is asked; otherwise the answer to the report sent at
        the end of the last step is read, and only if that does not allow the step either does the replica wait
        on the table. While waiting it honours pause (holding like at a step boundary) and stop. Returns
        ``(go, pending_push)``; ``go`` is False when asked to stop."""
        bound, timeout = self.clocks.bound, self.settings.remote_timeout_s
        if clock - self._slowest <= bound:
            return True, pending_push
        t0 = time.perf_counter()
        try:
            if self._report is not None:
                self._slowest = max(self._slowest, self._report.result(timeout))
                self._report = None
                if clock - self._slowest <= bound:
                    return True, pending_push
            first = True
            while not self.clocks.wait(self.replica_id, clock, 0.05, first_try=first):
                first = False
                if self._killed:
                    raise ReplicaKilled(f"{self.source.name} was killed (fault injection)")
                if self._stop.is_set():
                    return False, pending_push
                if not self._go.is_set():
                    pending_push = self._hold_if_paused(pending_push)
            self._slowest = max(self._slowest, clock - bound)  # allowed: the slowest is at least this far on
            return True, pending_push
        finally:
            waited = time.perf_counter() - t0
            self.wait_s += waited
            self.clock_wait_s += waited

    def _loop(self, limit: float, deadline: float) -> dict:
        s, src = self.settings, self.source
        pending_fetch = None
        pending_push = None
        versions = None
        acc_versions = None
        acc_count = acc_examples = 0
        local_step = 0
        clocks = self.clocks
        base = clocks.join(self.replica_id) if clocks is not None else 0
        self._slowest, self._report = base, None  # what this replica knows of the slowest live clock
        while True:
            go = local_step < limit and not self._stop.is_set() and time.monotonic() < deadline + self.paused_s
            if go and clocks is not None:  # decided before agree(): a lockstep group's head decides for all
                go, pending_push = self._clock_open(base + local_step, pending_push)
            if not self._agree(local_step, go):
                break
            if self._killed:
                raise ReplicaKilled(f"{src.name} was killed (fault injection)")
            if local_step % s.fetch_every == 0:
                if pending_fetch is None:
                    pending_fetch = self.client.fetch_async()
                versions = self._load(pending_fetch)
                pending_fetch = None
            if not self._go.is_set():  # a pause: hold here, with our pushes applied and parameters loaded
                pending_push = self._hold_if_paused(pending_push)
            if s.overlap and (local_step + 1) % s.fetch_every == 0 and local_step + 1 < limit:
                pending_fetch = self.client.fetch_async()  # the next parameters travel while we compute

            t0, c0 = time.perf_counter(), time.process_time()
            x, y = self.batches.next_batch()
            loss = src.gradient(x, y)
            if acc_count == 0:
                acc_versions = versions
                # With push_every == 1 the gradient buffer itself is pushed (the client copies before returning).
                if s.push_every > 1:
                    self.accrued.copy_(src.grads)
            else:
                self.accrued.add_(src.grads)
            acc_count += 1
            acc_examples += len(y)
            if s.local_lr:
                src.params.add_(src.grads, alpha=-s.local_lr)
            self._after_step(t0)
            self.compute_s += time.perf_counter() - t0
            self.compute_cpu_s += time.process_time() - c0

            if acc_count == s.push_every:
                if self.fused and local_step + 1 < limit:  # the next parameters come back with the push's reply
                    pending_fetch = self.client.push_fetch_async(self._encoded(src.grads), acc_versions,
                                                                 acc_examples, **self._rows())
                    self.pushes += 1
                    self.push_fetches += 1
                else:
                    pending_push = self._push(pending_push, acc_versions, acc_examples)
                acc_count = acc_examples = 0
            local_step += 1
            self.steps += 1
            self.examples += len(y)
            if clocks is not None and local_step < limit:  # tell the table; its answer is read only if needed
                self._report = clocks.report(self.replica_id, base + local_step)
            if loss is not None:
                self.loss_ema = loss if math.isnan(self.loss_ema) else 0.9 * self.loss_ema + 0.1 * loss
        if acc_count:
            pending_push = self._push(pending_push, acc_versions, acc_examples)
        if pending_push is not None:
            pending_push.result(s.remote_timeout_s)
        if pending_fetch is not None:
            pending_fetch.result(s.remote_timeout_s)
        return self.stats()

    def _push(self, previous, versions, num_examples):
        t0 = time.perf_counter()
        if previous is not None:
            previous.result(self.settings.remote_timeout_s)
        self.wait_s += time.perf_counter() - t0
        buf = self.source.grads if self.settings.push_every == 1 else self.accrued
        handle = self.client.push_async(self._encoded(buf), versions, num_examples, **self._rows())
        self.pushes += 1
        return handle

    def _rows(self) -> dict:
        """The push's ``rows=`` argument for a model with embedding tables (none for a dense model)."""
        return {} if self._take_rows is None else {"rows": self._take_rows()}

    # -- synchronous data parallelism (one step, driven by the trainer) --
    def sync_step(self) -> tuple:
        """Fetch the current parameters, compute one minibatch gradient and return it split by shard:
        ``(part_0, ..., part_{K-1}, summary)``, part k a float32 copy of shard k's range of the gradient and
        ``summary`` a small dict (``loss``, ``examples``).

        A model with embedding tables (downpour/sparse.py) fetches the rows its minibatch uses, fresh every step,
        and part k is ``(range_k, rows_k)``: ``rows_k`` shard k's part of the row-sparse gradient as a push carries
        it (per row group None or ``(local_ids, values)``, ps/slicer.py ``split_rows``).

        Why split: the trainer calls this with ``Runtime.call_split``, so each part goes from this replica
        straight to its shard and the driver waits on the summary alone, never holding a gradient."""
        if self._killed:
            raise ReplicaKilled(f"{self.source.name} was killed (fault injection)")
        self._load(self.client.fetch_async())
        x, y = self.batches.next_batch()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = self.source.gradient(x, y)
        self._after_step(t0)
        self.compute_s += time.perf_counter() - t0
        self.compute_cpu_s += time.process_time() - c0
        self.steps += 1
        self.examples += len(y)
        self.loss_ema = loss if math.isnan(self.loss_ema) else 0.9 * self.loss_ema + 0.1 * loss
        layout = self.client.layout
        if self.feedback is not None:  # each shard its encoded range (compression/wire.py)
            push = self._encoded(self.source.grads)
            parts = tuple(push[lo:hi] for lo, hi in map(layout.range, range(layout.num_shards)))
            return (*parts, {"loss": loss, "examples": len(y)})
        g = self.source.grads.numpy()
        parts = tuple(g[lo:hi].copy() for lo, hi in map(layout.range, range(layout.num_shards)))
        if self._take_rows is not None:  # each shard's rows travel with its range, to it alone
            parts = tuple(zip(parts, layout.split_rows(self._take_rows())))
        return (*parts, {"loss": loss, "examples": len(y)})


@dataclass
class ReplicaRecipe:
    """Builds a ModelReplica where it will live (picklable: it travels to the replica's process).
    ``partition/replica.PartitionRecipe`` builds one partition of one the same way."""

    replica_id: int
    num_replicas: int
    model_fn: Callable[[], torch.nn.Module]
    train_data: Any
    batch_size: int
    seed: int
    settings: ReplicaSettings
    loss_fn: Callable
    clocks: Any = None  # the run's clock table (runtime/clocks.py) under consistency = "ssp"

    def model_and_batches(self, model_seed: int | None = None) -> tuple[torch.nn.Module, BatchSource]:
        """The replica's model (initialised from ``model_seed``; by default one seed per replica — the first
        fetch overwrites it anyway) and its minibatches: its own share of the training set, in an order of its
        own that every partition of the replica draws alike."""
        ds = materialize(self.train_data)
        torch.manual_seed(self.seed + 1009 * (self.replica_id + 1) if model_seed is None else model_seed)
        model = self.model_fn()
        if stream_of(ds) is not None:  # an IterableDataset: the replica streams its share of it
            return model, StreamBatches(ds, self.replica_id, self.num_replicas, self.batch_size)
        # Elastic runs pass num_replicas = 1: every replica draws from the whole set, in an order of its own
        idx = replica_indices(len(ds), self.num_replicas, self.replica_id % self.num_replicas, self.seed)
        return model, BatchSource(ds, idx, self.batch_size, seed=self.seed * 7919 + self.replica_id)

    @property
    def pushes_encoded(self) -> bool:
        """Whether this replica's pushes are compressed (the runtime then sends them as call arguments)."""
        return self.settings.compress != "none" or self.settings.compress_fetch != "none"

    def __call__(self, client) -> ModelReplica:
        model, batches = self.model_and_batches()
        if getattr(client.layout, "tables", ()):  # embedding tables row-sharded on the shards
            from distbelief.downpour.sparse import SparseModel

            source = SparseModel(self.replica_id, model, self.loss_fn, client.layout, client,
                                 local_lr=self.settings.local_lr, timeout_s=self.settings.remote_timeout_s)
        else:
            source = WholeModel(self.replica_id, model, self.loss_fn, device=self.settings.device)
        return ModelReplica(self.replica_id, source, batches, client, self.settings, clocks=self.clocks)
