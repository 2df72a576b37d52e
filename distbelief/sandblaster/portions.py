"""The portion queue: load balancing and backup tasks for one batch (docs/paper.md), as pure bookkeeping.

A batch (the examples of one gradient evaluation) is cut into *portions*, ranges ``[lo, hi)`` of positions in
the batch, much smaller than ``batch / num_replicas``. The queue only *decides*; the coordinator executes (it
sends the portion to the replica and reports back what happened). Nothing here talks to a process, so every
rule is unit-testable.

Life of a portion::

    PENDING --next_for--> RUNNING --result--> HELD --claim--> PUSHING --committed--> COMMITTED
       ^                     |                  |                |
       +--- replica_failed --+------------------+----- lost -----+   (back to HELD / RUNNING while another
                                                                      replica still holds / computes a copy)

* **HELD**: at least one replica computed the portion and keeps its gradient aside (``holders``). More copies
  may exist (backup tasks); they are identical.
* **PUSHING**: the coordinator *claimed* the portion for one holder's next push; every other copy is dropped.
  Claims are made in one place, one at a time, so a portion is claimed at most once: this is the exactly-once
  guarantee.
* **COMMITTED**: the shards added it. A batch is done when every portion is committed.

Affinity: replicas start at evenly spaced portions and walk forward, so consecutive portions go to the same
replica (the paper prefetches data that way). A replica whose stretch is exhausted steals the second half of the
longest run of pending portions. Backup tasks: when no portion is pending, an idle replica receives a copy of a
portion that is still running elsewhere, or whose result is held only by replicas that are busy (their push
would wait for their current portion) — the longest-outstanding first, at most ``max_copies`` running copies.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum


class PortionState(Enum):
    PENDING = "pending"
    RUNNING = "running"
    HELD = "held"
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
    holders: set[int] = field(default_factory=set)  # replicas holding a computed copy, not yet pushed
    claimed_by: int | None = None  # the replica whose push carries it (PUSHING, COMMITTED)
    copies_issued: int = 0  # how many times it was handed out (backups and re-queues included)
    results: int = 0  # how many computed copies arrived
    started_s: float = 0.0  # when it was first handed out (since it last became pending)

    @property
    def size(self) -> int:
        return self.hi - self.lo


class PortionQueue:
    """The portions of one batch and who computes, holds and pushes them.

    Args:
        batch_size: examples in the batch.
        portion_size: examples per portion (the last portion may be shorter).
        replica_ids: the replicas taking part (more can join with ``add_replica``).
        backup_tasks: once nothing is pending, hand outstanding portions to idle replicas too.
        max_copies: at most this many replicas compute one portion at the same time.
        force_backups: testing only: hand every portion, whatever its state, to a second replica before moving
            on to pending ones, so that every portion's result arrives twice.
        clock: time source (injectable for tests).
    """

    def __init__(self, batch_size: int, portion_size: int, replica_ids: Iterable[int], backup_tasks: bool = True,
                 max_copies: int = 2, force_backups: bool = False, clock: Callable[[], float] = time.monotonic):
        if batch_size < 1 or portion_size < 1:
            raise ValueError(f"batch_size and portion_size must be >= 1, got {batch_size}, {portion_size}")
        self.portions = [Portion(i, lo, min(lo + portion_size, batch_size))
                         for i, lo in enumerate(range(0, batch_size, portion_size))]
        self.backup_tasks, self.max_copies, self.force_backups = backup_tasks, max_copies, force_backups
        self._clock = clock
        ids = list(replica_ids)
        n = len(self.portions)
        # Evenly spaced starting points: replica k walks its own contiguous stretch of the batch.
        self._cursor: dict[int, int] = {rid: (k * n) // max(1, len(ids)) for k, rid in enumerate(ids)}
        self.backups_issued = 0
        self.duplicates = 0  # results for a portion that already had one

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

    def held_by(self, rid: int) -> list[int]:
        """Portions whose computed gradient replica ``rid`` keeps, claimable or not."""
        return [p.portion_id for p in self.portions if rid in p.holders]

    def claimable(self, rid: int) -> int:
        """How many portions replica ``rid`` could push now (it holds them and nobody claimed them)."""
        return sum(p.state is PortionState.HELD and rid in p.holders for p in self.portions)

    # ------------------------------------------------------------------ decisions
    def add_replica(self, rid: int) -> None:
        """A (re)started replica joins: it begins by stealing like any replica whose stretch is exhausted."""
        self._cursor[rid] = len(self.portions)

    def next_for(self, rid: int, busy: frozenset[int] | set[int] = frozenset()) -> Portion | None:
        """The portion replica ``rid`` should compute next, or None (nothing useful for it to do).

        ``busy`` are the replicas with a call in progress (their held results cannot be pushed before it ends).
        """
        if self.force_backups:
            p = self._forced_copy_for(rid)
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
            p = self._backup_for(rid, busy)
            if p is not None:
                return self._hand_out(p, rid, backup=True)
        return None

    def _steal_point(self) -> int | None:
        """The first portion of the second half of the longest run of pending portions."""
        best_lo, best_len = None, 0
        for pending, grp in itertools.groupby(self.portions, key=lambda p: p.state is PortionState.PENDING):
            run = list(grp)
            if pending and len(run) > best_len:
                best_lo, best_len = run[0].portion_id, len(run)
        return None if best_lo is None else best_lo + best_len // 2

    def _backup_for(self, rid: int, busy) -> Portion | None:
        def outstanding(p: Portion) -> bool:
            if p.state is PortionState.RUNNING:
                return True
            # Held only by replicas that are busy: their push waits for their current portion.
            return p.state is PortionState.HELD and p.holders <= set(busy)

        cands = [p for p in self.portions if outstanding(p) and rid not in p.running_on and rid not in p.holders
                 and len(p.running_on) < self.max_copies]
        return min(cands, key=lambda p: (p.started_s, p.portion_id)) if cands else None

    def _forced_copy_for(self, rid: int) -> Portion | None:
        cands = [p for p in self.portions if p.copies_issued == 1 and p.state is not PortionState.PENDING
                 and rid not in p.running_on and rid not in p.holders and p.claimed_by != rid]
        return cands[0] if cands else None

    def _hand_out(self, p: Portion, rid: int, backup: bool = False) -> Portion:
        if p.state is PortionState.PENDING:
            p.state, p.started_s = PortionState.RUNNING, self._clock()
        p.running_on.add(rid)
        p.copies_issued += 1
        self.backups_issued += backup
        return p

    def claim(self, rid: int) -> tuple[list[int], list[int]]:
        """Replica ``rid`` pushes now: ``(include, drop)``. ``include``: the portions it holds that nobody has
        claimed — they are now claimed by it (PUSHING). ``drop``: copies it holds of portions claimed by others."""
        include, drop = [], []
        for p in self.portions:
            if rid not in p.holders:
                continue
            p.holders.discard(rid)
            if p.state is PortionState.HELD:
                p.state, p.claimed_by = PortionState.PUSHING, rid
                include.append(p.portion_id)
            else:
                drop.append(p.portion_id)
        return include, drop

    def release(self, rid: int) -> list[int]:
        """Copies replica ``rid`` holds of portions already claimed by someone: it may free them."""
        out = []
        for p in self.portions:
            if rid in p.holders and p.state in (PortionState.PUSHING, PortionState.COMMITTED):
                p.holders.discard(rid)
                out.append(p.portion_id)
        return out

    # ------------------------------------------------------------------ what happened
    def result(self, portion_id: int, rid: int) -> bool:
        """Replica ``rid`` finished ``portion_id`` and holds its gradient. True if it is the first result."""
        p = self.portions[portion_id]
        p.running_on.discard(rid)
        p.results += 1
        first = p.results == 1
        if not first:
            self.duplicates += 1
        p.holders.add(rid)  # if another copy is already claimed, this one is dropped at rid's next call
        if p.state in (PortionState.PENDING, PortionState.RUNNING):
            p.state = PortionState.HELD
        return first

    def committed(self, portion_ids: Iterable[int]) -> None:
        """The shards added these portions (carried by the push of the replica that claimed them)."""
        for i in portion_ids:
            p = self.portions[i]
            assert p.state is PortionState.PUSHING, f"portion {i} is {p.state.value}, not pushing"
            p.state = PortionState.COMMITTED

    def lost(self, portion_ids: Iterable[int]) -> list[int]:
        """A claimed push never reached the shards: other copies, or a new computation, must provide these."""
        portion_ids = list(portion_ids)
        for i in portion_ids:
            p = self.portions[i]
            assert p.state is PortionState.PUSHING, f"portion {i} is {p.state.value}, not pushing"
            p.claimed_by = None
            self._settle(p)
        return portion_ids

    def replica_failed(self, rid: int) -> list[int]:
        """Replica ``rid`` died: it neither computes nor holds anything any more. Returns the portions that went
        back to PENDING. (Portions it had claimed are the caller's to resolve: ``lost`` if the push never left
        the replica; its shards decide otherwise.)"""
        back = []
        for p in self.portions:
            p.running_on.discard(rid)
            p.holders.discard(rid)
            if p.state in (PortionState.RUNNING, PortionState.HELD):
                self._settle(p)
                if p.state is PortionState.PENDING:
                    back.append(p.portion_id)
        self._cursor.pop(rid, None)
        return back

    def _settle(self, p: Portion) -> None:
        """The state a non-claimed portion is in, given who still holds or computes it."""
        if p.holders:
            p.state = PortionState.HELD
        elif p.running_on:
            p.state = PortionState.RUNNING
        else:
            p.state = PortionState.PENDING
