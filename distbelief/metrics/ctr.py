"""Click-through-rate objective and metric: the loss (binary cross-entropy on one logit per example), the exact
AUC, and ``AUCMetric``, the run metric of the ``ctr`` task (its progress lines say "AUC"; it adds the AUC fields
to the run summary)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


def auc(scores, labels) -> float:
    """The exact area under the ROC curve of ``scores`` for binary ``labels`` (torch tensors or numpy arrays of
    one value per example; labels 0/1 or bool): the probability that a random positive scores above a random
    negative, ties counting one half. Rank-based (Mann-Whitney U with average ranks for ties), O(n log n).

    Raises ValueError when the labels are not all 0/1, or hold only one class (the AUC is undefined)."""
    s = torch.as_tensor(np.asarray(scores) if not torch.is_tensor(scores) else scores).detach()
    y = torch.as_tensor(np.asarray(labels) if not torch.is_tensor(labels) else labels).detach()
    s, y = s.reshape(-1).double().cpu(), y.reshape(-1).cpu()
    if s.numel() != y.numel():
        raise ValueError(f"auc: {s.numel()} scores for {y.numel()} labels")
    if not bool(((y == 0) | (y == 1)).all()):
        raise ValueError("auc: labels must be 0 or 1")
    pos = y == 1
    n_pos = int(pos.sum())
    n_neg = y.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"auc: undefined with {n_pos} positive and {n_neg} negative examples")
    if torch.isnan(s).any():
        return float("nan")  # a diverged model: no ranking (the run's divergence watch reports it)
    order = torch.argsort(s)
    _, inverse, counts = torch.unique_consecutive(s[order], return_inverse=True, return_counts=True)
    last = torch.cumsum(counts, 0).double()  # 1-based rank of each tie group's last member
    mean_rank = last - (counts.double() - 1) / 2  # tied scores share their average rank
    rank_sum = mean_rank[inverse][pos[order]].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def bce_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy (log-loss) of logits ``outputs`` [B] against 0/1 ``targets`` [B]."""
    return F.binary_cross_entropy_with_logits(outputs, targets.to(outputs.dtype))


class AUCMetric:
    """``metric_fn`` of a click-through-rate run: the test AUC of the logits. It names itself "AUC" in the
    progress lines and adds to the run summary ``best_test_auc``, ``final_test_auc``, ``test_logloss`` (of the
    final parameters on the test set) and ``planted_auc`` (the best AUC any model can reach on this data, when
    known). Picklable: it travels to the workers with the job."""

    name = "AUC"

    def __init__(self, planted_auc: float | None = None):
        self.planted_auc = planted_auc

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> float:
        return auc(outputs, targets)

    def summary_fields(self, summary: dict[str, Any], model: torch.nn.Module, test_data) -> dict[str, Any]:
        """The summary's AUC fields for a finished run (``model`` holds its final parameters)."""
        from distbelief.evaluation import evaluate

        _, logloss = evaluate(model, test_data, bce_loss, metric_fn=self)
        return {"best_test_auc": summary["best_test_accuracy"], "final_test_auc": summary["final_test_accuracy"],
                "test_logloss": logloss, "planted_auc": self.planted_auc}
