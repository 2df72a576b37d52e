"""A training job as the strategies receive it: the resolved config plus the user's model factory, data and loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.data import Dataset


def materialize(data) -> Dataset:
    """A Dataset from a Dataset or from a zero-argument factory returning one."""
    if isinstance(data, Dataset) or not callable(data):
        return data
    return data()


@dataclass
class Job:
    """What to train and how: the resolved config plus the user's model factory, data and loss."""

    cfg: Any  # RunConfig
    model_fn: Callable[[], torch.nn.Module]
    train_data: Any  # Dataset or zero-arg factory
    test_data: Dataset
    loss_fn: Callable
    threads: int
    train_probe: Dataset | None = None  # a fixed sample of the training set for training accuracy (or None)
    hooks: Any = None  # distbelief.hooks.RunHooks (e.g. distbelief.testing.Faults); None: none
    metric_fn: Callable | None = None  # metric_fn(outputs, targets) -> float over a whole set; None = accuracy

    def __post_init__(self):
        if self.hooks is None:
            from distbelief.hooks import RunHooks

            self.hooks = RunHooks()
