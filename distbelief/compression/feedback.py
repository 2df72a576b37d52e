"""Error feedback: what a compression leaves out of one push is added to the next (Seide et al., 2014; Karimireddy
et al., 2019), so a compressed run loses nothing, it only delays.

Per push: ``a = g + residual`` (formed in float32, as torch's own error feedback does), the codec's parts of ``a``
go to the shards, ``sent`` is those parts decoded by the shards' own code, and the new residual is ``a - sent``.
The residual is kept in float64, where that difference of two float32 vectors is exact (it is whenever the two
values are within 2**28 of each other or one is 0; qsgd.py sends no value that could break it), or in float32 for
a scheme whose difference is exact there (top-k: a value is sent whole or not at all), so ``sent + residual ==
a`` holds bit for bit: the tests check it for every scheme.

The residual lives with the replica. A replica that is restarted starts with none: what its predecessor's
residual held is dropped, and counted (``residuals_dropped`` in the summary).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from distbelief.compression.base import Codec, wire_bytes


class ErrorFeedback:
    def __init__(self, codec: Codec, size: int):
        self.codec = codec
        self.dtype = torch.float32 if codec.exact_in_float32 else torch.float64
        self.residual = torch.zeros(size, dtype=self.dtype)
        self.bytes_sent = 0  # payload bytes of every part so far
        self.seconds = 0.0  # spent compressing
        self.last_parts: list[Any] | None = None

    def compress(self, g: torch.Tensor) -> list[Any]:
        """The parts to push for gradient ``g`` (flat float32), one per shard; the residual moves on."""
        t0 = time.perf_counter()
        if self.dtype == torch.float32:
            a = self.residual.add_(g)  # the residual's own buffer (no new vector); codec.residual takes it over
            out = None
        else:  # the sum in float64 in the residual's buffer (the bits of g.to(float64) + residual), then rounded
            a = self.residual.add_(g).to(torch.float32)
            out = self.residual  # the new residual is written over it: no new float64 vector a push
        parts = self.codec.encode(a)
        self.residual = self.codec.residual(a, parts, self.dtype, out)
        self.bytes_sent += sum(wire_bytes(p) for p in parts)
        self.last_parts = parts
        self.seconds += time.perf_counter() - t0
        return parts

    @property
    def last_sent(self) -> torch.Tensor | None:
        """What the last push's parts decode to, as the shards apply it."""
        return None if self.last_parts is None else self.codec.sent(self.last_parts)
