"""Named models for the shipped tasks. Any ``nn.Module`` factory works with distbelief; these are conveniences."""

from __future__ import annotations

import math

import torch
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
MODELS = tuple(_MLPS) + ("cnn",) + _LOCAL + ("dlrm-small",)
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


class DLRM(nn.Module):
    """DLRM (Naumov et al., 2019) for one float32 row per example: ``x[:, :num_dense]`` dense features and
    ``x[:, num_dense:]`` one id per categorical field (exact integers in float32). A bottom MLP maps the dense
    features to a ``dim``-vector; each field's id picks a row of its own ``EmbeddingBag`` (sparse gradients: a step
    touches only the rows of its batch); the pairwise dot products of those 1 + fields vectors (upper triangle)
    and the dense vector feed the top MLP, whose output is one click logit per example, shape [B]."""

    def __init__(self, cardinalities, num_dense: int = 13, dim: int = 16, bottom: tuple[int, ...] = (64,),
                 top: tuple[int, ...] = (64,)):
        super().__init__()
        self.num_dense, self.dim = num_dense, dim
        layers: list[nn.Module] = []
        prev = num_dense
        for w in (*bottom, dim):
            layers += [nn.Linear(prev, w), nn.ReLU()]
            prev = w
        self.bottom = nn.Sequential(*layers)
        self.embeddings = nn.ModuleList(nn.EmbeddingBag(int(n), dim, mode="sum", sparse=True) for n in cardinalities)
        for e in self.embeddings:  # DLRM's init: U(-1/sqrt(rows), 1/sqrt(rows))
            nn.init.uniform_(e.weight, -(1.0 / e.num_embeddings) ** 0.5, (1.0 / e.num_embeddings) ** 0.5)
        n_vec = 1 + len(self.embeddings)
        rows, cols = torch.triu_indices(n_vec, n_vec, offset=1)
        self.register_buffer("_pairs", rows * n_vec + cols, persistent=False)  # upper triangle of [n_vec, n_vec]
        layers, prev = [], n_vec * (n_vec - 1) // 2 + dim
        for w in top:
            layers += [nn.Linear(prev, w), nn.ReLU()]
            prev = w
        self.top = nn.Sequential(*layers, nn.Linear(prev, 1))

    def embedding_ids(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The ids each table will look up for ``x``, one tensor per table in module order: a Downpour replica
        fetches all of a step's rows in one call per shard before the forward (downpour/sparse.py)."""
        ids = x[:, self.num_dense:].long()
        return [ids[:, f] for f in range(ids.shape[1])]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.bottom(x[:, : self.num_dense])  # [B, dim]
        ids = x[:, self.num_dense:].long()  # [B, fields]
        vecs = [z] + [e(ids[:, f : f + 1]) for f, e in enumerate(self.embeddings)]  # each [B, dim]: a bag of 1
        t = torch.stack(vecs, dim=1)  # [B, 1 + fields, dim]
        dots = torch.bmm(t, t.transpose(1, 2)).flatten(1)[:, self._pairs]  # [B, n(n-1)/2]
        return self.top(torch.cat([z, dots], dim=1)).squeeze(1)  # [B]


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, partitions: int = 1, *,
                cardinalities: tuple[int, ...] | None = None) -> nn.Module:
    """Build a named model for inputs of ``input_shape`` (without batch) and ``num_classes`` outputs.

    With ``partitions > 1`` (or a locally connected model) the result is a PartitionedModel. ``dlrm-small`` (the
    ctr task's) needs the row count of every categorical field in ``cardinalities`` (``Task.cardinalities``);
    its input holds ``input_shape[0] - len(cardinalities)`` dense features, then one id per field, and it
    outputs one logit per example (``num_classes`` is not used).
    """
    if name == "dlrm-small":
        if partitions > 1:
            raise ValueError("model 'dlrm-small' cannot be partitioned; use partitions = 1")
        if not cardinalities:
            raise ValueError("model 'dlrm-small' needs the categorical fields' row counts (cardinalities=...); "
                             "it trains on the ctr task")
        num_dense = math.prod(input_shape) - len(cardinalities)
        if num_dense < 1:
            raise ValueError(f"dlrm-small: inputs of shape {input_shape} hold no dense features next to "
                             f"{len(cardinalities)} categorical fields")
        return DLRM(cardinalities, num_dense=num_dense)
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
