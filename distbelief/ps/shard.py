"""ParameterShard: owns one contiguous slice of the flat parameter vector and the server optimizer's state for it.

Plain Python, no engine: the runtime decides whether a shard lives in this process or in a Ray actor. A shard is
called by one thread at a time (a Ray actor executes calls sequentially; the in-process runtime holds a lock).

Besides Downpour's fetch/push, a shard keeps *named slice-vectors* and executes a small set of vector operations
on them (dot -> partial scalar, axpy, scale, copy, zero). Sandblaster's coordinator drives L-BFGS through these
without ever holding a parameter-sized vector.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

PARAMS = "params"

# Buffers fetched zero-copy from Ray's object store are read-only; we only ever read them, so torch's warning
# about wrapping non-writable memory is noise here.
warnings.filterwarnings("ignore", message="The given (NumPy array|buffer) is not writable")


def _as_tensor(a) -> torch.Tensor:
    """A float32 torch view of ``a`` (numpy arrays fetched zero-copy from Ray are read-only; we never write them)."""
    if isinstance(a, torch.Tensor):
        return a
    arr = np.asarray(a)
    if not arr.flags.writeable:
        # torch.from_numpy warns on read-only arrays; frombuffer on the same memory is zero-copy and silent.
        return torch.frombuffer(memoryview(arr).cast("B"), dtype=torch.float32) if arr.size else torch.empty(0)
    return torch.from_numpy(arr)


class ParameterShard:
    """A slice ``[lo, hi)`` of the flat parameters plus the server optimizer state for it.

    Args:
        shard_id: index of this shard.
        lo, hi: the flat range owned.
        init_values: float32 array of length ``hi - lo`` with the initial parameter values.
        optimizer: a server rule from :mod:`distbelief.ps.optimizers`, or None for a shard used only for vectors.
        total: total number of model parameters (used to validate pushes).
    """

    def __init__(self, shard_id: int, lo: int, hi: int, init_values, optimizer, total: int):
        if hi <= lo:
            raise ValueError(f"shard {shard_id}: empty range [{lo}, {hi})")
        values = np.array(init_values, dtype=np.float32, copy=True).reshape(-1)
        if values.size != hi - lo:
            raise ValueError(f"shard {shard_id}: init_values has {values.size} elements, range needs {hi - lo}")
        self.shard_id, self.lo, self.hi, self.total = shard_id, lo, hi, total
        self.optimizer = optimizer
        self._params_np = values
        self.vectors: dict[str, torch.Tensor] = {PARAMS: torch.from_numpy(values)}
        self.opt_state = optimizer.init_state(hi - lo) if optimizer is not None else {}
        self.version = 0  # updates applied to this shard
        self.examples = 0  # examples represented by the applied pushes
        self.rejected_pushes = 0
        self.staleness_sum = 0
        self.staleness_max = 0
        self.staleness_count = 0

    # ------------------------------------------------------------------ Downpour
    def fetch(self, replica_id: int = -1) -> tuple[np.ndarray, int]:
        """The live parameter slice and its version. Callers in the same process must copy it."""
        return self._params_np, self.version

    def push(self, replica_id: int, grad, offset: int, based_on_version: int, num_examples: int = 0) -> int:
        """Apply an accumulated gradient covering flat ``[offset, offset + len(grad))`` to our intersection.

        ``based_on_version`` is the version of this shard the replica's parameters came from; the difference to
        our current version is the push's staleness. Returns our version after the push. A push with a
        non-finite value or a range outside the model is rejected and counted, never applied.
        """
        g_all = _as_tensor(grad)
        n = g_all.numel()
        if offset < 0 or offset + n > self.total or g_all.dtype != torch.float32:
            self.rejected_pushes += 1
            return self.version
        lo, hi = max(self.lo, offset), min(self.hi, offset + n)
        if hi <= lo:
            return self.version
        g = g_all[lo - offset : hi - offset]
        if not bool(torch.isfinite(g).all()):
            self.rejected_pushes += 1
            return self.version
        a, b = lo - self.lo, hi - self.lo
        w = self.vectors[PARAMS]
        if a == 0 and b == self.hi - self.lo:
            self.optimizer.apply(w, g, self.opt_state)
        else:
            self.optimizer.apply(w[a:b], g, {k: v[a:b] for k, v in self.opt_state.items()})
        staleness = max(0, self.version - int(based_on_version))
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)
        self.staleness_count += 1
        self.version += 1
        self.examples += int(num_examples)
        return self.version

    def apply_mean(self, *grads) -> int:
        """Synchronous data parallelism: average full-vector gradients, apply one update. Returns the version."""
        acc = None
        for grad in grads:
            g = _as_tensor(grad)[self.lo : self.hi]
            if not bool(torch.isfinite(g).all()):
                self.rejected_pushes += 1
                continue
            acc = g.clone() if acc is None else acc.add_(g)
        if acc is None:
            return self.version
        acc.div_(len(grads))
        self.optimizer.apply(self.vectors[PARAMS], acc, self.opt_state)
        self.staleness_count += 1  # a synchronous update is never stale
        self.version += 1
        return self.version

    def set_params(self, values) -> int:
        """Overwrite the parameter slice (used by warmstart from a checkpoint)."""
        self.vectors[PARAMS].copy_(_as_tensor(values).reshape(-1))
        return self.version

    def stats(self) -> dict:
        return {
            "shard_id": self.shard_id,
            "updates": self.version,
            "examples": self.examples,
            "rejected_pushes": self.rejected_pushes,
            "staleness_sum": self.staleness_sum,
            "staleness_max": self.staleness_max,
            "staleness_count": self.staleness_count,
        }

    # ------------------------------------------------------------------ vector operations (Sandblaster)
    def _vec(self, name: str) -> torch.Tensor:
        v = self.vectors.get(name)
        if v is None:
            v = self.vectors[name] = torch.zeros(self.hi - self.lo, dtype=torch.float32)
        return v

    def zero(self, x: str) -> None:
        self._vec(x).zero_()

    def copy(self, src: str, dst: str) -> None:
        self._vec(dst).copy_(self._vec(src))

    def scale(self, x: str, c: float) -> None:
        self._vec(x).mul_(c)

    def axpy(self, alpha: float, x: str, y: str) -> None:
        """``y += alpha * x``."""
        self._vec(y).add_(self._vec(x), alpha=alpha)

    def dot(self, x: str, y: str) -> float:
        """This shard's partial of ``<x, y>`` (the coordinator sums the partials), in float64."""
        return float(torch.dot(self._vec(x).double(), self._vec(y).double()))

    def delete(self, x: str) -> None:
        if x != PARAMS:
            self.vectors.pop(x, None)

    def accumulate(self, x: str, grad, offset: int = 0) -> None:
        """``x += grad`` on our intersection with ``[offset, offset + len(grad))`` (gradient accumulator)."""
        g = _as_tensor(grad)
        lo, hi = max(self.lo, offset), min(self.hi, offset + g.numel())
        if hi > lo:
            self._vec(x)[lo - self.lo : hi - self.lo].add_(g[lo - offset : hi - offset])
