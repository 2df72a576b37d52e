"""The coordinator's counters: one record its parts add to, reported in metrics and the summary, and saved with
every iteration checkpoint so that a resumed run counts on.

Counters are never rolled back: an iteration redone after a shard failure did its portions and evaluations
twice, and both are counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The plain integer counters, in the order the state file lists them.
COUNTERS = ("gradient_evals", "line_search_evals", "portions_done", "portions_duplicated", "backups_issued",
            "portions_requeued", "replica_failures", "examples", "shard_restarts", "iterations_redone")


@dataclass
class Counters:
    gradient_evals: int = 0  # distributed gradient evaluations (passes over a batch)
    line_search_evals: int = 0  # of which at a line-search trial point
    portions_done: int = 0  # committed on the shards (each portion of a pass once)
    portions_duplicated: int = 0  # computed copies that were not needed (backups, stale results)
    backups_issued: int = 0
    portions_requeued: int = 0  # computed or held by a replica that failed: handed out again
    replica_failures: int = 0
    examples: int = 0
    shard_restarts: int = 0
    iterations_redone: int = 0  # rollbacks to an iteration checkpoint after a shard failure
    portions_by_replica: dict[int, int] = field(default_factory=dict)  # computed, duplicates included
    shard_recovery_s: list[float] = field(default_factory=list)

    def export(self) -> dict:
        """The counters as the state file holds them (JSON-able)."""
        return {
            "counters": {name: getattr(self, name) for name in COUNTERS},
            "portions_by_replica": {str(rid): n for rid, n in sorted(self.portions_by_replica.items())},
            "shard_recovery_s": list(self.shard_recovery_s),
        }

    def restore(self, state: dict) -> None:
        """Continue from ``export()``'s keys of an earlier run's state."""
        for name in COUNTERS:
            setattr(self, name, int(state["counters"][name]))
        for rid, n in state["portions_by_replica"].items():
            self.portions_by_replica[int(rid)] = int(n)
        self.shard_recovery_s = [float(x) for x in state["shard_recovery_s"]]
