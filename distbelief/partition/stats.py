"""A partitioned run's messaging metrics, from its replicas' statistics (``runtime/group_stats.py`` merges a
replica's partitions into those)."""

from __future__ import annotations

from typing import Any


def messaging_metrics(replica_stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's messaging statistics from the replicas' latest stats: bytes and messages each partition sent
    per step, and the CPU seconds its process spent in a step's forward and backward passes (its layers and its
    boundary messages; the passes' wall time less that, it waited for its neighbours), averaged over replicas,
    for ``metrics.jsonl`` and ``summary.json``."""
    with_parts = [s for s in replica_stats if s.get("partitions")]
    per = [s["partitions"] for s in with_parts]
    if not per:
        return {}
    P = len(per[0])
    return {
        "partition_bytes_per_step": [sum(r[p]["bytes_per_step"] for r in per) / len(per) for p in range(P)],
        "partition_messages_per_step": [sum(r[p]["messages_per_step"] for r in per) / len(per) for p in range(P)],
        "partition_cpu_s_per_step": [sum(r[p]["compute_cpu_s"] / max(1, s["steps"]) for r, s in zip(per, with_parts))
                                     / len(per) for p in range(P)],
    }
