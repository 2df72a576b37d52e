"""``distbelief plan``: the Downpour settings the simulator predicts to be fastest on a cluster, and why.

The search, for a model on ``nodes`` machines of ``cores`` cores linked at ``bandwidth``:

- partitions per replica: 1, and 2, 4, 8 for models that can be split (each partition on a machine of its own);
- shards: 1, 2, 4, ... up to a quarter of the machines (at least 1), each on a machine of its own where there is
  room;
- replicas: as many as the machines left hold (one replica's partitions per machine group), and half of that
  (fewer replicas can be faster when the shards or links are the limit);
- n_fetch = n_push: 1 and 4; compression: none, and top-k 1 % with delta fetches when any link is in play.

Every combination is simulated; they are ranked by examples/s. Throughput is not accuracy: more replicas and
rarer fetches mean staler gradients (the prediction's staleness says how much), and compression changes what a
push carries, so the report names the staleness and compression of each suggestion next to its speed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from distbelief.config import RunConfig
from distbelief.exceptions import ConfigError
from distbelief.simulate.costs import Costs
from distbelief.simulate.machines import Machines, format_bandwidth
from distbelief.simulate.predict import simulate
from distbelief.simulate.profile import TASK_INPUT, profile_model
from distbelief.simulate.workload import Workload


def _task_of(model: str) -> str:
    if model.startswith("speech"):
        return "speech"
    if model.startswith("lc-image"):
        return "shapes"
    return "mnist1d"


def candidates(nodes: int, partitionable: bool, linked: bool) -> list[dict]:
    """The settings tried on ``nodes`` machines (see the module docstring)."""
    out = []
    shard_counts = sorted({1} | {s for s in (2, 4, 8, 16, 32, 64, 128) if s <= max(1, nodes // 4)})
    for parts in (1, 2, 4, 8) if partitionable else (1,):
        for shards in shard_counts:
            room = nodes - shards if nodes > shards else nodes
            most = max(1, room // parts)
            for replicas in sorted({most, max(1, most // 2)}):
                for every in (1, 4):
                    for compress in (("none", "none"), ("topk", "delta")) if linked else (("none", "none"),):
                        out.append({"partitions": parts, "shards": shards, "replicas": replicas,
                                    "fetch_every": every, "push_every": every, "compress": compress[0],
                                    "compress_fetch": compress[1]})
    return out


def plan(model: str, machines: Machines, costs: Costs, *, task: str | None = None, num_classes: int | None = None,
         batch_size: int | None = None, steps: int = 30, log: Callable[[str], None] = lambda m: None) -> dict:
    """Simulate every candidate setting of ``model`` on ``machines``; the results, fastest first."""
    from distbelief.models import PARTITIONABLE

    task = task or _task_of(model)
    if task not in TASK_INPUT:
        raise ConfigError("task", f"plan knows the shapes of {', '.join(TASK_INPUT)}; got {task!r}")
    base = RunConfig(task=task, model=model, num_classes=num_classes, batch_size=batch_size).normalized()
    profile = profile_model(model, task, base.num_classes)
    linked = machines.nodes > 1 and not math.isinf(machines.bandwidth)
    tried = []
    todo = candidates(machines.nodes, model in PARTITIONABLE, linked)
    log(f"plan: {len(todo)} settings of {model} ({profile.params / 1e6:.2f}M parameters) on {machines.describe()}")
    for i, c in enumerate(todo):
        cfg = dataclasses.replace(base, **c)
        try:
            work = Workload.from_config(cfg, profile)
        except ConfigError:
            continue
        p = simulate(work, machines, costs, steps=steps, warmup_steps=5)
        tried.append({"settings": c, "examples_per_s": p.examples_per_s, "staleness_mean": p.staleness_mean,
                      "bottleneck": p.bottleneck, "why": p.why, "step_s": p.step_s, "compute_s": p.compute_s})
        if (i + 1) % 20 == 0:
            log(f"plan: {i + 1}/{len(todo)} simulated")
    tried.sort(key=lambda t: -t["examples_per_s"])
    return {"model": model, "task": task, "parameters": profile.params, "batch_size": base.batch_size,
            "machines": machines.describe(), "bandwidth": format_bandwidth(machines.bandwidth),
            "costs": costs.machine, "settings": tried}


def plan_report(result: dict, machines: Machines, top: int) -> str:
    rows = result["settings"][:top]
    if not rows:
        return "plan: no setting could be simulated"
    lines = [f"plan for {result['model']} ({result['parameters'] / 1e6:.2f}M parameters, batch "
             f"{result['batch_size']}) on {result['machines']}",
             f"{'#':>2} {'replicas':>8} {'shards':>6} {'parts':>5} {'n_fetch/push':>12} {'compress':>11} "
             f"{'examples/s':>11} {'stale':>6}  bottleneck"]
    for i, r in enumerate(rows, 1):
        s = r["settings"]
        comp = "none" if s["compress"] == "none" else f"{s['compress']}+{s['compress_fetch']}"
        lines.append(f"{i:>2} {s['replicas']:>8} {s['shards']:>6} {s['partitions']:>5} {s['fetch_every']:>12} "
                     f"{comp:>11} {r['examples_per_s']:>11,.0f} {r['staleness_mean']:>6.2f}  {r['bottleneck']}")
    best = rows[0]
    s = best["settings"]
    lines.append("")
    lines.append(f"suggested: --replicas {s['replicas']} --shards {s['shards']} --partitions {s['partitions']} "
                 f"--fetch-every {s['fetch_every']} --push-every {s['push_every']}"
                 + (f" --compress {s['compress']} --compress-fetch {s['compress_fetch']}"
                    if s["compress"] != "none" else ""))
    lines.append(f"why: {best['examples_per_s']:,.0f} examples/s predicted; it is limited by {best['bottleneck']} "
                 f"({best['why']}); a replica's step is {best['step_s'] * 1e3:.1f} ms, "
                 f"{best['compute_s'] / best['step_s']:.0%} of it computing.")
    if best["staleness_mean"] > 4:
        lines.append(f"note: mean staleness {best['staleness_mean']:.1f} updates: Adagrad on the shards and a "
                     f"warmstart keep Downpour stable at this much (the paper's recipe); check accuracy with a "
                     f"short run.")
    return "\n".join(lines)
