"""``powersgd``: PowerSGD (Vogels et al., 2019), with the arithmetic of torch's ``powerSGD_hook`` for one worker.

Each parameter tensor is viewed as a matrix ``M`` (``shape[0]`` rows, the rest flattened into columns). Where a
rank-r product is worth it (``(rows + cols) * r * min_compression_rate < rows * cols``, torch's test) the replica
does one warm-started power-iteration step, as the hook does:

    Q <- orthogonalize(Q_prev)   (seeded random on the first push)
    P <- orthogonalize(M Q)
    Q <- Mᵀ P

and sends ``P`` and ``Q``; the shard applies ``P Qᵀ``. Other tensors (biases, small matrices) go as they are.
With one worker the hook's all-reduces are identities, so its result on one matrix is this one, bit for bit (the
tests check it against torch's hook itself).

A shard whose range covers only some rows of a matrix gets those rows of ``P`` and all of ``Q``: part k weighs
``4 * r * (rows in range + cols)`` bytes per compressed matrix it touches, plus 4 bytes per other value in range.
"""

from __future__ import annotations

import numpy as np
import torch

from distbelief.compression.base import Codec, from_wire, to_wire


def orthogonalize(m: torch.Tensor) -> None:
    """Orthonormalize the columns of each matrix of the batch ``m`` (batch, rows, r) in place, as torch's
    ``powerSGD_hook`` does: Gram-Schmidt for r <= 2, a QR factorization otherwise."""
    rank = m.shape[2]
    if rank <= 2:
        for i in range(rank):
            col = m[:, :, i:i + 1]
            col /= torch.norm(col, dim=1, keepdim=True)
            if i + 1 < rank:
                rest = m[:, :, i + 1:]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        torch.linalg.qr(m, out=(m, torch.empty(m.shape[0], rank, rank, dtype=m.dtype)))


class _Tensor:
    """One parameter tensor of the flat vector: where it lies, and its matrix view if it is compressed."""

    def __init__(self, offset: int, shape: tuple, rank: int, min_rate: float):
        self.offset, self.numel = offset, int(np.prod(shape)) if shape else 1
        self.rows = shape[0] if len(shape) >= 1 else 1
        self.cols = self.numel // self.rows if self.rows else 0
        self.rank = min(self.rows, self.cols, rank)
        self.compressed = len(shape) >= 2 and (self.rows + self.cols) * self.rank * min_rate < self.numel


class PowerSGD(Codec):
    name = "powersgd"

    def __init__(self, ranges, tensors: list[tuple[int, tuple]], rank: int = 4, seed: int = 0,
                 min_compression_rate: float = 2.0):
        super().__init__(ranges)
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank!r}")
        self.rank = rank
        self.tensors = [_Tensor(off, tuple(shape), rank, min_compression_rate) for off, shape in tensors]
        self.rng = np.random.RandomState(seed)  # as the hook's state: a fresh torch seed for the first Qs
        self.q: dict[int, torch.Tensor] = {}  # warm start: each compressed matrix's last Q, (1, cols, r)

    def factors(self, a: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """``{tensor index: (P, Q)}`` of every compressed matrix of ``a`` (this push's power step)."""
        out = {}
        fresh = [i for i, t in enumerate(self.tensors) if t.compressed and i not in self.q]
        if fresh:  # the hook draws one seed per bucket: here, the model's first push is one bucket
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.rng.randint(1_000_000_000))
                for i in fresh:
                    t = self.tensors[i]
                    self.q[i] = torch.randn(1, t.cols, t.rank, dtype=torch.float32)
        for i, t in enumerate(self.tensors):
            if not t.compressed:
                continue
            m = a[t.offset:t.offset + t.numel].view(1, t.rows, t.cols)
            q = self.q[i]
            orthogonalize(q)
            p = torch.bmm(m, q)
            orthogonalize(p)
            q = torch.bmm(m.transpose(1, 2), p)
            self.q[i] = q
            out[i] = (p, q)
        return out

    def encode(self, a: torch.Tensor) -> list[list]:
        pq = self.factors(a)
        parts = []
        for lo, hi in self.ranges:
            pieces = []
            for i, t in enumerate(self.tensors):
                s, e = max(lo, t.offset), min(hi, t.offset + t.numel)
                if s >= e:
                    continue
                if t.compressed:
                    r0, r1 = (s - t.offset) // t.cols, (e - t.offset - 1) // t.cols + 1
                    p, q = pq[i]
                    pieces.append((s - lo, s - t.offset - r0 * t.cols, e - s, to_wire(p[0, r0:r1].clone()),
                                   to_wire(q[0].clone())))
                else:
                    pieces.append((s - lo, to_wire(a[s:e].clone())))
            parts.append(pieces)
        return parts

    @staticmethod
    def decode(part, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo, dtype=torch.float32)
        for piece in part:
            if len(piece) == 2:
                at, values = piece[0], from_wire(piece[1])
                out[at:at + values.numel()] = values
            else:
                at, skip, n = piece[:3]
                p_rows, q = from_wire(piece[3]), from_wire(piece[4])
                if skip == 0 and n == p_rows.shape[0] * q.shape[0]:  # whole rows: P Qᵀ written in place
                    torch.bmm(p_rows[None], q.t()[None], out=out[at:at + n].view(1, p_rows.shape[0], q.shape[0]))
                    continue
                block = torch.bmm(p_rows[None], q.t()[None])[0].flatten()
                out[at:at + n] = block[skip:skip + n]
        return out

    def formula_bytes(self, k: int) -> int:
        lo, hi = self.ranges[k]
        total = 0
        for t in self.tensors:
            s, e = max(lo, t.offset), min(hi, t.offset + t.numel)
            if s >= e:
                continue
            if t.compressed:
                rows = (e - t.offset - 1) // t.cols + 1 - (s - t.offset) // t.cols
                total += 4 * t.rank * (rows + t.cols) + 12  # + three ints (where, skip, count)
            else:
                total += 4 * (e - s) + 4  # + one int (where)
        return total

    def describe(self) -> str:
        return f"powersgd (rank {self.rank})"


def tensor_layout(model: torch.nn.Module) -> list[tuple[int, tuple]]:
    """``[(flat offset, shape)]`` of ``model``'s parameters, in the flat vector's order."""
    out, at = [], 0
    for p in model.parameters():
        out.append((at, tuple(p.shape)))
        at += p.numel()
    return out


__all__ = ["PowerSGD", "orthogonalize", "tensor_layout"]
