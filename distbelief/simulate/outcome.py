"""A simulated run's outcome: throughput, where a replica's step goes, how busy each resource is, and the
bottleneck named: the busiest resource when one is nearly saturated, else what a replica's step is mostly made
of."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SATURATED = 0.85  # a resource busier than this share of the time is the bottleneck


@dataclass
class Prediction:
    examples_per_s: float
    steps_per_s: float  # all replicas together (sandblaster: portions per second)
    step_s: float  # a replica's mean step (sandblaster: portion)
    compute_s: float  # of which computing
    wait_s: float  # of which waiting on shards, links or other replicas
    staleness_mean: float
    staleness_histogram: dict[int, int]
    shard_busy: list[float]
    cpu_busy: list[float]
    link_busy: dict[str, float]
    bottleneck: str
    why: str
    simulated_s: float
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["staleness_histogram"] = {str(k): v for k, v in sorted(self.staleness_histogram.items())}
        return d


def bottleneck(shard_busy: list[float], cpu_busy: list[float], link_busy: dict[str, float], compute_s: float,
               wait_s: float, clock_wait_s: list[float], replica_seconds: float) -> tuple[str, str]:
    """The name of what limits the run, and why: the busiest of shards, core pools and links when it is busier
    than ``SATURATED``; otherwise the replicas' own compute when it is most of a step, the staleness bound when
    replicas mostly wait on it, and else round trips (per-call costs and latency, nothing saturated)."""
    candidates = [(b, f"shard {k}", "its update rule and calls keep it busy") for k, b in enumerate(shard_busy)]
    candidates += [(b, "cores" if len(cpu_busy) == 1 else f"cores of node {p}", "every core is busy")
                   for p, b in enumerate(cpu_busy)]
    candidates += [(b, f"link {name}", "the link carries as much as its rate allows") for name, b in
                   link_busy.items()]
    if candidates:
        busy, name, why = max(candidates)
        if busy >= SATURATED:
            return name, f"{why} ({busy:.0%} busy)"
    # a node whose link is busy one way then the other (a push, then the fetch after it) most of the time
    both: dict[str, float] = {}
    for name, b in link_busy.items():
        node = name.rsplit(" ", 1)[0]
        both[node] = both.get(node, 0.0) + b
    waiting = wait_s / (compute_s + wait_s) if compute_s + wait_s else 0.0
    if both:
        node, busy = max(both.items(), key=lambda kv: kv[1])
        if busy >= SATURATED:
            return (f"link of {node}", f"pushes and fetches take turns on it: busy {busy:.0%} of the time one "
                                       f"way or the other")
        if busy >= 0.5 and waiting >= 0.5:  # most of the wait is on it, the rest per-object and per-call costs
            return (f"link of {node}", f"replicas wait {waiting:.0%} of a step, most of it for their pushes and "
                                       f"fetches in turn on this link (busy {busy:.0%} of the time one way or "
                                       f"the other), the rest for per-object and per-call costs")
    if replica_seconds and sum(clock_wait_s) / replica_seconds > 0.3:
        return "staleness bound", "replicas wait for the slowest more than 30% of the time"
    if compute_s >= 0.7 * (compute_s + wait_s):
        return "replica compute", f"computing is {compute_s / (compute_s + wait_s):.0%} of a replica's step"
    return ("round trips", f"replicas wait {wait_s / (compute_s + wait_s):.0%} of a step and nothing is saturated: "
            f"per-call costs and latency")
