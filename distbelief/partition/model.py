"""PartitionedModel: a stack of partitionable layers plus a partition spec, as one ``nn.Module``.

Parameter layout. The parameters of a unit belong to the partition that owns the unit. The module registers them
*partition-major* — all of partition 0's slices (layer by layer), then partition 1's, ... — so in the flat
parameter vector (``named_parameters`` order, which the parameter server shards) each partition's parameters are
one contiguous range, ``partition_ranges()[p]``. Under Downpour a partition fetches and pushes only that range.

Initial values are drawn as whole (canonical) tensors from torch's global generator and then sliced, so a model
built with the same seed holds the same numbers for any number of partitions; ``canonical_params`` reassembles
them (tests compare against plain torch that way).

``forward`` runs the whole stack as a single partition (every layer on its full region) — used for evaluation on
the driver and as the oracle for the partitioned execution in :mod:`distbelief.partition.executor`.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from distbelief.partition.layers import Layer, Shape, box_empty, full_box, param_slice
from distbelief.partition.plan import ExchangePlan, PartitionSpec


def normalize_input_shape(input_shape: Sequence[int]) -> Shape:
    """``(L,)`` inputs are one-channel 1-D layers; ``(C, L)`` and ``(C, H, W)`` are taken as they are."""
    shape = tuple(int(n) for n in input_shape)
    if len(shape) == 1:
        return (1, shape[0])
    if len(shape) in (2, 3):
        return shape
    raise ValueError(f"inputs must be (L,), (C, L) or (C, H, W), got {shape}")


class PartitionedModel(nn.Module):
    """A model whose units are split over ``spec.num_partitions`` partitions.

    Args:
        input_shape: one example's shape without the batch axis: ``(L,)``, ``(C, L)`` or ``(C, H, W)``.
        layers: the stack, from :mod:`distbelief.partition.layers` (or any :class:`Layer`).
        spec: a PartitionSpec, or the number of partitions for the default vertical split.

    The output is the last layer's activation flattened to ``(batch, units)``.
    """

    def __init__(self, input_shape: Sequence[int], layers: Sequence[Layer], spec: PartitionSpec | int = 1):
        super().__init__()
        self.spec = spec if isinstance(spec, PartitionSpec) else PartitionSpec(int(spec))
        self.input_shape = normalize_input_shape(input_shape)
        self.layers = list(layers)
        self.plan = ExchangePlan.build(self.input_shape, self.layers, self.spec)
        full = [layer.init_params(self.plan.shapes[i]) for i, layer in enumerate(self.layers)]
        self.parts = nn.ModuleList()
        for p in range(self.num_partitions):
            own = nn.ParameterDict()
            for i, params in enumerate(full):
                for name, t in params.items():
                    own[f"l{i}_{name}"] = nn.Parameter(param_slice(t, self.plan.regions[i][p]).clone())
            self.parts.append(own)

    @property
    def num_partitions(self) -> int:
        return self.spec.num_partitions

    def layer_params(self, partition_id: int, layer_index: int) -> dict[str, nn.Parameter]:
        """The parameters of layer ``layer_index``'s units owned by ``partition_id``, by name."""
        prefix = f"l{layer_index}_"
        return {k[len(prefix):]: v for k, v in self.parts[partition_id].items() if k.startswith(prefix)}

    def partition_ranges(self) -> list[tuple[int, int]]:
        """Flat ``[lo, hi)`` parameter range of each partition (in ``named_parameters`` order)."""
        ranges, lo = [], 0
        for own in self.parts:
            n = sum(p.numel() for p in own.values())
            ranges.append((lo, lo + n))
            lo += n
        return ranges

    def _assemble(self, layer_index: int, grads: bool = False) -> dict[str, torch.Tensor]:
        """Layer ``layer_index``'s whole (canonical) parameter tensors from the partitions' slices."""
        shapes = self.layers[layer_index].param_shapes(self.plan.shapes[layer_index])
        if self.num_partitions == 1 and not grads:
            return self.layer_params(0, layer_index)
        out = {}
        for name, shape in shapes.items():
            full = torch.zeros(shape)
            for p in range(self.num_partitions):
                box = self.plan.regions[layer_index][p]
                if box_empty(box):
                    continue
                piece = self.layer_params(p, layer_index)[name]
                if grads:
                    piece = piece.grad if piece.grad is not None else torch.zeros_like(piece)
                # Slice assignment is differentiable: gradients flow back to each partition's slice.
                full[tuple(slice(lo, hi) for lo, hi in box)] = piece
            out[name] = full
        return out

    def canonical_params(self) -> list[dict[str, torch.Tensor]]:
        """Every layer's whole parameter tensors (leading axes = output positions), detached."""
        with torch.no_grad():
            return [{k: v.detach().clone() for k, v in self._assemble(i).items()} for i in range(len(self.layers))]

    def canonical_grads(self) -> list[dict[str, torch.Tensor]]:
        """Every layer's whole gradient tensors assembled from the partitions' ``.grad`` slices."""
        with torch.no_grad():
            return [self._assemble(i, grads=True) for i in range(len(self.layers))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole stack as one partition: ``(batch, *input_shape) -> (batch, output units)``."""
        h = x.reshape(x.shape[0], *self.input_shape)
        for i, layer in enumerate(self.layers):
            shape_in, shape_out = self.plan.shapes[i], self.plan.shapes[i + 1]
            h = layer.forward(h, full_box(shape_in), full_box(shape_out), self._assemble(i), shape_in)
        return h.reshape(h.shape[0], -1)

    def extra_repr(self) -> str:
        names = ", ".join(type(layer).__name__ for layer in self.layers)
        return f"input={self.input_shape}, partitions={self.num_partitions}, layers=[{names}]"
