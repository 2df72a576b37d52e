"""PartitionReplica: one partition of a model-parallel Downpour replica (PAPER.md §1–2, DESIGN.md "Model
parallelism").

A replica split into P partitions runs as P of these, one per worker process. Each runs the paper's client loop
over **its own parameter range only**: it fetches that range from the shards that hold it, computes its share of
the minibatch gradient together with the other partitions (boundary messages through a Transport), and pushes
that range's gradient back to the same shards. There is no replica-level gather of parameters.

The head partition (0) drives the lockstep: before every step it tells the others whether to go on (a one-number
control message), so that a stop request, a step limit or a deadline ends all partitions at the same step.
Every partition draws the same minibatch sequence (same seed); only the head uses the labels.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from distbelief.data.batches import BatchSource, replica_indices
from distbelief.downpour.replica import ReplicaSettings
from distbelief.exceptions import ReplicaKilled
from distbelief.partition.model import PartitionedModel
from distbelief.partition.partition import Partition
from distbelief.partition.plan import HEAD
from distbelief.ps.sharding import bind_flat
from distbelief.runtime.transport import Transport

_GO, _STOP = torch.ones(1), torch.zeros(1)


class PartitionReplica:
    """Partition ``partition_id`` of model replica ``replica_id``: its parameter range and the client loop.

    Args:
        client: a range client for this partition's ``[lo, hi)`` (``fetch_async() -> (parts, versions)``,
            ``push_async(grad, versions, num_examples)``), or None to update locally with ``local_optimizer``
            (the single-replica baseline, no parameter server).
        local_optimizer: a server rule from :mod:`distbelief.ps.optimizers`, applied to our range when
            ``client`` is None.

    Thread-safety: ``run`` in one thread; ``stop``, ``stats``, ``kill`` from others.
    """

    def __init__(self, replica_id: int, partition_id: int, model: PartitionedModel, batches: BatchSource,
                 client, transport: Transport, settings: ReplicaSettings, loss_fn: Callable,
                 local_optimizer=None):
        if client is None and local_optimizer is None:
            raise ValueError("a partition needs a parameter-server client or a local optimizer")
        self.replica_id, self.partition_id = replica_id, partition_id
        self.model, self.batches, self.client, self.transport = model, batches, client, transport
        self.settings, self.loss_fn = settings, loss_fn
        self.is_head = partition_id == HEAD
        self.flat, self.grads = bind_flat(model)
        self.lo, self.hi = model.partition_ranges()[partition_id]
        self.own, self.own_grad = self.flat[self.lo:self.hi], self.grads[self.lo:self.hi]
        self.accrued = torch.zeros_like(self.own_grad)
        self.partition = Partition(model, partition_id, transport, settings.remote_timeout_s)
        self.local_optimizer = local_optimizer
        self.opt_state = local_optimizer.init_state(self.hi - self.lo) if local_optimizer is not None else {}
        self._stop = threading.Event()
        self._resumed = threading.Event()  # cleared by pause(): the head holds the lockstep at its next step
        self._resumed.set()
        self._held = threading.Event()
        self._running = False
        self._killed = False
        self.steps = self.examples = self.pushes = 0
        self.control_messages = 0
        self.loss_ema = math.nan
        self.compute_s = self.wait_s = 0.0

    # -- control (callable from another thread) --
    def stop(self) -> None:
        self._stop.set()

    def pause(self, timeout_s: float) -> bool:
        """Head only: hold the group's lockstep at the next step boundary (the other partitions then wait for
        the head's next message, idle) while the driver evaluates. True once held or not running."""
        self._resumed.clear()
        deadline = time.monotonic() + timeout_s
        while self._running and not self._held.is_set():
            if time.monotonic() >= deadline:
                return False
            self._held.wait(0.05)
        return True

    def resume(self) -> None:
        self._resumed.set()

    def _hold(self, pending_push):
        if pending_push is not None:  # our push is applied before the driver reads the server
            pending_push.result(self.settings.remote_timeout_s)
            pending_push = None
        self._held.set()
        while not self._resumed.wait(0.05):
            if self._stop.is_set() or self._killed:
                break
        self._held.clear()
        return pending_push

    def kill(self) -> None:
        self._killed = True

    def replace_shard(self, shard_id: int, handle) -> int:
        """Point this partition at a restarted shard (if it holds part of our range); calls waiting on the dead
        one are re-sent to it. Returns the highest version the dead one acknowledged to us (0: none)."""
        if self.client is not None:
            return self.client.replace_shard(shard_id, handle)
        return 0

    def stats(self) -> dict[str, Any]:
        s = self.partition.stats
        return {
            "replica_id": self.replica_id, "partition_id": self.partition_id, "steps": self.steps,
            "examples": self.examples, "pushes": self.pushes, "loss_ema": self.loss_ema,
            "compute_s": self.compute_s, "wait_s": self.wait_s, "num_parameters": self.hi - self.lo,
            "control_messages": self.control_messages, **s.as_dict(),
            # the highest version each shard acknowledged to us (the trainer counts updates lost to a shard crash)
            "acked": list(self.client.acked) if self.client is not None else None,
        }

    def params(self) -> tuple[int, Any]:
        """``(lo, values)``: this partition's parameter range (a copy)."""
        return self.lo, self.own.numpy().copy()

    # -- the client loop --
    def _go(self, step: int, go: bool) -> bool:
        """The head decides and tells the others; the others learn it. Returns whether to run this step."""
        key = ("ctl", step)
        if self.is_head:
            for q in range(self.model.num_partitions):
                if q != HEAD:
                    self.transport.send(q, key, _GO if go else _STOP)
                    self.control_messages += 1
            return go
        t0 = time.perf_counter()
        flag = self.transport.recv(HEAD, key, self.settings.remote_timeout_s)
        self.wait_s += time.perf_counter() - t0
        return bool(flag[0] > 0)

    def _load(self, pending) -> dict[int, int]:
        t0 = time.perf_counter()
        parts, versions = pending.result(self.settings.remote_timeout_s)
        for lo, values in parts:
            self.flat[lo: lo + len(values)].copy_(torch.as_tensor(values))
        self.wait_s += time.perf_counter() - t0
        return versions

    def run(self, max_steps: int | None = None, max_seconds: float | None = None) -> dict[str, Any]:
        """Train until the head stops (step limit, deadline or ``stop()``). Returns ``stats()``."""
        deadline = math.inf if max_seconds is None else time.monotonic() + max_seconds
        limit = math.inf if max_steps is None else max_steps
        self._stop.clear()
        self._running = True
        try:
            return self._loop(limit, deadline)
        finally:
            self._running = False

    def _loop(self, limit: float, deadline: float) -> dict[str, Any]:
        s = self.settings
        pending_fetch = pending_push = None
        versions = acc_versions = None
        acc_count = acc_examples = 0
        local_step = 0
        while self._go(local_step, local_step < limit and not self._stop.is_set() and time.monotonic() < deadline):
            if self._killed:
                raise ReplicaKilled(f"replica {self.replica_id} partition {self.partition_id} was killed")
            if self.client is not None and local_step % s.fetch_every == 0:
                versions = self._load(pending_fetch if pending_fetch is not None else self.client.fetch_async())
                pending_fetch = None
            if self.is_head and not self._resumed.is_set():  # a pause for evaluation (see pause())
                paused_at = time.monotonic()
                pending_push = self._hold(pending_push)
                deadline += time.monotonic() - paused_at  # a pause is not training time
            if self.client is not None and s.overlap and (local_step + 1) % s.fetch_every == 0:
                pending_fetch = self.client.fetch_async()  # our next range travels while we compute

            t0 = time.perf_counter()
            x, y = self.batches.next_batch()
            self.own_grad.zero_()
            loss, _ = self.partition.step(x, y if self.is_head else None, self.loss_fn if self.is_head else None)
            if self.client is None:
                self.local_optimizer.apply(self.own, self.own_grad, self.opt_state)
            else:
                if acc_count == 0:
                    acc_versions = versions
                    if s.push_every > 1:
                        self.accrued.copy_(self.own_grad)
                else:
                    self.accrued.add_(self.own_grad)
                acc_count += 1
                acc_examples += len(y)
                if s.local_lr:
                    self.own.add_(self.own_grad, alpha=-s.local_lr)
            self.compute_s += time.perf_counter() - t0

            if self.client is not None and acc_count == s.push_every:
                pending_push = self._push(pending_push, acc_versions, acc_examples)
                acc_count = acc_examples = 0
            local_step += 1
            self.steps += 1
            self.examples += len(y)
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
        buf = self.own_grad if self.settings.push_every == 1 else self.accrued
        handle = self.client.push_async(buf, versions, num_examples)
        self.pushes += 1
        return handle


@dataclass
class PartitionRecipe:
    """Builds one partition of a replica where it will live (picklable: it travels to the partition's process).

    ``recipe(partition_id, client_for, transport)``: ``client_for(lo, hi)`` returns the range client for the
    partition's parameter range (None means local updates with ``local_optimizer``).
    """

    replica_id: int
    num_replicas: int
    model_fn: Callable[[], torch.nn.Module]
    train_data: Any
    batch_size: int
    seed: int
    settings: ReplicaSettings
    loss_fn: Callable
    local_optimizer: Any = None

    def __call__(self, partition_id: int, client_for, transport: Transport) -> PartitionReplica:
        from distbelief.job import materialize

        ds = materialize(self.train_data)
        # Local updates start from the driver's initial model (seeded with ``seed``); under Downpour the first
        # fetch overwrites the initial values anyway.
        local = self.local_optimizer is not None
        torch.manual_seed(self.seed if local else self.seed + 1009 * (self.replica_id + 1))
        model = self.model_fn()
        if not isinstance(model, PartitionedModel):
            raise TypeError(f"partitions need a PartitionedModel, got {type(model).__name__}")
        idx = replica_indices(len(ds), self.num_replicas, self.replica_id, self.seed)
        # The same seed in every partition: they all draw the same minibatches without talking about it.
        batches = BatchSource(ds, idx, self.batch_size, seed=self.seed * 7919 + self.replica_id)
        lo, hi = model.partition_ranges()[partition_id]
        client = client_for(lo, hi) if client_for is not None else None
        return PartitionReplica(self.replica_id, partition_id, model, batches, client, transport, self.settings,
                                self.loss_fn, self.local_optimizer)
