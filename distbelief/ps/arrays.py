"""Array helpers shared by the parameter server's modules."""

from __future__ import annotations

import warnings

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
