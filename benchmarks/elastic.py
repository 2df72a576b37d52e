"""Elastic Downpour's latencies on a fake multi-node Ray cluster (``ray.cluster_utils.Cluster``). Not a test.

One 1-CPU node to start with; the run is ``--replicas 1:3`` (so 1 replica). After ``--join-at`` seconds of training
a 2-CPU node joins (two replicas are added there); after ``--leave-at`` seconds it is removed (they are removed).
Measured: from the node joining (``add_node`` returned and the node registered) to each added replica's first
applied push, and from the node's removal to each of its replicas being removed while replica 0 goes on. The
same run without the node joining is the undisturbed run the accuracy is compared with (same time budget).

    .venv/bin/python benchmarks/elastic.py [--repeats 3] [--seconds 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import ray

from distbelief import RunConfig
from distbelief.api import train_task
from distbelief.runtime.local_cluster import fake_cluster
from distbelief.runtime.ray_runtime import SYSTEM_CONFIG, RayRuntime
from distbelief.testing import Faults

HERE = Path(__file__).resolve().parent


def one_run(out: Path, seconds: float, join_at: float | None, leave_at: float) -> dict:
    c = fake_cluster(num_cpus=0, _system_config=SYSTEM_CONFIG)
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="ERROR")
    seen: dict = {}

    def probe(trainer, record):
        if join_at is not None and "join" not in seen and record["wall_s"] >= join_at:
            seen["node"] = c.add_node(num_cpus=2)
            c.wait_for_nodes()
            seen["join"] = time.time()
        elif "join" in seen and "leave" not in seen and record["wall_s"] >= leave_at:
            seen["steps0_at_leave"] = trainer.replicas[0].steps
            c.remove_node(seen["node"])
            seen["leave"] = time.time()

    runtime = RayRuntime(remote_timeout_s=60)
    cfg = RunConfig(runtime="ray", replicas=1, max_replicas=3, shards=2, batch_size=32, max_seconds=seconds,
                    eval_every_seconds=1.0, durability="off", out=str(out))
    try:
        s = train_task(cfg, quiet=True, runtime=runtime, hooks=Faults(on_evaluation=probe)).summary
    finally:
        runtime.shutdown()
        ray.shutdown()
        c.shutdown()
    ev = s["events"]
    added = {e["id"]: e["time"] for e in ev if e["event"] == "replica added"}
    first = {e["id"]: added[e["id"]] + e["after_s"] for e in ev if e["event"] == "replica first push"}
    removed = [e["time"] for e in ev if e["event"] == "replica removed"]
    row = {"final_test_accuracy": s["final_test_accuracy"], "best_test_accuracy": s["best_test_accuracy"],
           "steps_per_replica": s["steps_per_replica"], "events": ev, "wall_s": s["wall_s"]}
    if "join" in seen:
        row["join_to_first_push_s"] = sorted(t - seen["join"] for t in first.values())
    if "leave" in seen:
        row["leave_to_removed_s"] = sorted(t - seen["leave"] for t in removed)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--join-at", type=float, default=3.0)
    ap.add_argument("--leave-at", type=float, default=12.0)
    ap.add_argument("--out", default=str(HERE / "results" / f"elastic-{time.strftime('%Y-%m-%d')}.json"))
    args = ap.parse_args()
    work = Path("/tmp") / f"distbelief-elastic-{time.time_ns():x}"
    runs, undisturbed = [], []
    for i in range(args.repeats):
        r = one_run(work / f"elastic-{i}", args.seconds, args.join_at, args.leave_at)
        runs.append(r)
        print(f"[elastic] run {i + 1}: join -> first push {[round(x, 2) for x in r.get('join_to_first_push_s', [])]}"
              f" s, leave -> removed {[round(x, 2) for x in r.get('leave_to_removed_s', [])]} s, "
              f"accuracy {r['final_test_accuracy']:.4f}, steps {r['steps_per_replica']}", flush=True)
        u = one_run(work / f"undisturbed-{i}", args.seconds, None, args.leave_at)
        undisturbed.append(u)
        print(f"[elastic] undisturbed {i + 1}: accuracy {u['final_test_accuracy']:.4f}, steps "
              f"{u['steps_per_replica']}", flush=True)
    joins = [x for r in runs for x in r.get("join_to_first_push_s", [])]
    leaves = [x for r in runs for x in r.get("leave_to_removed_s", [])]
    summary = {
        "join_to_first_push_s": {"median": statistics.median(joins), "max": max(joins)} if joins else None,
        "leave_to_removed_s": {"median": statistics.median(leaves), "max": max(leaves)} if leaves else None,
        "accuracy_elastic": [r["final_test_accuracy"] for r in runs],
        "accuracy_undisturbed": [u["final_test_accuracy"] for u in undisturbed],
        "goal_join_to_first_push_s": 5.0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "summary": summary, "runs": runs,
                                          "undisturbed": undisturbed}, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
