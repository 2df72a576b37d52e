"""``simulate(workload, machines, costs)``: a prediction of a run's throughput and where its time goes.

The prediction says examples per second, each replica's step split into compute and waiting, the staleness
distribution, how busy every shard, core pool and link is, and names the bottleneck: the busiest resource when
one is nearly saturated, else what a replica's step is mostly made of.
"""

from __future__ import annotations

from distbelief.simulate.costs import Costs
from distbelief.simulate.machines import Machines
from distbelief.simulate.outcome import Prediction, bottleneck
from distbelief.simulate.workload import Workload

REPRESENTATIVE_CALLS = 4000  # replicas x shards above which one shard stands for all (on shard-only nodes)


def simulate(work: Workload, machines: Machines, costs: Costs, *, steps: int = 60,
             warmup_steps: int = 10, representative: bool | None = None) -> Prediction:
    """Simulate ``work`` on ``machines`` with ``costs``: ``warmup_steps`` per replica to reach a steady state, then
    ``steps`` per replica measured (Sandblaster: L-BFGS iterations, at least 2).

    ``representative``: simulate shard 0 call by call and let it stand for all shards (they are alike and every
    replica talks to each); by default when replicas x shards exceeds ``REPRESENTATIVE_CALLS`` and every shard
    has a node of its own, where it changes the result by little and the time to simulate by the shard count."""
    if representative is None:
        _, shard_nodes = machines.place(work.replicas, work.shards)
        representative = (work.replicas * work.shards > REPRESENTATIVE_CALLS and not machines.shared_cores
                          and len(set(shard_nodes)) == work.shards
                          and machines.nodes >= work.replicas + work.shards)
    if work.strategy == "sandblaster":
        from distbelief.simulate.sandblaster import SandblasterRun

        run = SandblasterRun(work, machines, costs, representative=representative)
        seconds = run.run(max(2, steps // 20), 1)
        return run.prediction(seconds)
    from distbelief.simulate.downpour import DownpourRun

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
    name, why = bottleneck(shard_busy, util["cpu"], util["links"], compute, wait, run.clock_wait_s,
                           seconds * replicas)
    return Prediction(
        examples_per_s=run.examples / seconds, steps_per_s=total_steps / seconds, step_s=step_s,
        compute_s=compute, wait_s=wait, staleness_mean=run.staleness_mean(),
        staleness_histogram=dict(run.shards.staleness), shard_busy=shard_busy, cpu_busy=util["cpu"],
        link_busy=util["links"], bottleneck=name, why=why, simulated_s=seconds,
        details={"replica_compute_s": run.step_s, "transport": "co-located" if run.colocated else "object store",
                 "chained": work.chained, "push_bytes": run.push_bytes, "representative_shard": run.representative,
                 "replica_nodes": run.replica_nodes, "shard_nodes": run.shards.nodes})
