"""Shard failover (``--durability replicate``) measured on a fake multi-node Ray cluster. Not a test.

The cluster: a head with no CPUs (the driver) and two worker nodes offering the dedicated-shard resource, 2 CPUs
each, so that each shard's primary and backup sit on different nodes and the 2 replicas fill one CPU of each.
Every run has the same seed, model (the default mnist1d MLP), 2 replicas x 2 shards and time budget:

- ``undisturbed``: no failure;
- ``kills``: ``--kills`` primaries killed in a row (their processes; the i-th kill hits shard i mod 2), one every
  ``--every`` steps of the run from step ``--kill-at``;
- ``node``: at the first evaluation, the node hosting shard 0's primary is removed (a fresh node joins, as an
  autoscaler would bring one).

Reported per run: final and best accuracy, updates lost, re-sent pushes recognised, and per failover the time from
the kill (or the node's removal) to the backup serving, and the time to copy the shard to a new backup.

    .venv/bin/python benchmarks/failover.py [--seconds 60] [--kills 20] [--out benchmarks/results/failover-DATE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import ray

from distbelief import RunConfig
from distbelief.api import train_task
from distbelief.runtime.local_cluster import fake_cluster
from distbelief.runtime.ray_runtime import SHARD_NODE_RESOURCE, SYSTEM_CONFIG, RayRuntime
from distbelief.testing import Faults


def settings(seconds: float, out: Path, name: str) -> RunConfig:
    return RunConfig(runtime="ray", replicas=2, shards=2, batch_size=128, max_seconds=seconds, eval_every_seconds=2,
                     durability="replicate", max_shard_restarts=1000, seed=1, out=str(out / name))


def summarize(name: str, s: dict, removed_at: float | None = None) -> dict:
    ev = s["events"]
    kills = [e["wall_s"] for e in ev if e["event"] == "shard killed"]
    if removed_at is not None:
        kills = [removed_at]
    overs = [e["wall_s"] for e in ev if e["event"] == "shard failed over"]
    copies = [e["copy_s"] for e in ev if e["event"] == "backup replaced"]
    latencies = [o - k for k, o in zip(kills, overs)]
    row = {
        "run": name, "final_test_accuracy": s["final_test_accuracy"], "best_test_accuracy": s["best_test_accuracy"],
        "updates": s["updates"], "examples_per_s": s["examples_per_s"], "wall_s": s["wall_s"],
        "kills": len(kills), "failovers": s["shard_restarts"], "updates_lost": s["updates_lost"],
        "duplicate_pushes": s["duplicate_pushes"], "backups_replaced": s["backups_replaced"],
        "failover_s": [round(x, 3) for x in latencies],
        "failover_s_median": round(statistics.median(latencies), 3) if latencies else None,
        "failover_s_max": round(max(latencies), 3) if latencies else None,
        "backup_copy_s_median": round(statistics.median(copies), 3) if copies else None,
        "backup_copy_s_max": round(max(copies), 3) if copies else None,
    }
    print(json.dumps(row), flush=True)
    return {**row, "events": ev}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--kill-at", type=int, default=100, help="the run's step (all replicas together) of the 1st kill")
    ap.add_argument("--every", type=int, default=50, help="steps between two kills")
    ap.add_argument("--out", default=f"benchmarks/results/failover-{time.strftime('%Y-%m-%d')}")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    c = fake_cluster(num_cpus=0, _system_config=SYSTEM_CONFIG)
    nodes = [c.add_node(num_cpus=2, resources={SHARD_NODE_RESOURCE: 1}) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="ERROR")
    rows = []
    try:
        def one(name: str, faults: Faults, removed: dict | None = None) -> None:
            runtime = RayRuntime(remote_timeout_s=60)
            try:
                s = train_task(settings(args.seconds, out, name), quiet=True, runtime=runtime, hooks=faults).summary
            finally:
                runtime.shutdown()
            rows.append(summarize(name, s, (removed or {}).get("wall_s")))

        one("undisturbed", Faults())
        one("kills", Faults(kill_shard_at_step=args.kill_at, kill_shard_times=args.kills,
                            kill_shard_every_steps=args.every))
        removed: dict = {}

        def remove_node_of_shard_0(trainer, record):
            if removed:
                return
            rt = trainer.runtime
            primary, backup = rt.node_of(trainer.server.roles[0]), rt.node_of(trainer.server.backups[0])
            node = next(n for n in nodes if n.node_id == primary)
            removed.update(node=primary, backup_node=backup, wall_s=trainer.clock.elapsed())
            c.remove_node(node)
            nodes.append(c.add_node(num_cpus=2, resources={SHARD_NODE_RESOURCE: 1}))

        one("node", Faults(on_evaluation=remove_node_of_shard_0), removed)
        rows[-1]["removed"] = removed
    finally:
        ray.shutdown()
        c.shutdown()
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "args": vars(args), "runs": rows}
    (out / "failover.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'failover.json'}")


if __name__ == "__main__":
    main()
