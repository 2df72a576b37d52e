"""Elastic Downpour (``--replicas MIN:MAX``): how many replicas to run as the cluster's free CPUs come and go.

Downpour needs no barrier between replicas, so a replica can join or leave a running job without touching the
others: a new one fetches the current parameters from the shards and starts pushing; one whose node went away
is simply no longer waited for. Nothing restarts and no checkpoint is read. The driver's supervision loop asks
``ElasticPlan`` on every tick (``DownpourTrainer._scale``); a restart of a failed replica that finds no free CPU
is a removal instead (its node is gone), and the slot is filled again when CPUs appear.

Each elastic replica draws minibatches from the whole training set in an order of its own (a fixed replica
count gives each replica a disjoint share instead): shares cannot be re-cut while replicas come and go.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ElasticPlan:
    min_replicas: int
    max_replicas: int

    def initial(self, free_slots: int | None) -> int:
        """Replicas to start with: what the free CPUs hold, at least MIN (a cluster that cannot hold MIN was
        refused or oversubscribed before this), at most MAX. ``free_slots`` None: no limit (threads)."""
        if free_slots is None:
            return self.max_replicas
        return max(self.min_replicas, min(self.max_replicas, free_slots))

    def to_add(self, active: int, free_slots: int | None, ceiling: int) -> int:
        """Replicas to add now: ``active`` run or wait for a restart; ``ceiling`` is MAX less the replicas that
        used up their restarts (a replica that keeps failing does not come back under a new id)."""
        room = min(ceiling, self.max_replicas) - active
        if free_slots is not None:
            room = min(room, free_slots)
        return max(0, room)

    def can_restart(self, free_slots: int | None) -> bool:
        """A failed replica's restart goes ahead only where a replica still fits (else its node left: removed)."""
        return free_slots is None or free_slots >= 1
