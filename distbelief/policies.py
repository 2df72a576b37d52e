"""Decisions the trainer executes (decide, then execute): what to do when a role fails."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Decision(Enum):
    RESTART = "restart"
    DROP = "drop"  # go on without this role


@dataclass(frozen=True)
class RestartPolicy:
    """Restart a failed replica up to ``max_restarts`` times, with exponential backoff."""

    max_restarts: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def decide(self, restarts_so_far: int) -> Decision:
        return Decision.RESTART if restarts_so_far < self.max_restarts else Decision.DROP

    def backoff(self, restarts_so_far: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * (2**restarts_so_far))
