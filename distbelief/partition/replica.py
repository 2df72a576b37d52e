"""One partition of a model-parallel Downpour replica (the paper's §1–2): its gradient source, and the recipe
that builds it where it lives.

A replica split into P partitions runs as P Downpour client loops (``downpour/replica.ModelReplica``), one per
worker process, each over **its own parameter range only**: it fetches that range from the shards that hold it,
computes its share of the minibatch gradient together with the other partitions (boundary messages through a
Transport), and pushes that range's gradient back to the same shards. There is no replica-level gather of
parameters. Every partition draws the same minibatch sequence (same seed); only the head uses the labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from distbelief.downpour.replica import LocalUpdates, ModelReplica, ReplicaRecipe
from distbelief.partition.model import PartitionedModel
from distbelief.partition.partition import Partition
from distbelief.partition.plan import HEAD
from distbelief.ps.sharding import bind_flat
from distbelief.runtime.transport import Transport

_GO, _STOP = torch.ones(1), torch.zeros(1)


class PartitionGradients:
    """The gradient source of partition ``partition_id`` of a model-parallel replica: its parameter range
    ``[lo, hi)`` of the model's flat vector, its share of each minibatch gradient (computed together with the
    other partitions through ``transport``), and the head's go/stop decision before every step.

    The head (partition 0) decides and tells the others with a one-number control message; the others follow, so
    a stop request, a step limit or a deadline ends every partition at the same step.
    """

    def __init__(self, replica_id: int, partition_id: int, model: PartitionedModel, transport: Transport,
                 loss_fn: Callable, timeout_s: float):
        self.name = f"replica {replica_id} partition {partition_id}"
        self.partition_id, self.model, self.transport = partition_id, model, transport
        self.loss_fn, self.timeout_s = loss_fn, timeout_s
        self.is_head = partition_id == HEAD
        self.flat, all_grads = bind_flat(model)
        self.lo, self.hi = model.partition_ranges()[partition_id]
        self.params, self.grads = self.flat[self.lo:self.hi], all_grads[self.lo:self.hi]
        self.partition = Partition(model, partition_id, transport, timeout_s)
        self.control_messages = 0

    def module_buffers(self) -> dict[str, torch.Tensor]:
        return {}  # partitioned models (partition/layers.py) have no buffers

    def adopt_buffers(self, buffers: tuple) -> bool:
        return False  # a partition's fetches and pushes cover its range only; no whole-vector shared buffers

    def gradient(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        self.grads.zero_()
        loss, _ = self.partition.step(x, y if self.is_head else None, self.loss_fn if self.is_head else None)
        return loss

    def agree(self, step: int, go: bool) -> bool:
        """The head decides and tells the others; the others learn it."""
        key = ("ctl", step)
        if self.is_head:
            for q in range(self.model.num_partitions):
                if q != HEAD:
                    self.transport.send(q, key, _GO if go else _STOP)
                    self.control_messages += 1
            return go
        flag = self.transport.recv(HEAD, key, self.timeout_s)
        return bool(flag[0] > 0)

    def stats(self) -> dict[str, Any]:
        return {"partition_id": self.partition_id, "num_parameters": self.hi - self.lo,
                "control_messages": self.control_messages, **self.partition.stats.as_dict()}


@dataclass
class PartitionRecipe(ReplicaRecipe):
    """Builds one partition of a replica where it will live (picklable: it travels to the partition's process).

    ``recipe(partition_id, client_for, transport)``: ``client_for(lo, hi)`` returns the range client for the
    partition's parameter range (None means local updates with ``local_optimizer``).
    """

    local_optimizer: Any = None

    def __call__(self, partition_id: int, client_for, transport: Transport) -> ModelReplica:
        # Local updates start from the driver's initial model (seeded with ``seed``); under Downpour the first
        # fetch overwrites the initial values anyway. The same batch order in every partition: they all draw
        # the same minibatches without talking about it.
        model, batches = self.model_and_batches(self.seed if self.local_optimizer is not None else None)
        if not isinstance(model, PartitionedModel):
            raise TypeError(f"partitions need a PartitionedModel, got {type(model).__name__}")
        source = PartitionGradients(self.replica_id, partition_id, model, transport, self.loss_fn,
                                    self.settings.remote_timeout_s)
        if client_for is not None:
            client = client_for(source.lo, source.hi)
        else:  # the single-replica baseline: no parameter server, our range updated in place
            client = LocalUpdates(source.params, self.local_optimizer)
        # Under the staleness bound only the head asks the clock table; the others follow its go/stop decision.
        return ModelReplica(self.replica_id, batches=batches, source=source, client=client, settings=self.settings,
                            clocks=self.clocks if source.is_head else None)
