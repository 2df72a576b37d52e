"""The paper's Adagrad on the shard: a rate per parameter, ``lr / (sqrt(sum g^2) + eps)``.

Dense slices take torch's fused in-place kernel (multi-threaded, no temporaries beyond one reusable buffer): a
42M-float step costs tens of milliseconds instead of hundreds in plain numpy. Table rows follow
``torch.optim.Adagrad`` on a sparse gradient ("lazy" Adagrad: rows not pushed keep their weights and sums).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

_HAS_FUSED = hasattr(torch, "_fused_adagrad_")
_ONE = torch.tensor(1.0)  # the kernel's step counter; only read through lr_decay, which is 0


@dataclass(frozen=True)
class Adagrad:
    """The paper's Adagrad: ``eta_i = lr / (sqrt(sum_j g_ij^2) + eps)``, per parameter, on the shard.

    ``eps`` (not in the paper) keeps the first step finite; ``initial_accumulator`` seeds the sum. With the
    defaults this is exactly ``torch.optim.Adagrad(lr=lr, eps=eps, initial_accumulator_value=...)``, dense or
    (``apply_rows``) on a sparse embedding gradient.
    """

    summary: ClassVar[str] = "the paper's, a rate per parameter"
    scratch: ClassVar[tuple[str, ...]] = ("tmp",)  # the unfused path's sqrt buffer
    zero_gradient_keeps: ClassVar[bool] = True  # g = 0: the sum and the value stay bit for bit (delta fetches)
    elementwise: ClassVar[bool] = True  # a value's step reads its own gradient and state alone (sparse pushes)

    lr: float
    eps: float = 1e-10
    initial_accumulator: float = 0.0
    staleness_aware: bool = False

    def rate_scale(self, staleness: int) -> float:
        return 1.0 / staleness if self.staleness_aware and staleness > 1 else 1.0

    def init_state(self, n: int) -> dict[str, torch.Tensor]:
        state = {"sum_sq": torch.full((n,), float(self.initial_accumulator), dtype=torch.float32)}
        if not _HAS_FUSED:
            state["tmp"] = torch.empty(n, dtype=torch.float32)
        return state

    def apply(self, w: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], scale: float = 1.0) -> None:
        sum_sq = state["sum_sq"]
        lr = self.lr * scale
        if _HAS_FUSED and w.is_contiguous() and g.is_contiguous():
            # torch's fused CPU kernel: one multi-threaded pass (~36 ms for 42M floats vs ~130 ms unfused).
            # lr_decay = 0, so the step count it keeps does not change the rate.
            torch._fused_adagrad_([w], [g], [sum_sq], [_ONE], lr=lr, lr_decay=0.0, weight_decay=0.0,
                                  eps=self.eps, maximize=False)
            return
        tmp = state.get("tmp")
        tmp = torch.empty_like(sum_sq) if tmp is None or tmp.numel() != sum_sq.numel() else tmp
        sum_sq.addcmul_(g, g)
        torch.sqrt(sum_sq, out=tmp)
        tmp.add_(self.eps)
        w.addcdiv_(g, tmp, value=-lr)

    def init_row_state(self, num_rows: int, dim: int) -> dict[str, torch.Tensor]:
        return {"sum_sq": torch.full((num_rows, dim), float(self.initial_accumulator), dtype=torch.float32)}

    def apply_rows(self, weight: torch.Tensor, rows: torch.Tensor, g: torch.Tensor,
                   state: dict[str, torch.Tensor], scale: float = 1.0) -> None:
        # torch.optim.Adagrad's sparse branch, op for op (so the result is the same bit for bit):
        #   state_sum.add_(g^2 at rows); std = sqrt(state_sum[rows]) + eps; param.add_(g / std at rows, -lr)
        sum_sq = state["sum_sq"]  # (num_rows, dim)
        sum_sq.index_add_(0, rows, g.pow(2))
        std = sum_sq.index_select(0, rows).sqrt_().add_(self.eps)  # (len(rows), dim)
        weight.index_add_(0, rows, g / std, alpha=-self.lr * scale)

    def torch_optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(params, lr=self.lr, eps=self.eps,
                                   initial_accumulator_value=self.initial_accumulator)
