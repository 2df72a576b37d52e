"""How a user's dataset is loaded: the function that collates its items into a batch, and DataLoader worker
processes that prepare batches ahead of the replica (``train(..., collate_fn=..., loader_workers=...)``).

The options travel with the data: ``WithLoading`` is a picklable zero-argument factory (as any ``train_data``
factory) that every replica, worker and the driver materialise into a ``LoadingDataset`` — the user's dataset
plus its ``Loading`` — so each place that draws batches from it (``BatchSource``, evaluation) loads them the same
way, whatever the strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch.utils.data import Dataset, IterableDataset, default_collate


@dataclass(frozen=True)
class Loading:
    collate_fn: Callable | None = None  # items -> (inputs, targets); torch's default_collate if None
    workers: int = 0  # DataLoader worker processes per replica preparing its next batches (0: in the replica)

    @property
    def collate(self) -> Callable:
        return self.collate_fn or default_collate


class LoadingDataset(Dataset):
    """A map-style dataset with how to load it."""

    def __init__(self, dataset: Dataset, loading: Loading):
        self.dataset, self.loading = dataset, loading

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i]


@dataclass(frozen=True)
class WithLoading:
    """``train_data`` (a Dataset or a zero-argument factory of one) with its Loading; calling it gives the
    LoadingDataset (so ``job.materialize`` treats it as any factory)."""

    data: Any
    loading: Loading

    def __call__(self) -> LoadingDataset:
        from distbelief.job import materialize

        return LoadingDataset(materialize(self.data), self.loading)


def loading_of(dataset) -> Loading:
    return getattr(dataset, "loading", None) or Loading()


def stream_of(dataset) -> IterableDataset | None:
    """The IterableDataset that ``dataset`` streams from (it, or the one a LoadingDataset wraps), or None for a
    map-style dataset (data/batches.py: ``StreamBatches`` and ``iterate_batches`` read it)."""
    inner = dataset.dataset if isinstance(dataset, LoadingDataset) else dataset
    return inner if isinstance(inner, IterableDataset) else None


def fast_tensors(dataset):
    """The ``(inputs, targets)`` tensors to slice batches from directly, when that is how the dataset loads
    (a TensorDataset, no collate function of the user's), else None."""
    loading = getattr(dataset, "loading", None)
    if loading is not None:
        return getattr(dataset.dataset, "tensors", None) if loading.collate_fn is None else None
    return getattr(dataset, "tensors", None)
