"""``fp16``: every value as a float16 (2 bytes instead of 4). Values beyond float16's range are clamped to it; what
rounding and clamping leave out stays in the replica's residual (feedback.py)."""

from __future__ import annotations

import torch

from distbelief.compression.base import Codec, from_wire, to_wire

FP16_MAX = float(torch.finfo(torch.float16).max)


class FP16(Codec):
    name = "fp16"

    def encode(self, a: torch.Tensor) -> list:
        return [to_wire(a[lo:hi].clamp(-FP16_MAX, FP16_MAX).to(torch.float16)) for lo, hi in self.ranges]

    @staticmethod
    def decode(part, lo: int, hi: int) -> torch.Tensor:
        return from_wire(part).to(torch.float32)

    def formula_bytes(self, k: int) -> int:
        lo, hi = self.ranges[k]
        return 2 * (hi - lo)
