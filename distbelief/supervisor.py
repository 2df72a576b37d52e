"""What happens to a failed replica, and when: the one restart/drop policy every strategy's driver uses.

A driver reports a failure (``Supervisor.failed``); the supervisor decides — restart after an exponential backoff,
or go on without the replica once it has used its restarts — and keeps the schedule. Nothing sleeps: the driver
goes on supervising the other replicas, evaluating and checking the shards, and asks ``due()`` on each tick for
the replicas whose backoff is over, starts them, and reports ``restarted``. Downpour, synchronous data
parallelism, model-parallel partition groups (a group fails and restarts as one replica) and Sandblaster's
portion workers all go through here. (The torch.multiprocessing baselines never restart a worker: Hogwild goes
on without a lost one, as with no restarts left here, and a lost DDP rank ends the run, as it does in torch.)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable


class Decision(Enum):
    RESTART = "restart"
    DROP = "drop"  # go on without this replica


@dataclass(frozen=True)
class RestartPolicy:
    """Restart a failed replica up to ``max_restarts`` times, waiting ``backoff_s * 2**n`` (at most
    ``max_backoff_s``) before restart n + 1."""

    max_restarts: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def decide(self, restarts_so_far: int) -> Decision:
        return Decision.RESTART if restarts_so_far < self.max_restarts else Decision.DROP

    def backoff(self, restarts_so_far: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * (2**restarts_so_far))


class Supervisor:
    """The restart/drop bookkeeping for one run's replicas (ids are the driver's replica ids).

    ``clock`` is injectable so the schedule is testable without waiting. ``earlier``: the restarts and losses of
    the run this one resumes — counted in the reported totals, not against this run's budget (a resumed run starts
    every replica afresh).
    """

    def __init__(self, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic,
                 restarts: dict[int, int] | None = None, earlier: tuple[int, int] = (0, 0)):
        self.policy = policy
        self.clock = clock
        self.earlier_restarts, self.earlier_lost = earlier
        self.restarts: dict[int, int] = dict(restarts or {})  # restarts used, per replica
        self.lost: set[int] = set()  # dropped: out of restarts
        self.recovery_s: list[float] = []  # failure to restart, per restart
        self._scheduled: dict[int, tuple[float, float]] = {}  # rid -> (restart at, failed at)

    @property
    def total_restarts(self) -> int:
        return sum(self.restarts.values())

    @property
    def replica_restarts(self) -> int:
        """Restarts over the whole run, resumes included (what the summary reports)."""
        return self.earlier_restarts + self.total_restarts

    @property
    def replicas_lost(self) -> int:
        """Replicas dropped over the whole run, resumes included."""
        return self.earlier_lost + len(self.lost)

    def failed(self, rid: int, stopping: bool = False) -> Decision:
        """Replica ``rid`` failed: drop it (out of restarts) or schedule its restart after the backoff. With
        ``stopping`` (the run is ending anyway) nothing is scheduled, but the decision is still reported."""
        n = self.restarts.get(rid, 0)
        decision = self.policy.decide(n)
        if decision is Decision.DROP:
            self.lost.add(rid)
        elif not stopping:
            now = self.clock()
            self._scheduled[rid] = (now + self.policy.backoff(n), now)
        return decision

    def waiting(self, rid: int) -> bool:
        """Whether ``rid`` waits out its backoff (its old role is dead; no new one yet)."""
        return rid in self._scheduled

    def restart_at(self, rid: int) -> float:
        return self._scheduled[rid][0]

    def due(self) -> list[int]:
        """The replicas whose backoff is over, in id order; each stays scheduled until ``restarted`` or
        ``cancel`` is called for it."""
        now = self.clock()
        return sorted(rid for rid, (at, _) in self._scheduled.items() if now >= at)

    def restarted(self, rid: int) -> int:
        """``rid``'s replacement is running; returns its restart number (1 for the first)."""
        _, failed_at = self._scheduled.pop(rid)
        self.restarts[rid] = self.restarts.get(rid, 0) + 1
        self.recovery_s.append(self.clock() - failed_at)
        return self.restarts[rid]

    def cancel(self, rid: int) -> None:
        """Forget ``rid``'s scheduled restart (the run is stopping)."""
        self._scheduled.pop(rid, None)

    def until_next(self) -> float:
        """Seconds until the next scheduled restart (inf: none; 0: one is due)."""
        if not self._scheduled:
            return math.inf
        return max(0.0, min(at for at, _ in self._scheduled.values()) - self.clock())
