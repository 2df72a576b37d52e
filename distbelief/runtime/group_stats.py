"""What a partition group shows the driver: one replica's statistics, merged from its partitions' (the head,
partition 0, counts the replica's steps and sees its loss), with each partition's messaging per step."""

from __future__ import annotations

from typing import Any

HEAD = 0  # the partition that leads a group's lockstep, gathers the output and computes the loss


def merge_partition_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Replica-level stats (as a ModelReplica reports them) plus per-partition messaging per step."""
    head = next(s for s in parts if s["partition_id"] == HEAD)
    steps = max(1, head["steps"])
    per = [{
        "partition_id": s["partition_id"], "num_parameters": s["num_parameters"],
        "bytes_sent": s["bytes_sent"], "messages_sent": s["messages_sent"],
        "bytes_per_step": s["bytes_sent"] / steps, "messages_per_step": s["messages_sent"] / steps,
        "bytes_by_phase": s["bytes_by_phase"], "compute_s": s["compute_s"], "wait_s": s["wait_s"],
        "compute_cpu_s": s["compute_cpu_s"],
    } for s in sorted(parts, key=lambda s: s["partition_id"])]
    acks = [s["acked"] for s in parts if s.get("acked")]
    return {
        "acked": [max(col) for col in zip(*acks)] if acks else [],
        "replica_id": head["replica_id"], "steps": head["steps"], "examples": head["examples"],
        "pushes": sum(s["pushes"] for s in parts), "loss_ema": head["loss_ema"],
        "compute_s": max(s["compute_s"] for s in parts), "wait_s": max(s["wait_s"] for s in parts),
        "partitions": per,
    }
