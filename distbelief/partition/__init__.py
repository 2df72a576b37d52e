"""Model parallelism (docs/paper.md): models whose units are split across partitions, boundary-only messages.

Declare a model as a stack of layers plus a partition spec; the framework derives the cross-partition messages:

    from distbelief.partition import PartitionedModel, LocallyConnected1d, MaxPool, Activation, FullyConnected
    model = PartitionedModel((40,), [LocallyConnected1d(16, kernel=5, stride=1), Activation("relu"),
                                     MaxPool(2), FullyConnected(10)], spec=2)
"""

from distbelief.partition.executor import PartitionedExecutor, StepResult
from distbelief.partition.layers import (
    Activation,
    AvgPool,
    FullyConnected,
    Layer,
    LocalContrastNorm,
    LocallyConnected1d,
    LocallyConnected2d,
    Logistic,
    MaxPool,
    Pool,
    Softmax,
    one_vs_all_loss,
)
from distbelief.partition.model import PartitionedModel
from distbelief.partition.partition import MessageStats, Partition
from distbelief.partition.plan import ExchangePlan, PartitionSpec, Transfer

__all__ = [
    "Activation", "AvgPool", "ExchangePlan", "FullyConnected", "Layer", "LocalContrastNorm", "LocallyConnected1d",
    "LocallyConnected2d", "Logistic", "MaxPool", "MessageStats", "Partition", "PartitionSpec", "PartitionedExecutor",
    "PartitionedModel", "Pool", "Softmax", "StepResult", "Transfer", "one_vs_all_loss",
]
