"""``simulate(workload, machines, costs)``: a prediction of a run's throughput and where its time goes.

The prediction says examples per second, each replica's step split into compute and waiting, the staleness
distribution, how busy every shard, core pool and link is, and names the bottleneck: the busiest resource when
one is nearly saturated, else what a replica's step is mostly made of.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from distbelief.simulate.costs import Costs
from distbelief.simulate.machines import Machines
from distbelief.simulate.workload import Workload

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


REPRESENTATIVE_CALLS = 4000  # replicas x shards above which one shard stands for all (on shard-only nodes)


def simulate(work: Workload, machines: Machines, costs: Costs, *, steps: int = 60,
             warmup_steps: int = 10, representative: bool | None = None) -> Prediction:
    """Simulate ``work`` on ``machines`` with ``costs``: ``warmup_steps`` per replica to reach a steady state, then
    ``steps`` per replica measured (Sandblaster: L-BFGS iterations, at least 2).

    ``representative``: simulate shard 0 call by call and let it stand for all shards (they are alike and every
    replica talks to each); by default when replicas x shards exceeds ``REPRESENTATIVE_CALLS`` and every shard
    has a node of its own, where it changes the result by little and the time to simulate by the shard count."""
    if work.strategy == "sandblaster":
        from distbelief.simulate.sandblaster import SandblasterRun

        run = SandblasterRun(work, machines, costs)
        seconds = run.run(max(2, steps // 20), 1)
        return run.prediction(seconds)
    from distbelief.simulate.downpour import DownpourRun

    if representative is None:
        _, shard_nodes = machines.place(work.replicas, work.shards)
        representative = (work.replicas * work.shards > REPRESENTATIVE_CALLS and not machines.shared_cores
                          and len(set(shard_nodes)) == work.shards
                          and machines.nodes >= work.replicas + work.shards)
    run = DownpourRun(work, machines, costs, representative=representative)
    seconds = run.run(steps, warmup_steps)
    replicas = len(run.steps)
    total_steps = sum(run.steps)
    busy_steps = [n for n in run.steps if n]
    compute = sum(run.compute_s) / max(1, total_steps)
    wait = sum(run.wait_s) / max(1, total_steps)
    util = run.world.utilisation(seconds)
    shard_busy = [b / seconds for b in run.shards.busy]
    step_s = seconds * len(busy_steps) / total_steps if total_steps else float("inf")
    name, why = bottleneck(shard_busy, util["cpu"], util["links"], compute, wait, step_s, run.clock_wait_s,
                           seconds * replicas, machines)
    return Prediction(
        examples_per_s=run.examples / seconds, steps_per_s=total_steps / seconds, step_s=step_s,
        compute_s=compute, wait_s=wait, staleness_mean=run.staleness_mean(),
        staleness_histogram=dict(run.shards.staleness), shard_busy=shard_busy, cpu_busy=util["cpu"],
        link_busy=util["links"], bottleneck=name, why=why, simulated_s=seconds,
        details={"replica_compute_s": run.step_s, "transport": "co-located" if run.colocated else "object store",
                 "fused": work.fused, "push_bytes": run.push_bytes, "representative_shard": run.representative, "replica_nodes": run.replica_nodes,
                 "shard_nodes": run.shards.nodes})


def bottleneck(shard_busy: list[float], cpu_busy: list[float], link_busy: dict[str, float], compute_s: float,
               wait_s: float, step_s: float, clock_wait_s: list[float], replica_seconds: float,
               machines: Machines) -> tuple[str, str]:
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
    if both:
        node, busy = max(both.items(), key=lambda kv: kv[1])
        if busy >= SATURATED:
            return (f"link of {node}", f"pushes and fetches take turns on it: busy {busy:.0%} of the time one "
                                       f"way or the other")
    if replica_seconds and sum(clock_wait_s) / replica_seconds > 0.3:
        return "staleness bound", "replicas wait for the slowest more than 30% of the time"
    if compute_s >= 0.7 * (compute_s + wait_s):
        return "replica compute", f"computing is {compute_s / (compute_s + wait_s):.0%} of a replica's step"
    return ("round trips", f"replicas wait {wait_s / (compute_s + wait_s):.0%} of a step and nothing is saturated: "
            f"per-call costs and latency")
