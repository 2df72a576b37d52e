"""Minibatch sampling from a replica's own subset of a torch Dataset."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from distbelief.data.loading import fast_tensors, loading_of


def replica_indices(num_examples: int, num_replicas: int, replica_id: int, seed: int) -> np.ndarray:
    """The data subset of one replica: a seeded permutation cut into ``num_replicas`` disjoint parts."""
    perm = np.random.default_rng(seed).permutation(num_examples)
    return np.array_split(perm, num_replicas)[replica_id]


class BatchSource:
    """Endless shuffled minibatches ``(x, y)`` over ``indices`` of ``dataset``.

    A dataset exposing ``.tensors`` (``TensorDataset``) is sliced directly; any other map-style Dataset is
    indexed item by item and collated (torch's default collate, or the user's ``collate_fn``: data/loading.py).
    With DataLoader workers (``loader_workers``) those processes prepare the next batches ahead, in the same
    order as without them.
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
        self._tensors = fast_tensors(dataset)
        self._collate = loading_of(dataset).collate
        self._loader = None  # the DataLoader iterator, started on the first batch when there are workers

    def _next_indices(self) -> np.ndarray:
        if self._pos + self.batch_size > self._order.size:
            self._order = self.rng.permutation(self.indices)
            self._pos = 0
        idx = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        return idx

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        workers = loading_of(self.dataset).workers
        if workers and self._tensors is None:
            if self._loader is None:
                self._loader = iter(DataLoader(self.dataset, batch_sampler=_Endless(self), collate_fn=self._collate,
                                               num_workers=workers, persistent_workers=True,
                                               multiprocessing_context="spawn"))
            x, y = next(self._loader)
            return x, y
        return self.take(self._next_indices())

    def take(self, idx) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tensors is not None:
            t = torch.from_numpy(np.asarray(idx))
            x, y = self._tensors[0][t], self._tensors[1][t]
            return x, y
        x, y = self._collate([self.dataset[int(i)] for i in idx])
        return x, y


class _Endless:
    """The DataLoader's batch sampler: the BatchSource's own index order, forever."""

    def __init__(self, source: BatchSource):
        self.source = source

    def __iter__(self):
        while True:
            yield [int(i) for i in self.source._next_indices()]


def iterate_batches(dataset: Dataset, batch_size: int):
    """All of ``dataset`` in order, in batches (for evaluation)."""
    n = len(dataset)
    tensors = fast_tensors(dataset)
    collate = loading_of(dataset).collate
    for start in range(0, n, batch_size):
        stop = min(n, start + batch_size)
        if tensors is not None:
            yield tensors[0][start:stop], tensors[1][start:stop]
        else:
            yield collate([dataset[i] for i in range(start, stop)])
