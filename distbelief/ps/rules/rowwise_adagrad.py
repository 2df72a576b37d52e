"""Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD, TorchRec's default for embedding tables): one accumulator
per table row instead of one per float, so a table's optimizer state is ``num_rows`` floats, not
``num_rows * dim``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from distbelief.ps.rules.adagrad import Adagrad


@dataclass(frozen=True)
class RowwiseAdagrad(Adagrad):
    """Adagrad with one accumulator per embedding row: for each pushed row r,
    ``row_sum_sq[r] += mean(g_r^2)``; ``w_r -= lr * g_r / (sqrt(row_sum_sq[r]) + eps)``.

    On dense slices (the parameters of a model that are not in a table) it is exactly :class:`Adagrad`, per
    element: ``init_state`` and ``apply`` are Adagrad's. It has no ``torch.optim`` counterpart, so strategies
    that train with ``torch.optim`` (sgd, hogwild, ddp) refuse it.
    """

    summary: ClassVar[str] = ("adagrad with one accumulator per embedding-table row, adagrad on the other "
                              "parameters; no torch.optim counterpart, so not for sgd, hogwild or ddp")
    torch_optimizer: ClassVar[None] = None

    def init_row_state(self, num_rows: int, dim: int) -> dict[str, torch.Tensor]:
        return {"row_sum_sq": torch.full((num_rows,), float(self.initial_accumulator), dtype=torch.float32)}

    def apply_rows(self, weight: torch.Tensor, rows: torch.Tensor, g: torch.Tensor,
                   state: dict[str, torch.Tensor], scale: float = 1.0) -> None:
        row_sum_sq = state["row_sum_sq"]  # (num_rows,)
        row_sum_sq.index_add_(0, rows, g.pow(2).mean(dim=1))
        # FBGEMM's order: multiplier = lr / (sqrt(G) + eps), then w -= multiplier * g.
        multiplier = (self.lr * scale) / row_sum_sq.index_select(0, rows).sqrt_().add_(self.eps)  # (len(rows),)
        weight.index_add_(0, rows, g * multiplier[:, None], alpha=-1.0)
