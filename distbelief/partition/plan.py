"""The partition spec (who owns which units) and the exchange plan derived from the layers' connectivity.

Pure Python, no processes: ``ExchangePlan`` says, for every layer and partition, which input units it needs from
which other partition. A transfer is one *box* of units (all channels) from an owner to a destination, so each
unit's state travels to a destination **once**, however many of its edges cross to it (the paper's Fig. 1).
Backward returns the gradients of exactly those boxes along the same edges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from distbelief.exceptions import ConfigError
from distbelief.partition.layers import Box, Layer, Shape, box_empty, box_volume, intersect
from distbelief.runtime.group_stats import HEAD  # partition 0 gathers the output, computes the loss, leads the lockstep


def _bands(n: int, k: int) -> list[tuple[int, int]]:
    """``n`` units cut into ``k`` contiguous, balanced bands (some empty when ``n < k``)."""
    sizes = [len(a) for a in np.array_split(np.arange(n), k)]
    bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return [(bounds[i], bounds[i + 1]) for i in range(k)]


def tile_grid(num_partitions: int) -> tuple[int, int]:
    """The most square ``rows x cols`` grid of ``num_partitions`` tiles (rows >= cols)."""
    cols = max(c for c in range(1, int(math.isqrt(num_partitions)) + 1) if num_partitions % c == 0)
    return num_partitions // cols, cols


@dataclass(frozen=True)
class PartitionSpec:
    """How the units of every layer are split among ``num_partitions`` partitions (the paper's vertical split).

    1-D layers (and fully connected layers, whose units form one axis) are cut into ``num_partitions`` bands of
    positions; 2-D layers into a ``grid`` of tiles (rows x cols, default the most square), partition
    ``i * cols + j`` owning tile ``(i, j)``. ``regions`` overrides a layer's split with one box per partition
    (a layer-wise cut: e.g. a whole layer on one partition, the others owning empty boxes).
    """

    num_partitions: int
    grid: tuple[int, int] | None = None
    regions: dict[int, tuple[Box, ...]] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.num_partitions, int) or self.num_partitions < 1:
            raise ConfigError("partitions", f"must be >= 1, got {self.num_partitions!r}")
        if self.grid is not None and self.grid[0] * self.grid[1] != self.num_partitions:
            raise ConfigError("partitions", f"tile grid {self.grid} does not have {self.num_partitions} tiles")

    def layer_regions(self, layer_index: int, shape: Shape) -> list[Box]:
        """One box per partition for the layer whose activation has ``shape`` (its boxes tile the layer)."""
        if layer_index in self.regions:
            boxes = [tuple(tuple(x) for x in b) for b in self.regions[layer_index]]
            if len(boxes) != self.num_partitions:
                raise ConfigError("partitions", f"layer {layer_index}: {len(boxes)} regions for "
                                                f"{self.num_partitions} partitions")
            return boxes
        positions = shape[1:]
        if len(positions) == 1:
            return [(band,) for band in _bands(positions[0], self.num_partitions)]
        if len(positions) == 2:
            rows, cols = self.grid or tile_grid(self.num_partitions)
            hb, wb = _bands(positions[0], rows), _bands(positions[1], cols)
            return [(hb[i], wb[j]) for i in range(rows) for j in range(cols)]
        raise ValueError(f"layers need 1 or 2 position axes, got shape {shape}")


@dataclass(frozen=True)
class Transfer:
    """Units ``box`` (all ``channels``) of the input of layer ``layer``, from their owner ``src`` to ``dst``."""

    layer: int
    src: int
    dst: int
    box: Box
    channels: int

    @property
    def units(self) -> int:
        return box_volume(self.box) * self.channels


@dataclass
class ExchangePlan:
    """Everything a partition needs to know to run its part of a step.

    ``shapes[i]`` is the shape of layer ``i``'s input (``shapes[0]`` the model input, ``shapes[-1]`` the
    output); ``regions[i][p]`` the box of layer ``i``'s output owned by ``p``; ``needs[i][p]`` the input box
    layer ``i`` of partition ``p`` reads. ``recvs[i][p]`` / ``sends[i][p]`` are the transfers into / out of
    ``p`` for layer ``i``'s input (none for layer 0: every partition reads its input region from the data).
    """

    num_partitions: int
    shapes: list[Shape]
    regions: list[list[Box]]
    needs: list[list[Box]]
    recvs: list[list[list[Transfer]]]
    sends: list[list[list[Transfer]]]

    @classmethod
    def build(cls, input_shape: Shape, layers: Sequence[Layer], spec: PartitionSpec) -> "ExchangePlan":
        P = spec.num_partitions
        shapes = [tuple(input_shape)]
        for layer in layers:
            shapes.append(tuple(layer.out_shape(shapes[-1])))
        regions = [spec.layer_regions(i, shapes[i + 1]) for i in range(len(layers))]
        needs = [[layers[i].needs(regions[i][p], shapes[i]) for p in range(P)] for i in range(len(layers))]
        recvs = [[[] for _ in range(P)] for _ in layers]
        sends = [[[] for _ in range(P)] for _ in layers]
        for i in range(1, len(layers)):
            for dst in range(P):
                need = needs[i][dst]
                covered = 0
                for src in range(P):
                    part = intersect(need, regions[i - 1][src])
                    if box_empty(part):
                        continue
                    covered += box_volume(part)
                    if src != dst:
                        t = Transfer(i, src, dst, part, shapes[i][0])
                        recvs[i][dst].append(t)
                        sends[i][src].append(t)
                # The owners' boxes tile the layer, so the needed box is covered exactly once.
                assert box_empty(need) or covered == box_volume(need), (i, dst, need)
        return cls(P, shapes, regions, needs, recvs, sends)

    @property
    def num_layers(self) -> int:
        return len(self.regions)

    def forward_units(self, partition_id: int | None = None) -> int:
        """Units (per example) sent between partitions in one forward pass, by one partition or by all."""
        return sum(t.units for layer in self.sends for p, ts in enumerate(layer)
                   for t in ts if partition_id is None or p == partition_id)

    def output_units(self, partition_id: int) -> int:
        """Units (per example) of the model's output that ``partition_id`` sends to the head each forward."""
        return 0 if partition_id == HEAD else box_volume(self.regions[-1][partition_id]) * self.shapes[-1][0]
