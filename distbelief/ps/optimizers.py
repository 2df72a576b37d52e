"""Server-side update rules, applied by a ParameterShard to its own slice, in place.

Both rules are fused in-place torch kernels (multi-threaded, no temporaries beyond one reusable buffer): a
42M-float Adagrad step costs tens of milliseconds instead of hundreds in plain numpy.

``staleness_aware`` (beyond the paper; Zhang, Gupta, Lian and Liu, "Staleness-aware Async-SGD", IJCAI 2016):
a push computed from parameters ``tau`` updates old is applied with the rate divided by ``tau`` (by 1 when
``tau`` <= 1), so stale gradients move the parameters less. Adagrad's accumulator still adds the full ``g^2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_HAS_FUSED = hasattr(torch, "_fused_adagrad_")
_ONE = torch.tensor(1.0)  # the kernel's step counter; only read through lr_decay, which is 0


@dataclass(frozen=True)
class SGD:
    """Fixed-rate SGD: ``w -= lr * g``."""

    lr: float
    staleness_aware: bool = False

    def init_state(self, n: int) -> dict[str, torch.Tensor]:
        return {}

    def rate_scale(self, staleness: int) -> float:
        return 1.0 / staleness if self.staleness_aware and staleness > 1 else 1.0

    def apply(self, w: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], scale: float = 1.0) -> None:
        w.add_(g, alpha=-self.lr * scale)


@dataclass(frozen=True)
class Adagrad:
    """The paper's Adagrad: ``eta_i = lr / (sqrt(sum_j g_ij^2) + eps)``, per parameter, on the shard.

    ``eps`` (not in the paper) keeps the first step finite; ``initial_accumulator`` seeds the sum. With the
    defaults this is exactly ``torch.optim.Adagrad(lr=lr, eps=eps, initial_accumulator_value=...)``.
    """

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


def make_server_optimizer(name: str, lr: float, eps: float = 1e-10, initial_accumulator: float = 0.0,
                          staleness_aware: bool = False):
    if name == "sgd":
        return SGD(lr=lr, staleness_aware=staleness_aware)
    if name == "adagrad":
        return Adagrad(lr=lr, eps=eps, initial_accumulator=initial_accumulator, staleness_aware=staleness_aware)
    raise ValueError(f"unknown server optimizer {name!r}; choose 'sgd' or 'adagrad'")
