"""What the default durability and evaluation cost Downpour on the paper's model, back to back on this machine.

Runs Downpour (2 replicas x 2 shards, everything else at the defaults) on the 42M-parameter speech model with:
  default            durability snapshot, evaluation on its default cadence (the settings a user gets)
  durability-off     --durability off
  durability-log     --durability log (write-ahead log of every push)
  no-eval            only the final evaluation (--eval-every-seconds 1e6)
  off-and-no-eval    both off: the reference the issue's "<= 3 %" targets are measured against
interleaved for ``--repeats`` rounds; prints each variant's median examples/s, its ratio to the reference, and the
bytes the log wrote. Results: benchmarks/results/defaults-cost-DATE.json.

    .venv/bin/python benchmarks/defaults_cost.py [--seconds 40] [--repeats 2]
"""

from __future__ import annotations

import argparse
import shutil
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from distbelief import RunConfig
from distbelief.api import train_task
from distbelief.bench.machine import machine_info

MODEL = dict(task="speech", model="speech-paper", num_classes=8192, batch_size=128)
VARIANTS = {
    "default": {},
    "durability-off": dict(durability="off"),
    "durability-log": dict(durability="log"),
    "no-eval": dict(eval_every_seconds=1e6),
    "off-and-no-eval": dict(durability="off", eval_every_seconds=1e6),
}
REFERENCE = "off-and-no-eval"


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run(name: str, seconds: float, work: Path, rnd: int) -> dict:
    out = work / f"{name}-{rnd}"
    cfg = RunConfig(strategy="downpour", replicas=2, shards=2, max_seconds=seconds, out=str(out), **MODEL,
                    **VARIANTS[name])
    s = train_task(cfg, quiet=True).summary
    row = {"variant": name, "round": rnd, "examples_per_s": s["examples_per_s"], "wall_s": s["wall_s"],
           "evaluation": s.get("evaluation"), "durability": s.get("durability"),
           "checkpoint_bytes": disk_bytes(out / "checkpoints") if (out / "checkpoints").exists() else 0,
           "evaluations": len((out / "metrics.jsonl").read_text().splitlines())}
    print(f"[defaults-cost] {name} round {rnd}: {row['examples_per_s']:,.0f} examples/s, "
          f"{row['checkpoint_bytes'] / 2**20:,.0f} MiB on disk, {row['evaluations']} evaluations", file=sys.stderr,
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="distbelief-defaults-cost-") as tmp:
        for rnd in range(1, args.repeats + 1):
            for name in VARIANTS:
                rows.append(run(name, args.seconds, Path(tmp), rnd))
                shutil.rmtree(Path(tmp) / f"{name}-{rnd}" / "checkpoints", ignore_errors=True)  # GBs with the log
    med = {n: statistics.median(r["examples_per_s"] for r in rows if r["variant"] == n) for n in VARIANTS}
    ref = med[REFERENCE]
    table = ["| variant | median examples/s | vs durability off + no evaluation | on disk (max) |",
             "|---|---|---|---|"]
    for n in VARIANTS:
        disk = max(r["checkpoint_bytes"] for r in rows if r["variant"] == n)
        table.append(f"| {n} | {med[n]:,.0f} | {med[n] / ref:.3f} | {disk / 2**20:,.0f} MiB |")
    print("\n".join(table))
    date = time.strftime("%Y-%m-%d")
    result = {"date": date, "machine": machine_info(), "model": MODEL, "seconds": args.seconds,
              "repeats": args.repeats, "variants": VARIANTS, "runs": rows, "median_examples_per_s": med,
              "ratio_to_reference": {n: med[n] / ref for n in VARIANTS}, "table": table}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"defaults-cost-{date}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
