"""Array helpers shared by the parameter server's modules."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

PARAMS = "params"  # the name of the parameter slice among a shard's vectors

# Buffers fetched zero-copy from Ray's object store are read-only; we only ever read them, so torch's warning
# about wrapping non-writable memory is noise here.
warnings.filterwarnings("ignore", message="The given (NumPy array|buffer) is not writable")

def all_finite(g: torch.Tensor) -> bool:
    """True iff no element is NaN or +-Inf.

    A NaN or Inf element makes the sum non-finite, so a finite float32 sum proves every element finite: one
    vectorised pass (0.15 ms for 2.3M floats here, vs 2.3 ms for a float64 sum and ~15 ms for
    ``isfinite(g).all()``). Only a non-finite sum — a bad push, or finite values so large that their float32 sum
    overflows — pays for the exact element-wise check."""
    if bool(torch.isfinite(g.sum())):
        return True
    return bool(torch.isfinite(g).all())


def as_tensor(a) -> torch.Tensor:
    """A float32 torch view of ``a`` (numpy arrays fetched zero-copy from Ray are read-only; we never write them)."""
    if isinstance(a, torch.Tensor):
        return a
    arr = np.asarray(a)
    if not arr.flags.writeable:
        # torch.from_numpy warns on read-only arrays; frombuffer on the same memory is zero-copy and silent.
        return torch.frombuffer(memoryview(arr).cast("B"), dtype=torch.float32) if arr.size else torch.empty(0)
    return torch.from_numpy(arr)


@dataclass
class Placed:
    """A gradient's range as it travels to the shard that applies it: ``values`` at flat offset ``lo`` of a vector
    that is zero elsewhere (``ParameterShard.apply_mean`` reads its own range of it). No full-length vector is
    built: for a Fig. 4 shard that allocation and copy took a third of the shard's time in a sync step."""

    values: np.ndarray
    lo: int

    def range_of(self, lo: int, hi: int) -> np.ndarray | None:
        """The values of flat ``[lo, hi)``, or None when this range does not cover it."""
        a, b = lo - self.lo, hi - self.lo
        return self.values[a:b] if 0 <= a <= b <= self.values.size else None
