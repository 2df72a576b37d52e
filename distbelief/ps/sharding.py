"""Flatten a model's parameters into one vector and cut it into balanced contiguous shard ranges.

The flat order is ``model.named_parameters()`` order. Ranges are balanced by element count, so a large tensor
may span several shards and shard sizes differ by at most one element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distbelief.exceptions import ConfigError


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor's place in the flat vector: ``flat[offset : offset + numel]``."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ShardLayout:
    """Which flat range each of ``num_shards`` shards owns: shard k owns ``[bounds[k], bounds[k + 1])``."""

    total: int
    bounds: tuple[int, ...]

    @classmethod
    def balanced(cls, total: int, num_shards: int) -> "ShardLayout":
        if num_shards < 1:
            raise ConfigError("shards", f"must be >= 1, got {num_shards}")
        if num_shards > total:
            raise ConfigError(
                "shards",
                f"{num_shards} shards for a model with only {total} parameters; use at most {total} shards",
            )
        base, extra = divmod(total, num_shards)
        bounds = [0]
        for k in range(num_shards):
            bounds.append(bounds[-1] + base + (1 if k < extra else 0))
        return cls(total=total, bounds=tuple(bounds))

    @property
    def num_shards(self) -> int:
        return len(self.bounds) - 1

    def range(self, shard_id: int) -> tuple[int, int]:
        return self.bounds[shard_id], self.bounds[shard_id + 1]

    def sizes(self) -> list[int]:
        return [self.bounds[k + 1] - self.bounds[k] for k in range(self.num_shards)]

    def shards_overlapping(self, lo: int, hi: int) -> list[int]:
        """Shard ids whose range intersects the flat range ``[lo, hi)``."""
        return [k for k in range(self.num_shards) if self.bounds[k] < hi and self.bounds[k + 1] > lo]


def param_specs(model: torch.nn.Module) -> list[ParamSpec]:
    specs, offset = [], 0
    for name, p in model.named_parameters():
        specs.append(ParamSpec(name, tuple(p.shape), offset))
        offset += p.numel()
    return specs


def flatten(model: torch.nn.Module) -> torch.Tensor:
    """A new float32 vector holding all parameters in flat order."""
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in model.parameters()])


def unflatten_into(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy ``flat`` into the model's parameters (in place)."""
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n
    if offset != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} elements but the model has {offset} parameters")


def bind_flat(model: torch.nn.Module, flat: torch.Tensor | None = None,
              grads: torch.Tensor | None = None, params: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Make every parameter (and its ``.grad``) a view into one flat buffer.

    Returns ``(flat_params, flat_grads)``. Writing into ``flat_params`` changes the model; ``backward()``
    accumulates straight into ``flat_grads`` (autograd adds into an existing ``.grad`` in place), so a replica
    never gathers per-tensor gradients before a push. ``flat`` / ``grads``: 1-D float32 buffers to use (e.g.
    shared memory a shard writes fetches into); the model's current values are copied into ``flat``. ``params``:
    the parameters to bind, in order (default: all of the model's; a model with embedding tables binds its dense
    ones, downpour/sparse.py).
    """
    params = list(model.parameters()) if params is None else list(params)
    total = sum(p.numel() for p in params)
    for name, buf in (("flat", flat), ("grads", grads)):
        if buf is not None and (buf.dtype != torch.float32 or buf.dim() != 1 or buf.numel() != total):
            raise ValueError(f"bind_flat: {name} must be a 1-D float32 tensor of {total} elements, "
                             f"got {buf.dtype} of shape {tuple(buf.shape)}")
    flat = torch.empty(total, dtype=torch.float32) if flat is None else flat
    grads = torch.zeros(total, dtype=torch.float32) if grads is None else grads.zero_()
    offset = 0
    for p in params:
        n = p.numel()
        flat[offset : offset + n].copy_(p.detach().reshape(-1))
        p.data = flat[offset : offset + n].view_as(p)
        p.grad = grads[offset : offset + n].view_as(p)
        offset += n
    return flat, grads
