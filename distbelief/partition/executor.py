"""In-process executor: the P partitions of one model as threads exchanging explicit messages.

This is the reference execution of the partitioning (tests drive it directly) and the single-machine way to
run a partitioned model: torch releases the GIL inside its kernels, so partitions overlap on several cores.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass
from typing import Callable

import torch

from distbelief.exceptions import RemoteTimeoutError
from distbelief.partition.model import PartitionedModel
from distbelief.partition.partition import Partition
from distbelief.partition.plan import HEAD
from distbelief.runtime.transport import InProcessTransport


@dataclass
class StepResult:
    """One partitioned step: the loss and output (from the head) and what each partition sent."""

    loss: float | None
    output: torch.Tensor
    bytes_sent: list[int]  # per partition, this step
    messages_sent: list[int]
    bytes_by_phase: list[dict[str, int]]


class PartitionedExecutor:
    """Runs a PartitionedModel's P partitions as P threads of this process.

    Args:
        model: the model; each partition reads and writes only its own parameter slices (and their ``.grad``).
        timeout_s: the longest any partition may wait for a message.

    Thread-safety: one ``step`` at a time.
    """

    def __init__(self, model: PartitionedModel, timeout_s: float = 60.0):
        self.model, self.timeout_s = model, timeout_s
        P = model.num_partitions
        self.transports = InProcessTransport.group(P)
        self.partitions = [Partition(model, p, self.transports[p], timeout_s) for p in range(P)]
        self._pool = cf.ThreadPoolExecutor(max_workers=P, thread_name_prefix="distbelief-partition")

    def step(self, x: torch.Tensor, y: torch.Tensor | None = None,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             backward: bool = True) -> StepResult:
        """Forward (and backward, accumulating into the parameters' ``.grad``) over minibatch ``x``."""
        before = [(part.stats.bytes_sent, part.stats.messages_sent, dict(part.stats.bytes))
                  for part in self.partitions]
        futs = [self._pool.submit(part.step, x, y if p == HEAD else None, loss_fn if p == HEAD else None, backward)
                for p, part in enumerate(self.partitions)]
        try:
            results = [f.result(timeout=self.timeout_s * (2 * len(self.model.layers) + 2)) for f in futs]
        except cf.TimeoutError:
            raise RemoteTimeoutError("a partition did not finish its step (raise timeout_s if it is slow)") from None
        except BaseException as e:
            # One partition failed: wake the others (blocked on its messages) so the pool drains.
            self.transports[0].fail_all(e if isinstance(e, Exception) else None)
            raise
        loss, output = results[HEAD]
        stats = [part.stats for part in self.partitions]
        return StepResult(
            loss=loss,
            output=output,
            bytes_sent=[s.bytes_sent - b[0] for s, b in zip(stats, before)],
            messages_sent=[s.messages_sent - b[1] for s, b in zip(stats, before)],
            bytes_by_phase=[{k: v - b[2][k] for k, v in s.bytes.items()} for s, b in zip(stats, before)],
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "PartitionedExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StepWorker:
    """One partition that runs forward/backward steps on minibatches it is given (no parameter server): the
    worker behind the Ray equivalence tests and the Fig. 3 benchmark. Thread-safety: one call at a time."""

    def __init__(self, model: PartitionedModel, partition_id: int, transport, loss_fn: Callable,
                 timeout_s: float = 60.0):
        from distbelief.ps.sharding import bind_flat

        self.model, self.partition_id, self.loss_fn = model, partition_id, loss_fn
        self.flat, self.grads = bind_flat(model)
        self.lo, self.hi = model.partition_ranges()[partition_id]
        self.partition = Partition(model, partition_id, transport, timeout_s)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        """One step; returns this partition's flat gradient range, the loss/output (head) and bytes sent."""
        before = self.partition.stats.bytes_sent, self.partition.stats.messages_sent
        self.grads[self.lo:self.hi].zero_()
        head = self.partition_id == HEAD
        loss, out = self.partition.step(x, y if head else None, self.loss_fn if head else None)
        return {"partition_id": self.partition_id, "lo": self.lo, "grad": self.grads[self.lo:self.hi].numpy().copy(),
                "loss": loss, "output": None if out is None else out.numpy(),
                "bytes_sent": self.partition.stats.bytes_sent - before[0],
                "messages_sent": self.partition.stats.messages_sent - before[1]}

    def timed_steps(self, x: torch.Tensor, y: torch.Tensor, num_steps: int) -> dict:
        """Seconds for ``num_steps`` steps (all partitions run them in lockstep) and bytes sent per step."""
        import time

        before = self.partition.stats.bytes_sent, self.partition.stats.messages_sent
        t0 = time.perf_counter()
        for _ in range(num_steps):
            self.grads[self.lo:self.hi].zero_()
            head = self.partition_id == HEAD
            self.partition.step(x, y if head else None, self.loss_fn if head else None)
        return {"partition_id": self.partition_id, "seconds": time.perf_counter() - t0,
                "bytes_per_step": (self.partition.stats.bytes_sent - before[0]) / num_steps,
                "messages_per_step": (self.partition.stats.messages_sent - before[1]) / num_steps}


@dataclass
class StepWorkerRecipe:
    """Builds a StepWorker where it lives (picklable): the same ``seed`` gives every partition the same model."""

    model_fn: Callable[[], PartitionedModel]
    loss_fn: Callable
    seed: int = 0
    timeout_s: float = 60.0

    def __call__(self, partition_id: int, client_for, transport) -> StepWorker:
        torch.manual_seed(self.seed)
        return StepWorker(self.model_fn(), partition_id, transport, self.loss_fn, self.timeout_s)
