"""Minibatch sampling from a replica's own subset of a torch Dataset, or its own share of a stream (an
IterableDataset)."""

from __future__ import annotations

from itertools import islice

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from distbelief.data.loading import fast_tensors, loading_of, stream_of


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

    def close(self) -> None:
        """Stop the DataLoader workers now, if any (a later batch starts them again). Left to the garbage
        collector, their shutdown would come at an arbitrary later moment and may wait seconds for them there."""
        loader, self._loader = self._loader, None
        _shutdown(loader)

    def take(self, idx) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tensors is not None:
            t = torch.from_numpy(np.asarray(idx))
            x, y = self._tensors[0][t], self._tensors[1][t]
            return x, y
        x, y = self._collate([self.dataset[int(i)] for i in idx])
        return x, y


def _shutdown(loader_iter) -> None:
    """Shut down a DataLoader iterator's worker processes (torch's own shutdown: it sends each its stop, joins it
    and closes the queues); nothing for None or an iterator without workers."""
    stop = getattr(loader_iter, "_shutdown_workers", None)
    if stop is not None:
        stop()


class _Endless:
    """The DataLoader's batch sampler: the BatchSource's own index order, forever."""

    def __init__(self, source: BatchSource):
        self.source = source

    def __iter__(self):
        while True:
            yield [int(i) for i in self.source._next_indices()]


class StreamBatches:
    """Endless minibatches ``(x, y)`` from replica ``replica_id``'s share of a stream (an IterableDataset, or a
    LoadingDataset wrapping one): the same ``next_batch()`` as BatchSource.

    The share is the items at positions ``i`` of the stream with ``i % num_replicas == replica_id``, so the
    replicas' shares are disjoint and together cover the stream. They come in the stream's own order (nothing is
    shuffled), ``batch_size`` at a time, collated like any dataset's items (data/loading.py); the last batch of
    a pass may be shorter. When the stream ends, the next pass (epoch) iterates the dataset again; an endless
    stream is one pass.

    With DataLoader workers (``loader_workers`` W) worker ``w`` reads the stream as well and collates the share's
    batches ``b`` with ``b % W == w``; the DataLoader returns its workers' batches in turn, so the batches and
    their order are exactly those without workers, and each item is in one batch per pass.
    """

    def __init__(self, dataset, replica_id: int, num_replicas: int, batch_size: int):
        self.dataset, self.stream = dataset, stream_of(dataset)
        if self.stream is None:
            raise TypeError(f"StreamBatches reads an IterableDataset, not a {type(dataset).__name__}")
        self.replica_id, self.num_replicas, self.batch_size = replica_id, num_replicas, batch_size
        loading = loading_of(dataset)
        self._collate, self._workers = loading.collate, loading.workers
        self.epochs = 0  # passes over the stream started
        self._batches = None  # the current pass's batches
        self._loader = None  # the DataLoader over the share, made on the first pass when there are workers

    def _new_pass(self):
        self.epochs += 1
        share = _ShareBatches(self.stream, self.replica_id, self.num_replicas, self.batch_size, self._collate)
        if not self._workers:
            return iter(share)
        if self._loader is None:  # persistent workers: each later pass resumes them, starting the stream again
            self._loader = DataLoader(share, batch_size=None, collate_fn=_as_is, num_workers=self._workers,
                                      persistent_workers=True, multiprocessing_context="spawn")
        return iter(self._loader)

    def close(self) -> None:
        """Stop the DataLoader workers now, if any (as BatchSource.close); a later batch starts a new pass."""
        loader, self._loader, self._batches = self._loader, None, None
        _shutdown(getattr(loader, "_iterator", None))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = next(self._batches, None) if self._batches is not None else None
        if batch is None:  # the first batch, or the stream ended: a new pass
            self._batches = self._new_pass()
            batch = next(self._batches, None)
            if batch is None:
                raise ValueError(f"replica {self.replica_id}'s share of the training stream is empty (a pass "
                                 f"yielded fewer than {self.replica_id + 1} items); use fewer replicas")
        x, y = batch
        return x, y


class _ShareBatches(IterableDataset):
    """One pass over a replica's share of ``stream``, collated into batches; in DataLoader worker ``w`` of ``W``,
    only the share's batches ``b`` with ``b % W == w`` (the others are grouped but not collated)."""

    def __init__(self, stream, replica_id: int, num_replicas: int, batch_size: int, collate):
        self.stream, self.collate = stream, collate
        self.replica_id, self.num_replicas, self.batch_size = replica_id, num_replicas, batch_size

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        items = islice(iter(self.stream), self.replica_id, None, self.num_replicas)
        chunks = iter(lambda: list(islice(items, self.batch_size)), [])
        return (self.collate(chunk) for chunk in islice(chunks, worker, None, workers))


def _as_is(batch):
    return batch  # the DataLoader's collate_fn: _ShareBatches already collated


def iterate_batches(dataset: Dataset, batch_size: int):
    """All of ``dataset`` in order, in batches (for evaluation); a stream is read to its end."""
    stream = stream_of(dataset)
    if stream is not None:
        yield from _ShareBatches(stream, 0, 1, batch_size, loading_of(dataset).collate)
        return
    n = len(dataset)
    tensors = fast_tensors(dataset)
    collate = loading_of(dataset).collate
    for start in range(0, n, batch_size):
        stop = min(n, start + batch_size)
        if tensors is not None:
            yield tensors[0][start:stop], tensors[1][start:stop]
        else:
            yield collate([dataset[i] for i in range(start, stop)])
