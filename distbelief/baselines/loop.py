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
        self.best, self.time_to_target = -1.0, None
        self.stop = StopRule(self.cfg.max_steps, self.cfg.max_seconds, lambda: self.clock.elapsed())
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
        """Whether the step limit or the time budget is spent (then ``stop_reason`` says which)."""
        return self.stop.check(steps=self.steps)

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
                if self.time_to_target is not None:
                    self.stop.end(stopping.TARGET)
                    break
                if self.limit_reached():
                    break
            wall = self.clock.elapsed()
            final_acc = self._evaluate()
        finally:
            self.close()
        flat = flatten(self._evaluated)
        summary = RunSummary(
            strategy="sgd", runtime=self.runtime_name, replicas=1, num_parameters=flat.numel(),
            final_test_accuracy=final_acc, best_test_accuracy=max(self.best, final_acc),
            target_accuracy=self.cfg.target_accuracy or None, time_to_target_s=self.time_to_target,
            examples=self.examples, examples_per_s=rate(self.examples, wall), updates=self.steps,
            steps_per_replica=[self.steps], stop_reason=self.stop_reason, wall_s=wall,
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
        self.rec.record({
            "wall_s": round(wall, 3), "updates": self.steps, "examples": self.examples,
            "examples_per_s": rate(self.examples, wall),
            "train_loss": None if loss is None or math.isnan(loss) else loss,
            "test_accuracy": acc, "train_accuracy": train_acc, "test_loss": test_loss,
            **self.record_fields(),
        })
        self.best = max(self.best, acc)
        if self.cfg.target_accuracy and acc >= self.cfg.target_accuracy and self.time_to_target is None:
            self.time_to_target = wall
        self.clock.resume()
        return acc
