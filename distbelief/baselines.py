"""Single-process SGD: the paper's single-replica baseline, a plain torch training loop in this process."""

from __future__ import annotations

import math
import time

import torch

from distbelief.data.batches import BatchSource
from distbelief.evaluation import evaluate_job
from distbelief.metrics import Clock, EvalSchedule, RunRecorder
from distbelief.ps.sharding import flatten


def make_torch_optimizer(cfg, params):
    if cfg.server_optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.lr, eps=cfg.adagrad_eps,
                                   initial_accumulator_value=cfg.adagrad_initial_accumulator)
    return torch.optim.SGD(params, lr=cfg.lr)


def run_single_process(job, recorder: RunRecorder) -> tuple[dict, torch.Tensor]:
    """Train with ``torch.optim`` (SGD or Adagrad, as ``server_optimizer``) on all the training data."""
    from distbelief.job import materialize

    cfg = job.cfg
    torch.set_num_threads(job.threads)
    torch.manual_seed(cfg.seed)
    model = job.model_fn()
    ds = materialize(job.train_data)
    batches = BatchSource(ds, range(len(ds)), cfg.batch_size, seed=cfg.seed * 7919)
    opt = make_torch_optimizer(cfg, model.parameters())
    recorder.log(f"single-process {cfg.server_optimizer} with {job.threads} torch thread(s) "
                 f"({sum(p.numel() for p in model.parameters()):,} parameters)")
    clock = Clock()
    next_eval = cfg.eval_every_seconds
    schedule = EvalSchedule(cfg.eval_every_seconds, recorder.log)
    step, examples, loss_ema = 0, 0, math.nan
    best, time_to_target, stop_reason = -1.0, None, "step limit reached"

    def record():
        nonlocal best, time_to_target
        clock.pause()  # evaluation is not training time
        wall = clock.elapsed()
        acc, test_loss, train_acc = evaluate_job(model, job)
        recorder.record({
            "wall_s": round(wall, 3), "updates": step, "updates_per_shard": [step], "examples": examples,
            "examples_per_s": examples / wall if wall > 0 else 0.0,
            "train_loss": None if math.isnan(loss_ema) else loss_ema,
            "test_accuracy": acc, "train_accuracy": train_acc, "test_loss": test_loss,
            "staleness_mean": 0.0, "staleness_max": 0,
        })
        best = max(best, acc)
        if cfg.target_accuracy and acc >= cfg.target_accuracy and time_to_target is None:
            time_to_target = wall
        clock.resume()
        return acc

    while not (cfg.max_steps and step >= cfg.max_steps):
        x, y = batches.next_batch()
        opt.zero_grad(set_to_none=False)
        loss = job.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        step += 1
        examples += len(y)
        lv = loss.item()
        loss_ema = lv if math.isnan(loss_ema) else 0.9 * loss_ema + 0.1 * lv
        if clock.elapsed() >= next_eval:
            t0 = time.monotonic()
            record()
            next_eval = clock.elapsed() + schedule.interval(time.monotonic() - t0)
        if time_to_target is not None:
            stop_reason = "target accuracy reached"
            break
        if cfg.max_seconds and clock.elapsed() >= cfg.max_seconds:
            stop_reason = "time budget spent"
            break
    wall = clock.elapsed()
    final_acc = record()
    summary = {
        "strategy": "sgd", "runtime": "single-process", "replicas": 1, "shards": 1,
        "server_optimizer": cfg.server_optimizer, "threads": job.threads,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "final_test_accuracy": final_acc, "best_test_accuracy": max(best, final_acc),
        "target_accuracy": cfg.target_accuracy or None, "time_to_target_s": time_to_target,
        "examples": examples, "examples_per_s": examples / wall if wall > 0 else 0.0,
        "updates": step, "updates_per_shard": [step], "steps_per_replica": [step],
        "staleness_mean": 0.0, "staleness_max": 0, "rejected_pushes": 0,
        "replica_restarts": 0, "replicas_lost": 0, "stop_reason": stop_reason, "wall_s": wall,
    }
    return summary, flatten(model)
