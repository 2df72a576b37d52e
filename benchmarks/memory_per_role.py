"""Memory per role of a Downpour run, measured (docs/choosing-settings.md, "Memory").

    .venv/bin/python benchmarks/memory_per_role.py [--model speech-paper] [--seconds 30] [--out FILE.json]

Not a test. Runs Downpour with the defaults (2 replicas x 2 shards on the local Ray instance, the model's task)
and, at every evaluation, reads each role's process memory with psutil: RSS, USS (memory only that process
holds) and PSS (its share of memory it shares with others, e.g. the shards' /dev/shm state mapped by every
replica), from /proc/PID/smaps_rollup (Linux). Reports the largest value seen per role, the driver included, and the size of /dev/shm files the run
created. The test-side probe (distbelief.testing.Faults.on_evaluation) is how it finds the roles' processes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import ray

from distbelief import RunConfig
from distbelief.api import train_task
from distbelief.testing import Faults

MiB = 2**20


def memory(pid: int) -> dict[str, float]:
    """RSS, USS (private pages) and PSS of a process, from Linux's /proc/PID/smaps_rollup (kB)."""
    kb = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        kb[name] = int(value.split()[0])
    uss = kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)
    return {"rss_mib": kb["Rss"] / 1024, "uss_mib": uss / 1024, "pss_mib": kb["Pss"] / 1024}


def shm_mib() -> float:
    return sum(p.stat().st_size for p in Path("/dev/shm").glob("distbelief*") if p.is_file()) / MiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="speech-paper")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--out", default="benchmarks/results/memory-per-role.json")
    args = ap.parse_args()
    peak: dict[str, dict[str, float]] = {}
    pids: dict[str, int] = {}

    def probe(trainer, record):
        if not pids:
            for k, role in enumerate(trainer.shards):
                pids[f"shard {k}"] = ray.get(role.handle.pid.remote())
            for rid, st in trainer.replicas.items():
                pids[f"replica {rid}"] = ray.get(st.role.handle.pid.remote())
            pids["driver"] = os.getpid()
        for name, pid in pids.items():
            try:
                now = memory(pid)
            except OSError:  # the process is gone
                continue
            peak[name] = {k: max(v, peak.get(name, {}).get(k, 0.0)) for k, v in now.items()}
        peak.setdefault("/dev/shm", {"size_mib": 0.0})
        peak["/dev/shm"]["size_mib"] = max(peak["/dev/shm"]["size_mib"], shm_mib())

    task = {"speech-paper": dict(task="speech", model="speech-paper", num_classes=8192, batch_size=128)}.get(
        args.model, dict(model=args.model))
    cfg = RunConfig(**task, max_seconds=args.seconds, eval_every_seconds=5.0, out="")
    t0 = time.time()
    res = train_task(cfg, hooks=Faults(on_evaluation=probe))
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)), "model": args.model,
           "num_parameters": res.summary["num_parameters"], "replicas": res.summary["replicas"],
           "shards": res.summary["shards"], "examples_per_s": res.summary["examples_per_s"],
           "replicas_colocated": res.summary.get("replicas_colocated"), "peak": peak}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print("| role | RSS MiB | USS MiB | PSS MiB |\n|---|---|---|---|")
    for name, m in peak.items():
        if "rss_mib" in m:
            print(f"| {name} | {m['rss_mib']:,.0f} | {m['uss_mib']:,.0f} | {m['pss_mib']:,.0f} |")
    print(f"/dev/shm: {peak['/dev/shm']['size_mib']:,.0f} MiB; {res.summary['num_parameters']:,} parameters; "
          f"wrote {args.out}")


if __name__ == "__main__":
    main()
