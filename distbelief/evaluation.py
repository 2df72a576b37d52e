"""Evaluation of a parameter vector on held-out data."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distbelief.data.batches import iterate_batches


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, loss_fn=None, batch_size: int = 1024) -> tuple[float, float]:
    """Return ``(accuracy, mean loss)`` of ``model`` on ``dataset`` (classification: argmax vs label)."""
    loss_fn = loss_fn or F.cross_entropy
    was_training = model.training
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for x, y in iterate_batches(dataset, batch_size):
        out = model(x)
        loss_sum += float(loss_fn(out, y)) * len(y)
        correct += int((out.argmax(dim=1) == y).sum())
        total += len(y)
    model.train(was_training)
    return correct / max(1, total), loss_sum / max(1, total)


def evaluate_job(model: torch.nn.Module, job) -> tuple[float, float, float | None]:
    """``(test accuracy, test loss, training accuracy)`` of ``model`` for a run; the training accuracy is measured
    on the job's fixed training probe (``train_eval_samples``) and is None without one."""
    acc, loss = evaluate(model, job.test_data, job.loss_fn)
    probe = getattr(job, "train_probe", None)
    train_acc = evaluate(model, probe, job.loss_fn)[0] if probe is not None else None
    return acc, loss, train_acc
