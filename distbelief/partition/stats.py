"""A partitioned run's messaging metrics, from its replicas' statistics (``runtime/group_stats.py`` merges a
replica's partitions into those)."""

from __future__ import annotations

from typing import Any


def messaging_metrics(replica_stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's messaging statistics from the replicas' latest stats: bytes and messages each partition sent
    per step (averaged over replicas), for ``metrics.jsonl`` and ``summary.json``."""
    per = [s["partitions"] for s in replica_stats if s.get("partitions")]
    if not per:
        return {}
    P = len(per[0])
    return {
        "partition_bytes_per_step": [sum(r[p]["bytes_per_step"] for r in per) / len(per) for p in range(P)],
        "partition_messages_per_step": [sum(r[p]["messages_per_step"] for r in per) / len(per) for p in range(P)],
    }
