"""A partitioned replica's statistics: the replica-level view merged from its partitions, and messaging metrics."""

from __future__ import annotations

from typing import Any

from distbelief.partition.plan import HEAD


def merge_partition_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Replica-level stats (as a ModelReplica reports them) plus per-partition messaging per step."""
    head = next(s for s in parts if s["partition_id"] == HEAD)
    steps = max(1, head["steps"])
    per = [{
        "partition_id": s["partition_id"], "num_parameters": s["num_parameters"],
        "bytes_sent": s["bytes_sent"], "messages_sent": s["messages_sent"],
        "bytes_per_step": s["bytes_sent"] / steps, "messages_per_step": s["messages_sent"] / steps,
        "bytes_by_phase": s["bytes_by_phase"], "compute_s": s["compute_s"], "wait_s": s["wait_s"],
    } for s in sorted(parts, key=lambda s: s["partition_id"])]
    acks = [s["acked"] for s in parts if s.get("acked")]
    return {
        "acked": [max(col) for col in zip(*acks)] if acks else [],
        "replica_id": head["replica_id"], "steps": head["steps"], "examples": head["examples"],
        "pushes": sum(s["pushes"] for s in parts), "loss_ema": head["loss_ema"],
        "compute_s": max(s["compute_s"] for s in parts), "wait_s": max(s["wait_s"] for s in parts),
        "partitions": per,
    }


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
