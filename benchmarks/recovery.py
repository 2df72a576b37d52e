"""Recovery figures (issue 5): an undisturbed run, a run whose parameter shard is killed, a run whose replica is
killed — same seed, same time budget, Ray runtime — in one invocation.

Reports, per kill: time from the kill to the restored role, updates lost, and final/best accuracy against the
undisturbed run. Usage: python benchmarks/recovery.py [--seconds 40] [--kill-at 10] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import ray
import torch

from distbelief import RunConfig
from distbelief.api import train_task
from distbelief.testing import Faults


def run(name: str, seconds: float, kill_at: int, out: Path, **faults) -> dict:
    cfg = RunConfig(runtime="ray", replicas=2, shards=2, batch_size=64, max_seconds=seconds, eval_every_seconds=2,
                    checkpoint_every_seconds=5, durability="log", seed=1, out=str(out / name))
    s = train_task(cfg, quiet=True, hooks=Faults(**faults)).summary
    ev = s.get("events", [])
    killed = [e for e in ev if e["event"].endswith("killed")]
    back = [e for e in ev if e["event"] in ("shard restored", "replica restarted")]
    row = {
        "run": name, "final_test_accuracy": s["final_test_accuracy"], "best_test_accuracy": s["best_test_accuracy"],
        "updates": s["updates"], "examples_per_s": s["examples_per_s"], "updates_lost": s["updates_lost"],
        "shard_restarts": s["shard_restarts"], "replica_restarts": s["replica_restarts"],
        "recovered_after_s": (back[0]["wall_s"] - killed[0]["wall_s"]) if killed and back else None,
        "events": ev,
    }
    print(json.dumps({k: v for k, v in row.items() if k != "events"}), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=40)
    ap.add_argument("--kill-at", type=int, default=1000, help="the run's step (all replicas together) of the kill")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    out = Path(args.out)
    # The runs' own directories (checkpoints, logs) are scratch: only the summary JSON is kept.
    scratch = tempfile.TemporaryDirectory(prefix="distbelief-recovery-")
    work = Path(scratch.name)
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    rows = [
        run("undisturbed", args.seconds, args.kill_at, work),
        run("shard-kill", args.seconds, args.kill_at, work, kill_shard_at_step=args.kill_at, kill_shard_id=1),
        run("replica-kill", args.seconds, args.kill_at, work, kill_replica_at_step=args.kill_at, kill_replica_id=1),
    ]
    ray.shutdown()
    result = {"date": time.strftime("%Y-%m-%d"), "machine": {"cores": os.cpu_count(), "cpu": platform.processor(),
              "torch": torch.__version__, "ray": ray.__version__}, "seconds": args.seconds, "kill_at": args.kill_at,
              "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"recovery-{time.strftime('%Y-%m-%d')}.json"
    path.write_text(json.dumps(result, indent=2))
    scratch.cleanup()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
