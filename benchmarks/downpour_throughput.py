"""Downpour throughput vs single-process SGD on the paper's 42M-parameter speech model, in one run.

Runs, back to back on the same machine and data: single-process SGD with 1 torch thread, with 2 threads, and
Downpour (Adagrad on the shards) with R replicas x 1 thread and K shards; each for the same wall-clock budget.
Reports examples/s and the ratios to the 1-thread and 2-thread single process (the brief's baselines).

Usage: python benchmarks/downpour_throughput.py [--seconds 40] [--model speech-paper] [--batch-size 128]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import ray
import torch

from distbelief import RunConfig
from distbelief.api import train_task


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=40)
    ap.add_argument("--model", default="speech-paper")
    ap.add_argument("--classes", type=int, default=8192)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    base = dict(task="speech", model=args.model, num_classes=args.classes, num_samples=20000,
                batch_size=args.batch_size, max_seconds=args.seconds, eval_every_seconds=10 * args.seconds,
                optimizer="adagrad", lr=0.002, seed=0, durability="off")
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR",
             _system_config={"max_direct_call_object_size": 512 * 1024})
    rows = []

    def record(name, cfg):
        s = train_task(RunConfig(**cfg), quiet=True).summary
        rows.append({"run": name, "examples_per_s": s["examples_per_s"], "wall_s": s["wall_s"],
                     "staleness_mean": s.get("staleness_mean")})
        print(json.dumps(rows[-1]), flush=True)

    record("sgd-1thread", {**base, "strategy": "sgd", "threads": 1})
    record("sgd-2threads", {**base, "strategy": "sgd", "threads": 2})
    for k in args.shards:
        record(f"downpour-{args.replicas}x1-{k}shards",
               {**base, "strategy": "downpour", "replicas": args.replicas, "shards": k, "threads": 1})
    record("sgd-1thread-again", {**base, "strategy": "sgd", "threads": 1})  # drift check: same run repeated
    ray.shutdown()
    one = (rows[0]["examples_per_s"] + rows[-1]["examples_per_s"]) / 2
    two = rows[1]["examples_per_s"]
    for r in rows:
        r["vs_sgd_1thread"] = r["examples_per_s"] / one
        r["vs_sgd_2threads"] = r["examples_per_s"] / two
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": {"cores": os.cpu_count(),
              "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
              "ray": ray.__version__}, "args": vars(args), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"downpour-throughput-{time.strftime('%Y-%m-%d')}.json"
    path.write_text(json.dumps(result, indent=2))
    for r in rows:
        print(f"{r['run']:28s} {r['examples_per_s']:8.1f} ex/s  x{r['vs_sgd_1thread']:.2f} vs 1 thread  "
              f"x{r['vs_sgd_2threads']:.2f} vs 2 threads")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
