"""The paper's single-replica baseline with model parallelism: one replica split into P partitions, each
partition applying the server update rule ``optimizer`` (distbelief/ps/rules) to its own parameters — no parameter
server. ``distbelief train --strategy sgd --partitions P``.

The loop shell (clock, evaluation cadence, stop conditions, summary) is single-process SGD's
(``baselines/loop.py``); here is only what differs: the replica trains in chunks between evaluations on its
partition workers, and its parameters are read back from them to evaluate.
"""

from __future__ import annotations

import torch

from distbelief.baselines.loop import OneReplicaRun
from distbelief.downpour.replica import ReplicaSettings
from distbelief.metrics import RunRecorder
from distbelief.partition.replica import PartitionRecipe
from distbelief.partition.stats import messaging_metrics
from distbelief.ps.rules import make_rule
from distbelief.ps.sharding import unflatten_into
from distbelief.summary import RunSummary


class PartitionedRun(OneReplicaRun):
    """One replica as a partition group on ``runtime``, trained with local updates."""

    def __init__(self, job, runtime, recorder: RunRecorder):
        super().__init__(job, recorder)
        cfg = job.cfg
        self.runtime, self.runtime_name = runtime, runtime.name
        rule = make_rule(cfg.optimizer, lr=cfg.lr, eps=cfg.adagrad_eps,
                         initial_accumulator=cfg.adagrad_initial_accumulator)
        settings = ReplicaSettings(remote_timeout_s=cfg.remote_timeout_s)
        recipe = PartitionRecipe(0, 1, job.model_fn, job.train_data, cfg.batch_size, cfg.seed, settings,
                                 job.loss_fn, local_optimizer=rule)
        torch.manual_seed(cfg.seed)
        self.eval_model = job.model_fn()
        self.role = runtime.create_partition_group(0, recipe, None, None, job.threads, cfg.partitions)
        recorder.log(f"single replica in {cfg.partitions} partitions, local {cfg.optimizer} "
                     f"({sum(p.numel() for p in self.eval_model.parameters()):,} parameters)")
        self.stats: dict = {}  # the group's latest statistics
        self.wait_s = cfg.remote_timeout_s + (cfg.eval_every_seconds or 0)

    def train_until_eval(self) -> None:
        """One chunk on the partition workers: until the next evaluation, the step limit or the time budget."""
        cfg = self.cfg
        left_steps = (cfg.max_steps - self.steps) if cfg.max_steps else None
        chunk = min(self.seconds_to_eval(), self.seconds_left())
        self.stats = self.runtime.call(self.role, "run", left_steps, chunk).result(self.wait_s + chunk)
        self.steps = self.stats["steps"]
        self.examples = self.stats.get("examples", 0)
        self.loss_ema = self.stats.get("loss_ema")

    def model_now(self) -> torch.nn.Module:
        flat = torch.empty(sum(p.numel() for p in self.eval_model.parameters()))
        for lo, values in self.runtime.call(self.role, "params").result(self.cfg.remote_timeout_s):
            flat[lo: lo + len(values)].copy_(torch.as_tensor(values))
        unflatten_into(self.eval_model, flat)
        return self.eval_model

    def record_fields(self) -> dict:
        return messaging_metrics([self.stats])

    def summary_fields(self) -> dict:
        return messaging_metrics([self.stats])

    def close(self) -> None:
        self.runtime.kill(self.role)


def run_partitioned_sgd(job, runtime, recorder: RunRecorder) -> tuple[RunSummary, torch.Tensor, dict | None]:
    """Train one partitioned replica with local updates; evaluate every ``eval_every_seconds`` of training."""
    return PartitionedRun(job, runtime, recorder).run()
