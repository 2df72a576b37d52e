"""The portion queue: load balancing and backup tasks for one batch (PAPER.md §3), as pure bookkeeping.

A batch (the examples of one gradient evaluation) is cut into *portions*, ranges ``[lo, hi)`` of positions in the
batch, much smaller than ``batch / num_replicas``. The queue only *decides*; the coordinator executes (it sends
the portion to the replica, and reports back what happened). Nothing here talks to a process, so every rule is
unit-testable.

Life of a portion::

    PENDING --next_for--> RUNNING --result (first)--> WON --pushing--> PUSHING --committed--> COMMITTED
        ^                    |  ^                      |                  |
        +-- replica_failed --+  +---- replica_failed --+------ lost ------+   (back to RUNNING while another
                                                                                replica still computes it)

* **WON** means one replica's result arrived first: its gradient is still inside that replica (accumulated
  locally until the next push). A later result for the same portion is a *duplicate* and is discarded.
* **PUSHING** means the winner's accumulated gradient has left the replica and is on its way to the shards.
* **COMMITTED** means the shards have added it. A batch is done when every portion is committed, and each is
  committed exactly once because only the winner's contribution is ever pushed.

Affinity: replicas start at evenly spaced portions and walk forward, so consecutive portions go to the same
replica (the paper prefetches data that way). A replica whose run is exhausted steals the second half of the
longest run of pending portions. Backup tasks: when no portion is pending, an idle replica receives a running
portion that it is not already computing (the longest-running first), up to ``max_copies`` concurrent copies.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum


class PortionState(Enum):
    PENDING = "pending"
    RUNNING = "running"
    WON = "won"
    PUSHING = "pushing"
    COMMITTED = "committed"


@dataclass
class Portion:
    """Examples ``[lo, hi)`` of the batch (positions, not dataset indices)."""

    portion_id: int
    lo: int
    hi: int
    state: PortionState = PortionState.PENDING
    running_on: set[int] = field(default_factory=set)  # replicas computing it right now
    copies_issued: int = 0  # how many times it was handed out (backups and re-queues included)
    winner: int | None = None
    started_s: float = 0.0  # when the oldest running copy was handed out

    @property
    def size(self) -> int:
        return self.hi - self.lo


class PortionQueue:
    """The portions of one batch and who computes them.

    Args:
        batch_size: examples in the batch.
        portion_size: examples per portion (the last portion may be shorter).
        replica_ids: the replicas taking part (more can join with ``add_replica``).
        backup_tasks: hand running portions to idle replicas once nothing is pending.
        max_copies: at most this many replicas compute one portion at the same time.
        force_backups: testing only: hand every portion (even one already won) to a second replica before moving
            on to pending ones, so that every portion's result arrives twice.
        clock: time source (injectable for tests).
    """

    def __init__(self, batch_size: int, portion_size: int, replica_ids, backup_tasks: bool = True,
                 max_copies: int = 2, force_backups: bool = False, clock=time.monotonic):
        if batch_size < 1 or portion_size < 1:
            raise ValueError(f"batch_size and portion_size must be >= 1, got {batch_size}, {portion_size}")
        self.portions = [Portion(i, lo, min(lo + portion_size, batch_size))
                         for i, lo in enumerate(range(0, batch_size, portion_size))]
        self.backup_tasks, self.max_copies, self.force_backups = backup_tasks, max_copies, force_backups
        self._clock = clock
        self._cursor: dict[int, int] = {}
        ids = list(replica_ids)
        n = len(self.portions)
        # Evenly spaced starting points: replica k walks its own contiguous stretch of the batch.
        for k, rid in enumerate(ids):
            self._cursor[rid] = (k * n) // max(1, len(ids))
        self.backups_issued = 0
        self.duplicates = 0

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self.portions)

    def count(self, state: PortionState) -> int:
        return sum(p.state is state for p in self.portions)

    @property
    def num_pending(self) -> int:
        return self.count(PortionState.PENDING)

    def all_committed(self) -> bool:
        return all(p.state is PortionState.COMMITTED for p in self.portions)

    def won_by(self, rid: int) -> list[int]:
        return [p.portion_id for p in self.portions if p.state is PortionState.WON and p.winner == rid]

    # ------------------------------------------------------------------ decisions
    def add_replica(self, rid: int) -> None:
        """A (re)started replica joins: it begins by stealing like any replica with an exhausted run."""
        self._cursor[rid] = len(self.portions)

    def next_for(self, rid: int) -> Portion | None:
        """The portion replica ``rid`` should compute next, or None (nothing useful for it to do)."""
        if self.force_backups:
            p = self._backup_for(rid, any_state=True)
            if p is not None:
                return self._hand_out(p, rid, backup=True)
        cur = self._cursor.get(rid, len(self.portions))
        if cur < len(self.portions) and self.portions[cur].state is PortionState.PENDING:
            self._cursor[rid] = cur + 1
            return self._hand_out(self.portions[cur], rid)
        start = self._steal_point()
        if start is not None:
            self._cursor[rid] = start + 1
            return self._hand_out(self.portions[start], rid)
        if self.backup_tasks:
            p = self._backup_for(rid, any_state=False)
            if p is not None:
                return self._hand_out(p, rid, backup=True)
        return None

    def _steal_point(self) -> int | None:
        """The first portion of the second half of the longest run of pending portions."""
        best_lo, best_len = None, 0
        for is_pending, grp in itertools.groupby(self.portions, key=lambda p: p.state is PortionState.PENDING):
            run = list(grp)
            if is_pending and len(run) > best_len:
                best_lo, best_len = run[0].portion_id, len(run)
        if best_lo is None:
            return None
        return best_lo + best_len // 2

    def _backup_for(self, rid: int, any_state: bool) -> Portion | None:
        if any_state:
            # Forced mode: every portion gets exactly two copies, whatever its state.
            cands = [p for p in self.portions if p.copies_issued == 1 and rid not in p.running_on
                     and p.winner != rid and p.state is not PortionState.PENDING]
        else:
            cands = [p for p in self.portions if p.state is PortionState.RUNNING and rid not in p.running_on
                     and len(p.running_on) < self.max_copies]
        if not cands:
            return None
        return min(cands, key=lambda p: (p.started_s, p.portion_id))  # the longest-running first

    def _hand_out(self, p: Portion, rid: int, backup: bool = False) -> Portion:
        if not p.running_on:
            p.started_s = self._clock()
        p.running_on.add(rid)
        p.copies_issued += 1
        if p.state is PortionState.PENDING:
            p.state = PortionState.RUNNING
        if backup:
            self.backups_issued += 1
        return p

    # ------------------------------------------------------------------ what happened
    def result(self, portion_id: int, rid: int) -> bool:
        """Replica ``rid`` finished ``portion_id``. True if it is the first result (the winner, to be kept)."""
        p = self.portions[portion_id]
        p.running_on.discard(rid)
        if p.state is PortionState.RUNNING:
            p.state, p.winner = PortionState.WON, rid
            return True
        self.duplicates += 1
        return False

    def pushing(self, portion_ids) -> None:
        """The winners' gradient for these portions left the replica (its push is on the way to the shards)."""
        for i in portion_ids:
            p = self.portions[i]
            assert p.state is PortionState.WON, f"portion {i} is {p.state.value}, not won"
            p.state = PortionState.PUSHING

    def committed(self, portion_ids) -> None:
        """The shards added the gradient of these portions."""
        for i in portion_ids:
            p = self.portions[i]
            assert p.state is PortionState.PUSHING, f"portion {i} is {p.state.value}, not pushing"
            p.state = PortionState.COMMITTED

    def lost(self, portion_ids) -> list[int]:
        """The gradient of these won portions was lost before reaching the shards: compute them again."""
        for i in portion_ids:
            self._requeue(self.portions[i])
        return list(portion_ids)

    def replica_failed(self, rid: int) -> list[int]:
        """Replica ``rid`` died. Its running portions and the won portions it had not pushed are re-queued.

        Returns the ids of the portions whose state went back (to PENDING, or to RUNNING when another replica
        is still computing them, whose result will then win).
        """
        back = []
        for p in self.portions:
            p.running_on.discard(rid)
            if p.state is PortionState.WON and p.winner == rid:
                self._requeue(p)
                back.append(p.portion_id)
            elif p.state is PortionState.RUNNING and not p.running_on:
                p.state = PortionState.PENDING
                back.append(p.portion_id)
        self._cursor.pop(rid, None)
        return back

    def _requeue(self, p: Portion) -> None:
        p.winner = None
        p.state = PortionState.RUNNING if p.running_on else PortionState.PENDING
