"""Named models for the shipped tasks. Any ``nn.Module`` factory works with distbelief; these are conveniences."""

from __future__ import annotations

import math

from torch import nn

# name -> (hidden widths, activation). Speech models follow the paper: sigmoid units, softmax output.
_MLPS = {
    "mlp": ((256, 256), nn.ReLU),
    "mlp-small": ((64,), nn.ReLU),
    "speech-tiny": ((256, 256), nn.Sigmoid),
    "speech-small": ((1024, 1024), nn.Sigmoid),
    "speech-medium": ((2048, 2048, 2048), nn.Sigmoid),
    "speech-paper": ((2560, 2560, 2560, 2560), nn.Sigmoid),  # 440-2560x4-8192: ~42M parameters
}
# Locally connected (untied) models, built as PartitionedModels so that --partitions can split them.
_LOCAL = ("lc1d", "lc-image-small", "lc-image-medium")
MODELS = tuple(_MLPS) + ("cnn",) + _LOCAL
PARTITIONABLE = tuple(_MLPS) + _LOCAL  # models that --partitions P > 1 can split


def build_partitioned(name: str, input_shape: tuple[int, ...], num_classes: int, partitions: int = 1):
    """A named model as a PartitionedModel over ``partitions`` partitions (see distbelief.partition)."""
    from distbelief.partition import (
        Activation,
        FullyConnected,
        LocalContrastNorm,
        LocallyConnected1d,
        LocallyConnected2d,
        MaxPool,
        PartitionedModel,
    )

    if name in _MLPS:  # the same fully connected stack as build_model's nn.Sequential, partitioned by units
        widths, act = _MLPS[name]
        act_name = {nn.ReLU: "relu", nn.Sigmoid: "sigmoid"}[act]
        layers = [x for w in widths for x in (FullyConnected(w), Activation(act_name))]
        return PartitionedModel((math.prod(input_shape),), layers + [FullyConnected(num_classes)], partitions)
    if name == "lc1d":  # mnist1d (40 samples): two untied 1-D filter stages, then a small classifier
        layers = [LocallyConnected1d(16, 5, 1), Activation("relu"), MaxPool(2),
                  LocallyConnected1d(32, 3, 1), Activation("relu"), MaxPool(2),
                  FullyConnected(64), Activation("relu"), FullyConnected(num_classes)]
        return PartitionedModel(input_shape, layers, partitions)
    if name in ("lc-image-small", "lc-image-medium"):
        # The paper's image model in miniature: stages of untied local filtering, pooling and local contrast
        # normalisation, then the output layer. Most of the compute is in the locally connected stages.
        c1, c2 = (8, 16) if name == "lc-image-small" else (32, 64)
        layers = [LocallyConnected2d(c1, 5, 1), Activation("relu"), MaxPool(2), LocalContrastNorm(1),
                  LocallyConnected2d(c2, 3, 1), Activation("relu"), MaxPool(2),
                  FullyConnected(num_classes)]
        return PartitionedModel(input_shape, layers, partitions)
    raise ValueError(f"model {name!r} cannot be partitioned; choose one of {', '.join(PARTITIONABLE)}")


class MNIST1DConvNet(nn.Module):
    """A small 1-D CNN for MNIST-1D (input: 40 samples)."""

    def __init__(self, input_len: int, num_classes: int, channels: int = 25):
        super().__init__()
        self.net = nn.Sequential(
            nn.Unflatten(1, (1, input_len)),
            nn.Conv1d(1, channels, 5, stride=2, padding=1), nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),
            nn.Flatten(),
        )
        out_len = input_len
        for k, s, p in ((5, 2, 1), (3, 2, 1), (3, 2, 1)):
            out_len = (out_len + 2 * p - k) // s + 1
        self.head = nn.Linear(channels * out_len, num_classes)

    def forward(self, x):
        return self.head(self.net(x))


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, partitions: int = 1) -> nn.Module:
    """Build a named model for inputs of ``input_shape`` (without batch) and ``num_classes`` outputs.

    With ``partitions > 1`` (or a locally connected model) the result is a PartitionedModel.
    """
    if partitions > 1 or name in _LOCAL:
        return build_partitioned(name, input_shape, num_classes, partitions)
    d_in = math.prod(input_shape)
    if name == "cnn":
        return MNIST1DConvNet(d_in, num_classes)
    if name not in _MLPS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    widths, act = _MLPS[name]
    layers: list[nn.Module] = [nn.Flatten()] if len(input_shape) > 1 else []
    prev = d_in
    for w in widths:
        layers += [nn.Linear(prev, w), act()]
        prev = w
    layers.append(nn.Linear(prev, num_classes))
    return nn.Sequential(*layers)
