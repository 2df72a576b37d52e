"""SandblasterReplica: computes gradients of batch portions for the coordinator (docs/paper.md "Sandblaster L-BFGS").

Protocol (the coordinator keeps at most one call outstanding per replica, so calls never overlap):

* ``compute(eval_id, batch_id, batch_size, portion_id, lo, hi, drop)`` — the first call of a new ``eval_id``
  fetches the parameters from the shards (once per evaluation) and forgets everything held from the last one.
  The portion's gradient is kept aside, keyed by ``portion_id``; ``drop`` names held portions the coordinator
  no longer needs (another replica's copy was pushed). Returns scalars only.
* ``take_gradient(eval_id, include, drop)`` — the push: returns the sum of the held gradients of exactly the
  portions in ``include`` (a new float32 array) and forgets them and ``drop``. The coordinator forwards the
  result to the shards' ``accumulate`` without fetching it (``Future.as_arg``).

Keeping portions apart until the push is what lets the coordinator decide, portion by portion, whose copy is
counted (exactly once), and lets an idle replica back up a portion whose only copy sits in a busy straggler.

A portion's contribution is ``mean_loss(portion) * n_portion / batch_size``, its share of the batch mean, so the
portions of a batch sum exactly to the gradient of the batch's mean loss.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from distbelief.buffers import buffers_of
from distbelief.data.batches import BatchSource
from distbelief.exceptions import ReplicaKilled
from distbelief.ps.sharding import bind_flat


def batch_indices(num_examples: int, batch_size: int, batch_id: int, seed: int) -> np.ndarray:
    """Dataset indices of batch ``batch_id``: all examples in order when ``batch_size >= num_examples``, else
    consecutive slices of a per-epoch seeded permutation. Every replica computes the same answer locally, so only
    ``batch_id`` travels."""
    if batch_size >= num_examples:
        return np.arange(num_examples)
    per_epoch = num_examples // batch_size
    epoch, k = divmod(batch_id, per_epoch)
    perm = np.random.default_rng((seed, epoch)).permutation(num_examples)
    return perm[k * batch_size : (k + 1) * batch_size]


@dataclass(frozen=True)
class SandblasterReplicaSettings:
    """Replica settings.

    Attributes:
        seed: seeds the batch order (must be the same in every replica).
        remote_timeout_s: how long a parameter fetch may take.
        portion_hook: run after each portion with (portions so far, its compute seconds): the run's
            ``RunHooks.replica_hook`` (distbelief/hooks.py; tests emulate slow machines with it), or None.
    """

    seed: int = 0
    remote_timeout_s: float = 120.0
    portion_hook: Callable[[int, float], None] | None = None


class SandblasterReplica:
    """One model replica serving portions. It holds the whole training set (any replica may compute any
    portion, which backup tasks need).

    Thread-safety: the coordinator never overlaps calls to one replica; ``stats`` and ``kill`` may come from
    any thread.
    """

    def __init__(self, replica_id: int, model: torch.nn.Module, dataset, client,
                 settings: SandblasterReplicaSettings,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.replica_id = replica_id
        self.model = model
        self.data = BatchSource(dataset, np.arange(len(dataset)), 1, seed=settings.seed)  # for .take only
        self.num_examples = len(dataset)
        self.client = client
        self.settings = settings
        self.loss_fn = loss_fn
        self.flat, self.grads = bind_flat(model)  # .grad of every parameter is a view into self.grads
        self.held: dict[int, torch.Tensor] = {}  # portion id -> its gradient contribution, until pushed
        self.eval_id = -1
        self._batch: tuple[int, int, np.ndarray] | None = None  # (batch_id, batch_size, indices)
        self._killed = False
        self._lock = threading.Lock()
        self.portions = 0
        self.examples = 0
        self.fetches = 0
        self.pushes = 0
        self.compute_s = 0.0
        self.last_loss = math.nan

    # ---------------------------------------------------------------- control
    def kill(self) -> None:
        self._killed = True

    def replace_shard(self, shard_id: int, handle) -> None:
        """A parameter shard was restarted: talk to its new process (a fetch waiting on the dead one resumes)."""
        self.client.replace_shard(shard_id, handle)

    def stats(self) -> dict:
        return {"replica_id": self.replica_id, "portions": self.portions, "examples": self.examples,
                "fetches": self.fetches, "pushes": self.pushes, "compute_s": self.compute_s,
                "held": len(self.held), "steps": self.portions, "loss_ema": self.last_loss}

    def module_buffers(self) -> dict:
        """This replica's module buffers (BatchNorm statistics, updated by the forward passes of its portions),
        as numpy arrays by name; the driver averages the replicas' (buffers.py)."""
        return {name: b.numpy() for name, b in buffers_of(self.model).items()}

    # ---------------------------------------------------------------- portions
    def _check_alive(self) -> None:
        if self._killed:
            raise ReplicaKilled(f"replica {self.replica_id} was killed (fault injection)")

    def _begin(self, eval_id: int) -> None:
        """A new evaluation: fetch its parameters once, forget what was held for the last one."""
        parts, _ = self.client.fetch_async().result(self.settings.remote_timeout_s)
        for lo, values in parts:
            self.flat[lo : lo + len(values)].copy_(torch.as_tensor(values))
        self.held.clear()
        self.eval_id = eval_id
        self.fetches += 1

    def compute(self, eval_id: int, batch_id: int, batch_size: int, portion_id: int, lo: int, hi: int,
                drop: Sequence[int] = ()) -> tuple[int, int, float, float]:
        """Gradient of examples ``[lo, hi)`` of batch ``batch_id``, held until the coordinator's push.

        Returns ``(eval_id, portion_id, loss_contribution, compute_s)``; ``loss_contribution`` sums over the
        portions of a batch to the batch's mean loss.
        """
        self._check_alive()
        with self._lock:
            if eval_id != self.eval_id:
                self._begin(eval_id)
            for p in drop:
                self.held.pop(p, None)
            t0 = time.perf_counter()
            if self._batch is None or self._batch[:2] != (batch_id, batch_size):
                self._batch = (batch_id, batch_size,
                               batch_indices(self.num_examples, batch_size, batch_id, self.settings.seed))
            idx = self._batch[2][lo:hi]
            x, y = self.data.take(idx)
            self.grads.zero_()
            # This portion's share of the batch mean: summing all portions gives the batch gradient exactly.
            loss = self.loss_fn(self.model(x), y) * (len(idx) / min(batch_size, self.num_examples))
            loss.backward()
            self.held[portion_id] = self.grads.clone()
            spent = time.perf_counter() - t0
            if self.settings.portion_hook is not None:
                self.settings.portion_hook(self.portions + 1, spent)
            self.compute_s += time.perf_counter() - t0
            self.portions += 1
            self.examples += len(idx)
            value = float(loss.item())
            self.last_loss = value
            self._check_alive()  # a replica killed while computing must not report a result
            return eval_id, portion_id, value, spent

    def take_gradient(self, eval_id: int, include: Sequence[int], drop: Sequence[int] = ()) -> np.ndarray:
        """The push: the summed gradient of the held portions ``include`` (they and ``drop`` are forgotten)."""
        self._check_alive()
        with self._lock:
            missing = [p for p in include if p not in self.held]
            if eval_id != self.eval_id or missing:
                raise RuntimeError(f"replica {self.replica_id}: asked to push portions {missing or include} of "
                                   f"evaluation {eval_id}, but it holds {sorted(self.held)} of evaluation "
                                   f"{self.eval_id}")
            out = torch.zeros_like(self.grads)  # a new buffer: the shards may read it after we move on
            for p in sorted(include):
                out.add_(self.held.pop(p))
            for p in drop:
                self.held.pop(p, None)
            self.pushes += 1
            return out.numpy()


@dataclass
class SandblasterReplicaRecipe:
    """Builds a SandblasterReplica where it will live (picklable: it travels to the replica's process)."""

    replica_id: int
    model_fn: Callable[[], torch.nn.Module]
    train_data: object  # Dataset or zero-argument factory of one
    settings: SandblasterReplicaSettings
    loss_fn: Callable

    def __call__(self, client) -> SandblasterReplica:
        from distbelief.job import materialize

        ds = materialize(self.train_data)
        # The model's initial values do not matter (the first call fetches the shards' parameters); seeding
        # only keeps construction reproducible.
        torch.manual_seed(self.settings.seed + 1009 * (self.replica_id + 1))
        return SandblasterReplica(self.replica_id, self.model_fn(), ds, client, self.settings, self.loss_fn)
