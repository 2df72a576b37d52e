"""A/B Downpour's throughput between two checkouts of distbelief, interleaved.

    .venv/bin/python benchmarks/ab_checkouts.py OLD_CHECKOUT NEW_CHECKOUT [--rounds 5] [--seconds 40]
        [--model fig4-recipe | paper | fig4]

``fig4-recipe`` (the default): the Fig. 4 Downpour + Adagrad recipe. ``paper`` / ``fig4``: `distbelief bench
throughput`'s Downpour method on that model, with the defaults (2 replicas x 2 shards): the no-regression guard.

e.g. ``git worktree add /tmp/old HEAD~1`` and compare it with this checkout. Each run is a fresh process with
``PYTHONPATH`` set to its checkout (so the Ray workers it starts import the same code). The order alternates
each round (A B, B A, A B, ...): measured here, the second run of a pair is ~5% slower than the first whichever
checkout it is (the machine warms), so a fixed order biases the ratio; use an even number of rounds. Run-to-run
noise here is 5-20%, so read the medians and means over rounds, not one run.
Prints one JSON line per run and a summary; writes nothing else. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# Each checkout's own Fig. 4 recipe for Downpour + Adagrad on 2 cores, from scratch (throughput only).
RUN = r"""
import json, os, sys
import ray
from distbelief import RunConfig
from distbelief.api import train_task
try:
    from distbelief.bench.recipes import FULL, method_settings
except ImportError:  # a checkout from before the recipes had a module of their own
    from distbelief.bench.accuracy import FULL, method_settings
if sys.argv[2] == "fig4-recipe":
    cfg = dict(method_settings(FULL, "downpour-adagrad", 2), max_seconds=float(sys.argv[1]))
else:  # bench throughput's Downpour on that model: the defaults
    from distbelief.bench.throughput import METHODS, MODELS
    cfg = dict(MODELS[sys.argv[2]], **METHODS["downpour"], max_seconds=float(sys.argv[1]))
ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
s = train_task(RunConfig(**cfg), quiet=True).summary
print("RESULT " + json.dumps({k: s.get(k) for k in ("examples_per_s", "staleness_mean", "best_test_accuracy")}))
"""


def run_once(checkout: Path, seconds: float, model: str = "fig4-recipe") -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", RUN, str(seconds), model], cwd=checkout, env=env,
                         capture_output=True,
                         text=True, timeout=seconds + 600)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"run in {checkout} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path, help="checkout A (e.g. the old code)")
    ap.add_argument("b", type=Path, help="checkout B (e.g. this checkout)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--model", default="fig4-recipe", choices=("fig4-recipe", "paper", "fig4"))
    args = ap.parse_args()
    for c in (args.a, args.b):
        if not (c / "distbelief" / "__init__.py").is_file():
            ap.error(f"{c} is not a distbelief checkout (no distbelief/__init__.py); make one with "
                     f"`git worktree add {c} <commit>`")
    rates = {"a": [], "b": []}
    for i in range(args.rounds):
        for key in (("a", "b") if i % 2 == 0 else ("b", "a")):
            r = run_once(getattr(args, key), args.seconds, args.model)
            rates[key].append(r["examples_per_s"])
            print(json.dumps({"round": i + 1, "checkout": key, **r}), flush=True)
    ma, mb = statistics.mean(rates["a"]), statistics.mean(rates["b"])
    da, db = statistics.median(rates["a"]), statistics.median(rates["b"])
    wins = sum(b > a for a, b in zip(rates["a"], rates["b"]))
    print(json.dumps({"model": args.model, "a_mean_examples_per_s": round(ma), "b_mean_examples_per_s": round(mb),
                      "b_over_a": round(mb / ma, 3), "a_median": round(da), "b_median": round(db),
                      "b_over_a_median": round(db / da, 3), "b_wins_rounds": f"{wins}/{args.rounds}"}))


if __name__ == "__main__":
    main()
