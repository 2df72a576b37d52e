"""What every compression scheme provides (see the package's docstring)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

Range = tuple[int, int]

def to_wire(t: torch.Tensor) -> np.ndarray:
    """A tensor as a part carries it: a numpy array of its values (its own memory). Ray serialises numpy arrays as
    out-of-band buffers; a torch tensor goes through its pickled storage, which costs several times as much on
    both ends of every push (a PowerSGD part of the Fig. 4 model: 3.2 against 0.16 ms to pickle and unpickle)."""
    return t.detach().contiguous().numpy()


def from_wire(a: Any) -> torch.Tensor:
    """The tensor view of a part's array (no copy; a tensor is taken as it is). A part that crossed Ray is
    read-only; decoding only reads it (ps/arrays.py silences torch's warning about that in the shards)."""
    return torch.as_tensor(a)


class Codec(ABC):
    """One scheme for one model layout. ``ranges``: the flat ``[lo, hi)`` range of each shard, in shard order.

    ``encode(a)`` returns one part per shard (numpy arrays, ``to_wire``, and numbers) from the full float32 flat
    vector ``a``; ``decode(part, lo, hi)`` is the dense float32 range ``a``'s part stands for, as the shard applies it;
    ``formula_bytes(k)`` is what the scheme's arithmetic says part k weighs on the wire (``wire_bytes`` of the part
    must equal it: the tests hold them to it). A codec may keep state between pushes (PowerSGD's warm start), so
    each replica has its own."""

    name: str = "codec"
    # Whether ``a - sent`` is exact in float32 for every float32 ``a`` (then the replica's residual is kept in
    # float32; else in float64, where it is exact: compression/feedback.py).
    exact_in_float32: bool = False

    def __init__(self, ranges: list[Range]):
        self.ranges = list(ranges)

    @abstractmethod
    def encode(self, a: torch.Tensor) -> list[Any]:
        """One part per shard from the flat float32 vector ``a``."""

    @staticmethod
    @abstractmethod
    def decode(part: Any, lo: int, hi: int) -> torch.Tensor:
        """The dense float32 values of ``[lo, hi)`` that ``part`` stands for (a new tensor)."""

    @staticmethod
    def positions(part: Any, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(positions, values)`` when ``part`` stands for a range that is 0 except at those positions (int64, in
        the range, strictly increasing) where it holds those float32 values; None for a dense scheme. A shard
        whose rule is elementwise then steps only those values (ps/shard.py)."""
        return None

    @abstractmethod
    def formula_bytes(self, k: int) -> int:
        """Bytes of shard k's part by the scheme's formula."""

    def sent(self, parts: list[Any]) -> torch.Tensor:
        """The flat vector the shards will apply: every part decoded by the shards' own code."""
        return torch.cat([self.decode(p, lo, hi) for p, (lo, hi) in zip(parts, self.ranges)])

    def residual(self, a: torch.Tensor, parts: list[Any], dtype: torch.dtype,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """``a - sent(parts)`` in ``dtype``: written into ``out`` (a ``dtype`` vector of ``a``'s size) when given,
        else a new tensor (``a`` may be taken over). A scheme may compute it without building ``sent``, but must
        give the same bits. Here each part's decoded range is taken from ``a`` in place, in ``dtype``."""
        r = a.to(dtype) if out is None else out.copy_(a)
        for part, (lo, hi) in zip(parts, self.ranges, strict=True):
            r[lo:hi].sub_(self.decode(part, lo, hi))  # (in dtype: a float32 part is widened first)
        return r

    def describe(self) -> str:
        return self.name


def wire_bytes(obj: Any) -> int:
    """Payload bytes of a part as it crosses the wire: the bytes of every tensor or array in it (ints and floats
    as 4 bytes each, tuples and lists summed); the message framing around them is not counted."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, (tuple, list)):
        return sum(wire_bytes(x) for x in obj)
    if isinstance(obj, (int, float)):
        return 4
    if obj is None:
        return 0
    raise TypeError(f"cannot size a {type(obj).__name__} for the wire")
