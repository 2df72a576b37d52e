"""The run's training clock: wall-clock seconds of training, paused while a baseline evaluates, continued by a
resumed run."""

from __future__ import annotations

import time


class Clock:
    """Training wall clock that can be paused (baselines pause it while they evaluate)."""

    def __init__(self, offset_s: float = 0.0):
        self._start = time.monotonic() - offset_s  # a resumed run continues its clock
        self._paused_total = 0.0
        self._paused_at: float | None = None

    def elapsed(self) -> float:
        now = self._paused_at if self._paused_at is not None else time.monotonic()
        return now - self._start - self._paused_total

    def pause(self) -> None:
        if self._paused_at is None:
            self._paused_at = time.monotonic()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._paused_total += time.monotonic() - self._paused_at
            self._paused_at = None
