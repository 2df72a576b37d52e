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
    if not with_parts:
        return {}
    P, n = len(with_parts[0]["partitions"]), len(with_parts)

    def mean(per_step) -> list[float]:  # per partition, over the replicas
        return [sum(per_step(s, s["partitions"][p]) for s in with_parts) / n for p in range(P)]

    return {
        "partition_bytes_per_step": mean(lambda s, part: part["bytes_per_step"]),
        "partition_messages_per_step": mean(lambda s, part: part["messages_per_step"]),
        "partition_cpu_s_per_step": mean(lambda s, part: part["compute_cpu_s"] / max(1, s["steps"])),
    }
