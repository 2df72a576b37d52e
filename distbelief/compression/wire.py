"""A compressed push as it travels: the replica's client hands a transport an ``EncodedPush`` (every shard's part);
a transport sends each shard its ``EncodedRange`` (``push[lo:hi]``), or, on one node, the whole push (the shard
takes its own part); the shard decodes it into the dense range it applies (``dense_push``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distbelief.compression.base import wire_bytes


def _codec(name: str):
    from distbelief.compression.registry import codec_class

    return codec_class(name)


@dataclass
class EncodedRange:
    """Shard range ``[lo, hi)`` of a push, encoded by ``codec``."""

    codec: str
    part: Any
    lo: int
    hi: int

    def decode(self) -> torch.Tensor:
        return _codec(self.codec).decode(self.part, self.lo, self.hi)

    def positions(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(positions in the range, values)`` for a sparse scheme's part (``Codec.positions``), else None."""
        return _codec(self.codec).positions(self.part, self.lo, self.hi)

    @property
    def nbytes(self) -> int:
        return wire_bytes(self.part)


@dataclass
class EncodedPush:
    """Every shard's part of one push, in shard order (``ranges[k]`` is shard k's)."""

    codec: str
    parts: list
    ranges: list

    def __getitem__(self, s: slice) -> EncodedRange:
        for part, (lo, hi) in zip(self.parts, self.ranges):
            if (lo, hi) == (s.start, s.stop):
                return EncodedRange(self.codec, part, lo, hi)
        raise KeyError(f"no part of this push covers exactly [{s.start}, {s.stop})")

    def covering(self, lo: int, hi: int) -> EncodedRange:
        """The part whose range is the shard range ``[lo, hi)``."""
        return self[lo:hi]


@dataclass
class Fetched:
    """A shard's answer to a delta fetch (``--compress-fetch delta``): its ``token`` (one per shard process: a
    restarted shard or a backup taking over has another, so the replica's next fetch is whole) and either every
    value of its range (``idx`` None) or the values at ``idx`` (int32 positions in the range), those changed since
    the version the replica asked from."""

    token: str
    idx: Any
    values: Any

    @property
    def nbytes(self) -> int:
        return (0 if self.idx is None else self.idx.nbytes) + self.values.nbytes

    def load_into(self, flat: torch.Tensor, lo: int) -> None:
        """Write this answer into ``flat``, whose position ``lo`` is the range's first value: the changed values
        at their positions, or every value of the range."""
        if self.idx is not None:
            flat[lo + torch.from_numpy(self.idx).long()] = torch.from_numpy(self.values)
        else:
            values = torch.as_tensor(self.values)
            flat[lo : lo + len(values)].copy_(values)


def dense_push(grad, offset: int, lo: int, hi: int) -> tuple[Any, int, int | None]:
    """``(grad, offset, wire bytes)`` as a shard holding ``[lo, hi)`` applies a push: an encoded push decoded into its
    dense float32 range (with the payload bytes that arrived), anything else as it came (None: not encoded)."""
    if isinstance(grad, EncodedPush):
        grad = grad.covering(lo, hi)
    if isinstance(grad, EncodedRange):
        return grad.decode(), grad.lo, grad.nbytes
    return grad, offset, None


def sparse_push(grad, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``(positions, values, wire bytes)`` of a push that a shard holding ``[lo, hi)`` may apply value by value (a
    sparse scheme's part, ``Codec.positions``); None for anything else (``dense_push`` then decodes it)."""
    if isinstance(grad, EncodedPush):
        grad = grad.covering(lo, hi)
    if not isinstance(grad, EncodedRange) or (grad.lo, grad.hi) != (lo, hi):
        return None
    found = grad.positions()
    return None if found is None else (*found, grad.nbytes)
