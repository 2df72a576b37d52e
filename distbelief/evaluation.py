"""Evaluation of a parameter vector on held-out data."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distbelief.data.batches import iterate_batches


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """The default metric: the fraction of examples whose highest output is their label."""
    return int((outputs.argmax(dim=1) == targets).sum()) / len(targets) if len(targets) else 0.0


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, loss_fn=None, batch_size: int = 1024,
             metric_fn=None) -> tuple[float, float]:
    """Return ``(metric, mean loss)`` of ``model`` on ``dataset``, in eval mode. ``metric_fn(outputs, targets)``
    sees the whole set's outputs at once (so a metric that does not average over examples, e.g. AUC, works);
    the default is classification accuracy. A stream (an IterableDataset) is read to its end."""
    loss_fn = loss_fn or F.cross_entropy
    was_training = model.training
    model.eval()
    outputs, targets, total, loss_sum = [], [], 0, 0.0
    for x, y in iterate_batches(dataset, batch_size):
        out = model(x)
        loss_sum += float(loss_fn(out, y)) * len(y)
        outputs.append(out)
        targets.append(y)
        total += len(y)
    model.train(was_training)
    if not total:
        return 0.0, 0.0
    return float((metric_fn or accuracy)(torch.cat(outputs), torch.cat(targets))), loss_sum / total


def evaluate_job(model: torch.nn.Module, job) -> tuple[float, float, float | None]:
    """``(test metric, test loss, training metric)`` of ``model`` for a run (the metric is the job's
    ``metric_fn``, accuracy by default); the training metric is measured on the job's fixed training probe
    (``train_eval_samples``) and is None without one."""
    acc, loss = evaluate(model, job.test_data, job.loss_fn, metric_fn=job.metric_fn)
    probe = job.train_probe
    train_acc = evaluate(model, probe, job.loss_fn, metric_fn=job.metric_fn)[0] if probe is not None else None
    return acc, loss, train_acc
