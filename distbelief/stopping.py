"""When a run stops, and why: one stop rule for every driver (Downpour and sync, Sandblaster, the single-process
and multi-process baselines).

A run stops at the first of: a stop requested by its caller (``request``: a probe's way to end a run once what it
waited for happened), the step limit (``max_steps``), the target metric reached (``target_accuracy`` /
``target_auc``: the driver says when), the time budget spent (``max_seconds`` of training time, evaluations paused
excluded, on the driver's clock). Whatever ended it is its ``reason``, recorded in ``summary.json``'s
``stop_reason`` with the words below; an interrupt (Ctrl-C, SIGTERM) or a failure ends it too (``end``). The first
reason found is kept.

The rule also keeps what every driver reports of its evaluations (``evaluated``): the best metric and the training
time at which the target was first reached, and it fills the fields of ``RunSummary`` that every driver fills the
same way (``outcome_fields``), so no driver writes them on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from distbelief.summary import rate

STEP_LIMIT = "step limit reached"
TARGET = "target accuracy reached"
TIME_BUDGET = "time budget spent"
INTERRUPTED = "interrupted"
FAILED = "failed"


class StopRule:
    """The stop conditions of one run. ``elapsed()``: the run's training seconds so far (the driver's clock, which
    may start after the rule is made)."""

    def __init__(self, max_steps: int, max_seconds: float, elapsed: Callable[[], float],
                 target: float | None = None, best: float = -1.0, time_to_target: float | None = None):
        self.max_steps, self.max_seconds, self.elapsed = max_steps or 0, max_seconds or 0.0, elapsed
        self.target = target or None
        self.best = best  # the best metric evaluated so far (-1: none yet); a resumed run passes its own
        self.time_to_target = time_to_target  # training seconds at the first evaluation at the target
        self.reason = ""
        self._requested = ""

    def evaluated(self, metric: float, wall_s: float) -> None:
        """An evaluation measured ``metric`` at ``wall_s`` training seconds."""
        self.best = max(self.best, metric)
        if self.target is not None and metric >= self.target and self.time_to_target is None:
            self.time_to_target = wall_s

    def outcome_fields(self, final_metric: float, examples: int, wall_s: float) -> dict:
        """The ``RunSummary`` fields of the run's outcome, the same for every driver: the final and best metric,
        the target and when it was reached, the examples and their rate, why and when the run stopped."""
        return dict(final_test_accuracy=final_metric, best_test_accuracy=max(self.best, final_metric),
                    target_accuracy=self.target, time_to_target_s=self.time_to_target, examples=examples,
                    examples_per_s=rate(examples, wall_s),
                    stop_reason=self.reason or STEP_LIMIT, wall_s=wall_s)

    def request(self, reason: str) -> None:
        """Stop at the driver's next check, with ``reason`` (callable from any thread)."""
        self._requested = reason

    def end(self, reason: str) -> str:
        """Stop now for ``reason`` (the driver's own condition) unless already stopped; an interrupt or a failure
        (``INTERRUPTED``, ``FAILED``) is the reason whatever came before it: the run did not end as planned."""
        self.reason = reason if reason in (INTERRUPTED, FAILED) else (self.reason or reason)
        return self.reason

    def seconds_left(self) -> float:
        """Training seconds left of the time budget (inf: none set)."""
        if not self.max_seconds:
            return math.inf
        return max(0.0, self.max_seconds - self.elapsed())

    def check(self, steps: int | None = None, target_reached: bool | None = None) -> bool:
        """Whether the run must stop now, and if so sets ``reason`` (kept if already set): a requested stop, then
        ``steps`` (None: this driver's replicas stop themselves at the step limit) at the step limit, then the
        target (``target_reached``; None: whether an evaluation reached it), then the time budget."""
        if target_reached is None:
            target_reached = self.time_to_target is not None
        if self._requested:
            self.end(self._requested)
        elif self.max_steps and steps is not None and steps >= self.max_steps:
            self.end(STEP_LIMIT)
        elif target_reached:
            self.end(TARGET)
        elif self.max_seconds and self.seconds_left() <= 0:
            self.end(TIME_BUDGET)
        return bool(self.reason)
