"""The paper's single-replica baseline with model parallelism: one replica split into P partitions, each
partition applying the update rule (SGD or Adagrad, as ``server_optimizer``) to its own parameters — no parameter
server. ``distbelief train --strategy sgd --partitions P``.
"""

from __future__ import annotations

import math

import torch

from distbelief.downpour.replica import ReplicaSettings
from distbelief.evaluation import evaluate_job
from distbelief.metrics import Clock, RunRecorder
from distbelief.partition.replica import PartitionRecipe
from distbelief.partition.stats import messaging_metrics
from distbelief.ps.optimizers import make_server_optimizer
from distbelief.ps.sharding import unflatten_into


def run_partitioned_sgd(job, runtime, recorder: RunRecorder) -> tuple[dict, torch.Tensor]:
    """Train one partitioned replica with local updates; evaluate between chunks of ``eval_every_seconds``."""
    cfg = job.cfg
    rule = make_server_optimizer(cfg.server_optimizer, cfg.lr, cfg.adagrad_eps, cfg.adagrad_initial_accumulator)
    settings = ReplicaSettings(remote_timeout_s=cfg.remote_timeout_s)
    recipe = PartitionRecipe(0, 1, job.model_fn, job.train_data, cfg.batch_size, cfg.seed, settings, job.loss_fn,
                             local_optimizer=rule)
    torch.manual_seed(cfg.seed)
    eval_model = job.model_fn()
    role = runtime.create_partition_group(0, recipe, None, None, job.threads, cfg.partitions)
    recorder.log(f"single replica in {cfg.partitions} partitions, local {cfg.server_optimizer} "
                 f"({sum(p.numel() for p in eval_model.parameters()):,} parameters)")
    clock = Clock()
    steps, best, time_to_target, stop_reason, stats = 0, -1.0, None, "step limit reached", {}
    wait_s = cfg.remote_timeout_s + (cfg.eval_every_seconds or 0)

    def record() -> float:
        nonlocal best, time_to_target
        clock.pause()  # evaluation is not training time
        wall = clock.elapsed()
        flat = torch.empty(sum(p.numel() for p in eval_model.parameters()))
        for lo, values in runtime.call(role, "params").result(cfg.remote_timeout_s):
            flat[lo: lo + len(values)].copy_(torch.as_tensor(values))
        unflatten_into(eval_model, flat)
        acc, test_loss, train_acc = evaluate_job(eval_model, job)
        loss = stats.get("loss_ema")
        examples = stats.get("examples", 0)
        recorder.record({
            "wall_s": round(wall, 3), "updates": steps, "updates_per_shard": [steps], "examples": examples,
            "examples_per_s": examples / wall if wall > 0 else 0.0,
            "train_loss": None if loss is None or math.isnan(loss) else loss,
            "test_accuracy": acc, "train_accuracy": train_acc, "test_loss": test_loss,
            "staleness_mean": 0.0, "staleness_max": 0,
            **messaging_metrics([stats] if stats else []),
        })
        best = max(best, acc)
        if cfg.target_accuracy and acc >= cfg.target_accuracy and time_to_target is None:
            time_to_target = wall
        clock.resume()
        return acc

    try:
        while True:
            left_steps = (cfg.max_steps - steps) if cfg.max_steps else None
            left_s = (cfg.max_seconds - clock.elapsed()) if cfg.max_seconds else math.inf
            chunk = min(cfg.eval_every_seconds, max(0.0, left_s))
            stats = runtime.call(role, "run", left_steps, chunk).result(wait_s + chunk)
            steps = stats["steps"]
            record()
            if time_to_target is not None:
                stop_reason = "target accuracy reached"
                break
            if cfg.max_steps and steps >= cfg.max_steps:
                break
            if cfg.max_seconds and clock.elapsed() >= cfg.max_seconds:
                stop_reason = "time budget spent"
                break
        wall = clock.elapsed()
        final_acc = record()
    finally:
        runtime.kill(role)
    flat = torch.cat([p.detach().reshape(-1) for p in eval_model.parameters()])
    summary = {
        "strategy": "sgd", "runtime": runtime.name, "replicas": 1, "shards": 0, "partitions": cfg.partitions,
        "server_optimizer": cfg.server_optimizer, "num_parameters": flat.numel(),
        "final_test_accuracy": final_acc, "best_test_accuracy": max(best, final_acc),
        "target_accuracy": cfg.target_accuracy or None, "time_to_target_s": time_to_target,
        "examples": stats.get("examples", 0), "examples_per_s": stats.get("examples", 0) / wall if wall > 0 else 0.0,
        "updates": steps, "updates_per_shard": [steps], "steps_per_replica": [steps],
        "staleness_mean": 0.0, "staleness_max": 0, "rejected_pushes": 0, "replica_restarts": 0,
        "replicas_lost": 0, "stop_reason": stop_reason, "wall_s": wall, **messaging_metrics([stats]),
    }
    return summary, flat
