"""``qsgd``: QSGD (Alistarh et al., 2017). The range is cut into buckets of ``BUCKET`` values; each bucket sends its
2-norm (float32) and each value a sign and a level in ``0..s`` (``s = 2**(bits-1) - 1``), packed ``bits`` to a value:
``ceil(n * bits / 8) + 4 * buckets`` bytes. The level is ``|a| / norm * s`` rounded down or up at random with the
probability that makes the decoded value unbiased: ``E[decode] = a``.

One exception keeps the replica's residual exact (feedback.py): a value under ``2**-27 / s`` of its bucket's norm
is sent as 0 and left whole to the residual (rounding it up would send a value 2**27 times its size, whose
difference to it float64 cannot hold exactly). Its bias is below that bound, far under the noise of the rounding.
"""

from __future__ import annotations

import math

import torch

from distbelief.compression.base import Codec, from_wire, to_wire

BUCKET = 512
_TINY = 2.0 ** -27


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    pad = (-codes.numel()) % per
    c = torch.cat([codes, codes.new_zeros(pad)]).view(-1, per)
    packed = torch.zeros(c.shape[0], dtype=torch.uint8)
    for j in range(per):
        packed |= c[:, j] << (bits * j)
    return packed


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per, mask = 8 // bits, (1 << bits) - 1
    cols = [(packed >> (bits * j)) & mask for j in range(per)]
    return torch.stack(cols, dim=1).flatten()[:n]


class QSGD(Codec):
    name = "qsgd"

    def __init__(self, ranges, bits: int = 4, seed: int = 0):
        super().__init__(ranges)
        if bits not in (2, 4, 8):
            raise ValueError(f"bits must be 2, 4 or 8, got {bits!r}")
        self.bits, self.levels = bits, 2 ** (bits - 1) - 1
        self.gen = torch.Generator().manual_seed(seed)

    def encode(self, a: torch.Tensor) -> list[tuple]:
        return [self._encode_range(a[lo:hi]) for lo, hi in self.ranges]

    def _encode_range(self, x: torch.Tensor) -> tuple:
        n, s = x.numel(), self.levels
        pad = (-n) % BUCKET
        xb = torch.cat([x, x.new_zeros(pad)]).view(-1, BUCKET)
        norms = torch.linalg.vector_norm(xb, dim=1)
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        scaled = xb.abs() / safe[:, None] * s
        low = scaled.floor()
        up = torch.rand(scaled.shape, generator=self.gen) < (scaled - low)
        level = (low + up.to(low.dtype)).clamp_(max=s)
        level[xb.abs() < safe[:, None] * (_TINY / s)] = 0  # left whole to the residual (module docstring)
        signed = torch.where(xb < 0, -level, level)
        codes = (signed.flatten()[:n] + s).to(torch.uint8)
        return n, self.bits, to_wire(norms), to_wire(_pack(codes, self.bits))

    @staticmethod
    def decode(part, lo: int, hi: int) -> torch.Tensor:
        n, bits, norms, packed = part
        s = 2 ** (bits - 1) - 1
        signed = _unpack(from_wire(packed), bits, n).to(torch.float32) - s
        scale = from_wire(norms).repeat_interleave(BUCKET)[:n]
        return scale * (signed / s)

    def formula_bytes(self, k: int) -> int:
        lo, hi = self.ranges[k]
        n = hi - lo
        return math.ceil(n * self.bits / 8) + 4 * math.ceil(n / BUCKET) + 8  # + the two ints (n, bits)

    def describe(self) -> str:
        return f"qsgd ({self.bits} bits)"
