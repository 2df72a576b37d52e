"""Fixed-rate SGD on the shard: ``w -= lr * g``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class SGD:
    """Fixed-rate SGD: ``w -= lr * g``; on a table, only the pushed rows move. No state."""

    summary: ClassVar[str] = "fixed rate"
    scratch: ClassVar[tuple[str, ...]] = ()
    zero_gradient_keeps: ClassVar[bool] = True  # a value with gradient 0 stays bit for bit (delta fetches)
    elementwise: ClassVar[bool] = True  # a value's step reads its own gradient and state alone (sparse pushes)

    lr: float
    staleness_aware: bool = False

    def init_state(self, n: int) -> dict[str, torch.Tensor]:
        return {}

    def init_row_state(self, num_rows: int, dim: int) -> dict[str, torch.Tensor]:
        return {}

    def rate_scale(self, staleness: int) -> float:
        return 1.0 / staleness if self.staleness_aware and staleness > 1 else 1.0

    def apply(self, w: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], scale: float = 1.0) -> None:
        w.add_(g, alpha=-self.lr * scale)

    def apply_rows(self, weight: torch.Tensor, rows: torch.Tensor, g: torch.Tensor,
                   state: dict[str, torch.Tensor], scale: float = 1.0) -> None:
        weight.index_add_(0, rows, g, alpha=-self.lr * scale)  # weight: (num_rows, dim), g: (len(rows), dim)

    def torch_optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr)
