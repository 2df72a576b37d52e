"""Minibatch sampling from a replica's own subset of a torch Dataset."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate


def replica_indices(num_examples: int, num_replicas: int, replica_id: int, seed: int) -> np.ndarray:
    """The data subset of one replica: a seeded permutation cut into ``num_replicas`` disjoint parts."""
    perm = np.random.default_rng(seed).permutation(num_examples)
    return np.array_split(perm, num_replicas)[replica_id]


class BatchSource:
    """Endless shuffled minibatches ``(x, y)`` over ``indices`` of ``dataset``.

    A dataset exposing ``.tensors`` (``TensorDataset``) is sliced directly; any other map-style Dataset is
    indexed item by item and collated with torch's default collate.
    """

    def __init__(self, dataset: Dataset, indices, batch_size: int, seed: int):
        self.dataset = dataset
        self.indices = np.asarray(indices, dtype=np.int64)
        if self.indices.size == 0:
            raise ValueError("a replica received an empty data subset; use fewer replicas or more examples")
        self.batch_size = min(batch_size, self.indices.size)
        self.rng = np.random.default_rng(seed)
        self._order = self.rng.permutation(self.indices)
        self._pos = 0
        self._tensors = getattr(dataset, "tensors", None)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pos + self.batch_size > self._order.size:
            self._order = self.rng.permutation(self.indices)
            self._pos = 0
        idx = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        return self.take(idx)

    def take(self, idx) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tensors is not None:
            t = torch.from_numpy(np.asarray(idx))
            x, y = self._tensors[0][t], self._tensors[1][t]
            return x, y
        x, y = default_collate([self.dataset[int(i)] for i in idx])
        return x, y


def iterate_batches(dataset: Dataset, batch_size: int):
    """All of ``dataset`` in order, in batches (for evaluation)."""
    n = len(dataset)
    tensors = getattr(dataset, "tensors", None)
    for start in range(0, n, batch_size):
        stop = min(n, start + batch_size)
        if tensors is not None:
            yield tensors[0][start:stop], tensors[1][start:stop]
        else:
            yield default_collate([dataset[i] for i in range(start, stop)])
