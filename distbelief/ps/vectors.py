"""Sandblaster's vector algebra on a parameter shard: named slice-vectors and the operations on them.

A shard keeps *named slice-vectors* next to its parameters and executes a small set of vector operations on them
(dot -> partial scalar, axpy, scale, copy, zero, lincomb, a fused multi-dot, and ``execute`` to run a short program
of them in one call). Sandblaster's coordinator drives L-BFGS through these without ever holding a
parameter-sized vector. Every vector can be checkpointed at an iteration's start and rolled back to it.
"""

from __future__ import annotations

from typing import Self

import torch

from distbelief.ps.arrays import PARAMS, as_tensor


class VectorAlgebra:
    """The vector half of ParameterShard (mixed in): ``self.vectors`` maps names to slice-length tensors."""

    # ------------------------------------------------------------------ Sandblaster iteration checkpoints
    VECTOR_CKPT_DIR = "sandblaster"

    def checkpoint_vectors(self, root: str, tag: int, keep: int = 3) -> int:
        """Save every named vector (params, x, d, gradients, the (s, y) ring, temporaries) as checkpoint ``tag``
        under ``root/sandblaster`` (atomic, checksummed; the newest ``keep`` are kept). Returns ``tag``."""
        from distbelief.ps.checkpoint import save_checkpoint

        meta = {"shard_id": self.shard_id, "lo": self.lo, "hi": self.hi, "total": self.total, "version": tag}
        save_checkpoint(f"{root}/{self.VECTOR_CKPT_DIR}", self.shard_id, meta,
                        {f"vec.{name}": v for name, v in self.vectors.items()}, keep=keep)
        self.checkpoints_written += 1
        return tag

    @classmethod
    def _vector_checkpoint(cls, root: str, shard_id: int, tag: int):
        from distbelief.ps.checkpoint import load_checkpoint, shard_dir

        path = shard_dir(f"{root}/{cls.VECTOR_CKPT_DIR}", shard_id) / f"ckpt-{int(tag):012d}.safetensors"
        meta, tensors = load_checkpoint(path)  # CorruptCheckpoint if damaged (checksum)
        if meta["shard_id"] != shard_id or meta["version"] != tag:
            raise ValueError(f"shard {shard_id}: {path} belongs to shard {meta['shard_id']}, tag {meta['version']}")
        return meta, {k[4:]: v for k, v in tensors.items() if k.startswith("vec.")}

    def load_vectors(self, root: str, tag: int) -> int:
        """Roll every named vector back to checkpoint ``tag`` (written by ``checkpoint_vectors``); vectors made
        since are dropped. Returns ``tag``."""
        meta, vecs = self._vector_checkpoint(root, self.shard_id, tag)
        if (meta["lo"], meta["hi"]) != (self.lo, self.hi):
            raise ValueError(f"shard {self.shard_id}: checkpoint covers [{meta['lo']}, {meta['hi']}) but this shard "
                             f"owns [{self.lo}, {self.hi})")
        params = self.vectors[PARAMS]
        params.copy_(vecs.pop(PARAMS))  # in place: params shares memory with what fetch() returns
        self.vectors = {PARAMS: params, **{k: v.clone() for k, v in vecs.items()}}
        return tag

    @classmethod
    def from_vectors(cls, root: str, shard_id: int, tag: int) -> Self:
        """A vector-only shard (no server optimizer) rebuilt from Sandblaster iteration checkpoint ``tag``."""
        meta, vecs = cls._vector_checkpoint(root, shard_id, tag)
        shard = cls(shard_id, meta["lo"], meta["hi"], vecs[PARAMS].numpy(), None, meta["total"])
        shard.load_vectors(root, tag)
        shard.restored_from_version = tag
        return shard

    # ------------------------------------------------------------------ vector operations
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
        g = as_tensor(grad)
        lo, hi = max(self.lo, offset), min(self.hi, offset + g.numel())
        if hi > lo:
            self._vec(x)[lo - self.lo : hi - self.lo].add_(g[lo - offset : hi - offset])

    def lincomb(self, dst: str, terms: list[tuple[float, str]]) -> None:
        """``dst = sum(c * v for c, v in terms)``; ``dst`` may appear among the terms.

        One op instead of copy + scale + axpys: a line-search trial point is ``lincomb(params, [(1, x), (t, d)])``.
        """
        out = self._vec(dst)
        # Written in place (never rebinding the tensor): ``params`` shares memory with what fetch() returns.
        acc = torch.zeros_like(out) if any(name == dst for _, name in terms) else out.zero_()
        for c, name in terms:
            acc.add_(self._vec(name), alpha=float(c))
        if acc is not out:
            out.copy_(acc)

    def dots(self, pairs: list[tuple[str, str]]) -> list[float]:
        """This shard's partials of several inner products at once, in float64 (one round trip, not many)."""
        cache: dict[str, torch.Tensor] = {}

        def v64(name: str) -> torch.Tensor:
            if name not in cache:
                cache[name] = self._vec(name).double()
            return cache[name]

        return [float(torch.dot(v64(a), v64(b))) for a, b in pairs]

    def execute(self, program: list[tuple]) -> list:
        """Run a short program of vector ops, e.g. ``[("lincomb", "d", [...]), ("dots", [...])]``, in order, in
        one call; returns each op's result (None for ops without one). Only the vector ops may be named."""
        out = []
        for op, *args in program:
            if op not in VECTOR_OPS:
                raise ValueError(f"shard {self.shard_id}: {op!r} is not a vector op; choose from "
                                 f"{', '.join(sorted(VECTOR_OPS))}")
            out.append(getattr(self, op)(*args))
        return out


VECTOR_OPS = frozenset({"zero", "copy", "scale", "axpy", "dot", "dots", "lincomb", "accumulate", "delete"})
