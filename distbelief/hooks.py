"""Run hooks: where tooling outside a run acts on it at chosen points, without the drivers knowing what it does.

A driver (Downpour/sync, Sandblaster, the multiprocess baselines) gives its ``RunHooks`` three ways in:

- **run steps**: ``next_step()`` names the next step count of the whole run (every replica's steps together;
  Sandblaster: L-BFGS iterations) the hooks care about; the driver calls ``on_step(driver, steps)`` at its first
  look at the step count once it is reached. The driver does not poll for it: it predicts when the run will get
  there from the rate it measured (``StepWake``) and looks then.
- **evaluations**: ``on_evaluation(driver, record)`` after each evaluation, with the ``metrics.jsonl`` record.
- **inside each replica**: ``replica_hook(replica_id)`` returns a picklable callable the replica runs after each
  step (Sandblaster: each portion) with ``(its count so far, that step's compute seconds)``.

The drivers expose what hooks need to act: ``request_stop(reason)``, ``kill_replica(replica_id, partition_id)``
and ``kill_shard(shard_id)`` (losing a machine, as a chaos test would), their ``cfg``, ``runtime`` and
``server``. ``distbelief.testing.Faults`` is built on this (failures at step counts, slow machines); the drivers
contain nothing of it. Every method runs in the driver's process, on its supervision thread.
"""

from __future__ import annotations

import time
from typing import Any, Callable

ReplicaHook = Callable[[int, float], None]


class RunHooks:
    """No-op hooks; subclass and override what you need. ``start`` returns the object the run calls, so hooks
    that keep per-run state (what already fired) return a fresh one there."""

    def check(self, cfg: Any) -> None:
        """Refuse (``ConfigError`` naming the field) hooks that cannot apply to the run ``cfg``; before any
        worker starts."""

    def start(self, driver: Any, resumed: bool) -> "RunHooks":
        """The hooks for this run of ``driver`` (``resumed``: the run continues an earlier one)."""
        return self

    def next_step(self) -> int | None:
        """The run step count at which ``on_step`` wants to be called next; None: none."""
        return None

    def on_step(self, driver: Any, steps: int) -> None:
        """The run has done ``steps >= next_step()`` steps (as the driver last counted them)."""

    def on_evaluation(self, driver: Any, record: dict) -> None:
        """An evaluation just ended; ``record`` is its metrics.jsonl record."""

    def replica_hook(self, replica_id: int) -> ReplicaHook | None:
        """A picklable ``f(count, compute_s)`` replica ``replica_id`` runs after each step (Sandblaster: each
        portion), or None."""
        return None


class StepWake:
    """When a driver should next look at the run's step count to catch step ``target`` soon after it is reached,
    without polling: the rate measured between its looks (over about ``window_s``, so a run that speeds up as
    replicas join is followed) predicts the time left. Before a rate is known it looks after ``first_s``; a prediction is bounded by ``[min_s, max_s]`` (``min_s`` keeps a step count that jumps in
    bursts from turning into a busy loop)."""

    def __init__(self, first_s: float = 0.05, min_s: float = 0.002, max_s: float = 0.5, window_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        self.first_s, self.min_s, self.max_s, self.window_s, self.clock = first_s, min_s, max_s, window_s, clock
        self._seen: tuple[float, int] | None = None  # (time, steps) of the look the rate is measured from
        self._last: tuple[float, int] | None = None

    def observe(self, steps: int) -> None:
        now = self.clock()
        if self._seen is None or steps < self._seen[1]:  # the first look, or a count that went back
            self._seen = (now, steps)
        elif now - self._seen[0] > self.window_s and self._last is not None:  # the rate of the last window only
            self._seen = self._last
        self._last = (now, steps)

    def rate(self) -> float | None:
        """Steps per second over the last window of looks, or None before two looks at different counts."""
        if self._seen is None or self._last is None:
            return None
        (t0, s0), (t1, s1) = self._seen, self._last
        return (s1 - s0) / (t1 - t0) if s1 > s0 and t1 > t0 else None

    def seconds_until(self, target: int | None) -> float:
        """How long to wait before looking again for ``target`` (``max_s`` when there is nothing to catch)."""
        if target is None:
            return self.max_s
        if self._last is None:
            return self.first_s
        left = target - self._last[1]
        if left <= 0:
            return 0.0
        r = self.rate()
        if r is None:
            return self.first_s
        return min(self.max_s, max(self.min_s, left / r - (self.clock() - self._last[0])))
