"""The clock table behind stale-synchronous Downpour (``consistency = "ssp"``): each live replica's clock (the
steps it has completed), and the rule that lets a replica start its next step only while it is at most
``bound`` steps ahead of the slowest live replica (Ho et al., "More effective distributed ML via a stale
synchronous parallel parameter server", NIPS 2013).

``ClockTable`` is the rule, with no threads or processes (unit-tested directly). A runtime serves it to its
replicas through a ``ClockGate``: ``LocalClocks`` for replicas that are threads of one process, and an actor on
Ray (``ray_runtime.RayClocks``).

Who is live: a replica ``join``s when its loop starts (at the slowest live replica's clock, so a replica that
starts late or restarts never holds back those already running) and ``retire``s when its loop ends; the driver
retires a replica it found dead. A dead, finished or not-yet-started replica therefore never blocks the rest.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from typing import Any

from distbelief.runtime.base import Done, Future


class ClockTable:
    """Clocks of the live replicas and the stale-synchronous rule.

    A replica with clock ``c`` (steps completed) may start its next step when ``c - min(live clocks) <= bound``.
    ``gap_max`` is the largest ``c - min`` any replica started a step at (never more than ``bound``)."""

    def __init__(self, bound: int):
        if bound < 0:
            raise ValueError(f"bound must be >= 0, got {bound}")
        self.bound = bound
        self.clocks: dict[int, int] = {}
        self.gap_max = 0
        self.waits = 0  # times a replica asked to start a step and had to wait

    def join(self, rid: int) -> int:
        """Make ``rid`` live at the slowest live replica's clock (0 when none is); returns that clock."""
        self.clocks.pop(rid, None)
        start = min(self.clocks.values(), default=0)
        self.clocks[rid] = start
        return start

    def retire(self, rid: int) -> None:
        self.clocks.pop(rid, None)

    def allowed(self, rid: int, clock: int) -> bool:
        """Whether ``rid`` at ``clock`` may start a step (a replica that is not live is never held)."""
        if rid not in self.clocks:
            return True
        return clock - min(self.clocks.values()) <= self.bound

    def report(self, rid: int, clock: int) -> int:
        """``rid`` completed ``clock`` steps (and will start the next once allowed): record it and return the
        slowest live clock, which never decreases — a replica that knows it ``m`` may start any step at a clock
        ``<= m + bound`` without asking again."""
        if rid not in self.clocks:
            return clock
        self.clocks[rid] = max(self.clocks[rid], clock)
        low = min(self.clocks.values())
        if clock - low <= self.bound:
            self.gap_max = max(self.gap_max, clock - low)
        return low

    def enter(self, rid: int, clock: int, first_try: bool = True) -> bool:
        """``rid`` completed ``clock`` steps and asks to start the next: records the clock and answers
        ``allowed``; when allowed, the step's gap counts towards ``gap_max``."""
        if rid not in self.clocks:
            return True
        self.clocks[rid] = max(self.clocks[rid], clock)
        if not self.allowed(rid, clock):
            if first_try:
                self.waits += 1
            return False
        self.gap_max = max(self.gap_max, clock - min(self.clocks.values()))
        return True

    def stats(self) -> dict[str, Any]:
        return {"clock_gap_max": self.gap_max, "clock_waits": self.waits, "clocks": dict(self.clocks)}


class ClockGate(ABC):
    """A replica's (and the driver's) handle on a run's clock table, wherever the table lives."""

    @abstractmethod
    def join(self, rid: int) -> int: ...

    bound: int

    @abstractmethod
    def report(self, rid: int, clock: int) -> Future:
        """Record that ``rid`` completed ``clock`` steps, without waiting; the future's result is the slowest live
        clock then (``ClockTable.report``). Sent at the end of each step; read only when needed."""

    @abstractmethod
    def wait(self, rid: int, clock: int, timeout_s: float, first_try: bool = False) -> bool:
        """Wait up to ``timeout_s`` until ``rid`` at ``clock`` may start its next step; False if not yet.
        ``first_try``: the first time this step asks (counted in ``clock_waits`` if it must wait)."""

    @abstractmethod
    def retire(self, rid: int) -> None:
        """``rid`` stops counting (finished or dead); never waits."""

    @abstractmethod
    def stats(self, timeout_s: float) -> dict[str, Any]: ...


class LocalClocks(ClockGate):
    """The table for replicas that are threads of this process."""

    def __init__(self, bound: int):
        self.table = ClockTable(bound)
        self.bound = bound
        self._cond = threading.Condition()

    def join(self, rid: int) -> int:
        with self._cond:
            start = self.table.join(rid)
            self._cond.notify_all()
            return start

    def report(self, rid: int, clock: int) -> Future:
        with self._cond:
            low = self.table.report(rid, clock)
            self._cond.notify_all()  # our progress may let others go
            return Done(low)

    def wait(self, rid: int, clock: int, timeout_s: float, first_try: bool = False) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self.table.enter(rid, clock, first_try):
                first_try = False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def retire(self, rid: int) -> None:
        with self._cond:
            self.table.retire(rid)
            self._cond.notify_all()

    def stats(self, timeout_s: float) -> dict[str, Any]:
        with self._cond:
            return self.table.stats()
