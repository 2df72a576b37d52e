"""The loop shell of the runs with one replica and no parameter server: single-process SGD (``single.py``) and
one replica split into partitions (``partition/baseline.py``).

The shell owns what the two share: the training clock (evaluation is not training time), when to evaluate
(``EvalSchedule``), the metrics record, the best accuracy and time to target, when to stop and why, and the
run summary. A subclass says only how the replica trains and where its current parameters are.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from distbelief import stopping
from distbelief.buffers import buffers_of
from distbelief.evaluation import evaluate_job
from distbelief.metrics import Clock, EvalSchedule, RunRecorder
from distbelief.ps.sharding import flatten
from distbelief.stopping import StopRule
from distbelief.summary import RunSummary, rate


class OneReplicaRun:
    """Train one replica until a stop condition, evaluating every ``eval_every_seconds`` of training.

    Subclasses implement ``train_until_eval`` (train until an evaluation is due or a limit is reached, keeping
    ``steps``, ``examples`` and ``loss_ema`` current) and ``model_now`` (a model holding the current
    parameters; called with the clock stopped), and may add record / summary fields and a ``close``.
    """

    runtime_name = "single-process"

    def __init__(self, job, recorder: RunRecorder):
        self.job, self.cfg, self.rec = job, job.cfg, recorder
        self.steps, self.examples, self.loss_ema = 0, 0, math.nan
        self.stop = StopRule(self.cfg.max_steps, self.cfg.max_seconds, lambda: self.clock.elapsed(),
                             target=self.cfg.target_accuracy)
        self.hooks = job.hooks.start(self, resumed=False)  # distbelief/hooks.py
        self.schedule = EvalSchedule(self.cfg.eval_every_seconds, recorder.log)
        self.next_eval = self.cfg.eval_every_seconds
        self.clock = Clock()  # started again when run() starts training
        self._evaluated: torch.nn.Module | None = None  # the model of the last evaluation

    # ------------------------------------------------------------------ what differs
    def train_until_eval(self) -> None:
        raise NotImplementedError

    def model_now(self) -> torch.nn.Module:
        raise NotImplementedError

    def record_fields(self) -> dict[str, Any]:
        """Fields this run adds to every metrics record."""
        return {}

    def summary_fields(self) -> dict[str, Any]:
        """``RunSummary`` fields this run fills in beyond the shell's."""
        return {}

    def close(self) -> None:
        """Release what the run holds (called once, however the run ends)."""

    # ------------------------------------------------------------------ the shell
    def limit_reached(self) -> bool:
        """Whether the run must stop: the target reached, the step limit or the time budget spent (then
        ``stop_reason`` says which). Called after every step: the hooks' ``on_step`` comes here, at its step."""
        due = self.hooks.next_step()
        if due is not None and self.steps >= due:
            self.hooks.on_step(self, self.steps)
        return self.stop.check(steps=self.steps)

    def request_stop(self, reason: str) -> None:
        """End the run after the current step, with ``reason`` as its stop reason (distbelief/hooks.py)."""
        self.stop.request(reason)

    def kill_replica(self, replica_id: int, partition_id: int = -1, steps: int | None = None) -> bool:
        """Nothing to kill: the one replica is this process (logged)."""
        self.rec.log(f"single-process sgd has no replica process to kill; replica {replica_id} not killed")
        return True

    def kill_shard(self, shard_id: int, steps: int | None = None) -> None:
        """Nothing to kill: no parameter shards (logged)."""
        self.rec.log(f"single-process sgd has no parameter shards; shard {shard_id} not killed")

    @property
    def stop_reason(self) -> str:
        return self.stop.reason or stopping.STEP_LIMIT

    def eval_due(self) -> bool:
        return self.clock.elapsed() >= self.next_eval

    def seconds_to_eval(self) -> float:
        """Training seconds until the next evaluation is due (0: it is)."""
        return max(0.0, self.next_eval - self.clock.elapsed())

    def seconds_left(self) -> float:
        """Training seconds left of the time budget (inf: none set)."""
        return self.stop.seconds_left()

    def run(self) -> tuple[RunSummary, torch.Tensor, dict | None]:
        """Train, evaluating when due, until the target, the step limit or the time budget; evaluate once more
        and return ``(summary, flat parameters, module buffers)``."""
        self.clock = Clock()  # from here on is training
        try:
            while True:
                self.train_until_eval()
                if self.eval_due():
                    t0 = time.monotonic()
                    self._evaluate()
                    self.next_eval = self.clock.elapsed() + self.schedule.interval(time.monotonic() - t0)
                if self.limit_reached():
                    break
            wall = self.clock.elapsed()
            final_acc = self._evaluate()
        finally:
            self.close()
        flat = flatten(self._evaluated)
        summary = RunSummary(
            strategy="sgd", runtime=self.runtime_name, replicas=1, num_parameters=flat.numel(),
            **self.stop.outcome_fields(final_acc, self.examples, wall), updates=self.steps,
            steps_per_replica=[self.steps],
            optimizer=self.cfg.optimizer, partitions=self.cfg.partitions, **self.summary_fields(),
        )
        return summary, flat, buffers_of(self._evaluated) or None

    def _evaluate(self) -> float:
        """Evaluate the current parameters with the clock stopped; write the metrics record; the accuracy."""
        self.clock.pause()  # evaluation is not training time
        wall = self.clock.elapsed()
        model = self._evaluated = self.model_now()
        acc, test_loss, train_acc = evaluate_job(model, self.job)
        loss = self.loss_ema
        rec = {
            "wall_s": round(wall, 3), "updates": self.steps, "examples": self.examples,
            "examples_per_s": rate(self.examples, wall),
            "train_loss": None if loss is None or math.isnan(loss) else loss,
            "test_accuracy": acc, "train_accuracy": train_acc, "test_loss": test_loss,
            **self.record_fields(),
        }
        self.rec.record(rec)
        self.stop.evaluated(acc, wall)
        self.hooks.on_evaluation(self, rec)
        self.clock.resume()
        return acc
