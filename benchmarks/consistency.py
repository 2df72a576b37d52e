"""The consistency knob measured: Fig. 4's time to target for each mode, and sync's backup replicas against a
straggler. Not a test.

Part 1 (``--part fig4``): the Fig. 4 recipe (``distbelief bench fig4``: speech-tiny, 8192 Zipf classes, the shared
single-process SGD warmstart, time to 13 % test accuracy) with Downpour-Adagrad's calibrated settings on 2
replicas, run under each mode: async (the default), ssp with s = 1 and s = 3, sync, sync with one backup replica
(3 replica processes), and async with staleness-aware rates. Each run's staleness histogram (the shards'
``staleness_histogram``) and accuracy curve go into one plot.

Part 2 (``--part straggler``): 3 replica processes, one slowed 4x (``testing.Faults(straggler_id,
straggler_slowdown)``): the step rate of plain sync (R = 3) against sync with R = 2 + 1 backup, and for context
async and ssp (s = 1). Steps per second of training time, with the same model as part 1.

Every setting a run does not name is the default a user gets (durability snapshot, evaluation auto).

    .venv/bin/python benchmarks/consistency.py [--part fig4|straggler|all] [--out DIR] [--max-seconds S]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from distbelief.bench.recipes import FULL, method_settings
from distbelief.bench.sweep import Sweep

HERE = Path(__file__).resolve().parent

MODES = {  # mode name -> settings on top of Fig. 4's downpour-adagrad on 2 replicas
    "async": {},
    "ssp s=1": {"consistency": "ssp", "staleness_bound": 1},
    "ssp s=3": {"consistency": "ssp", "staleness_bound": 3},
    "sync": {"consistency": "sync"},
    "sync + 1 backup": {"consistency": "sync", "backup_replicas": 1},
    "async staleness-aware": {"staleness_aware": True},
}
BUCKETS = ("0", "1", "2", "3", "4-7", "8-15", "16-31", "32+")


def fig4_modes(out: Path, max_seconds: float, log=print) -> list[dict]:
    sweep = Sweep("consistency", FULL, out, cores=2, quick=False, log=log)
    sweep.warmstart()
    rows = []
    for mode, extra in MODES.items():
        settings = dict(method_settings(FULL, "downpour-adagrad", 2), **extra)
        settings.update(init_params=sweep.warm["run_dir"], max_seconds=max_seconds,
                        target_accuracy=FULL.target_accuracy)
        log(f"[consistency] {mode}: up to {max_seconds:.0f}s, target {FULL.target_accuracy}")
        r = sweep.run_one(mode.replace(" ", "_").replace("+", "plus").replace("=", ""), settings)
        s = r["summary"]
        rows.append({
            "mode": mode, "settings": extra, "time_to_target_s": s.get("time_to_target_s"),
            "final_test_accuracy": s["final_test_accuracy"], "best_test_accuracy": s["best_test_accuracy"],
            "examples_per_s": s["examples_per_s"], "wall_s": s["wall_s"],
            "staleness_mean": s.get("staleness_mean"), "staleness_max": s.get("staleness_max"),
            "staleness_histogram": s.get("staleness_histogram"), "clock_gap_max": s.get("clock_gap_max"),
            "clock_waits": s.get("clock_waits"), "dropped_gradients": s.get("dropped_gradients"),
            "curve": [(m["wall_s"], m["test_accuracy"]) for m in r["metrics"]],
        })
        ttt = s.get("time_to_target_s")
        log(f"[consistency] {mode}: time to {FULL.target_accuracy}: "
            f"{'not reached' if ttt is None else f'{ttt:.1f}s'}, best {s['best_test_accuracy']:.4f}, "
            f"{s['examples_per_s']:.0f} examples/s, staleness mean {s.get('staleness_mean') or 0:.2f}")
    return rows


def straggler(out: Path, steps: int, log=print) -> list[dict]:
    from distbelief import RunConfig
    from distbelief.api import train_task
    from distbelief.testing import Faults

    common = dict(FULL.common, optimizer="adagrad", lr=0.5, adagrad_initial_accumulator=0.1, shards=2, threads=1,
                  eval_every_seconds=3600.0, runtime="ray")
    # sync: a fixed number of steps; async/ssp: a time budget (each replica runs its own steps, so a step count
    # would end the run with the straggler's last step)
    budget = dict(max_seconds=20.0, max_steps=0)
    conditions = [
        ("sync, R=3", dict(consistency="sync", replicas=3, max_steps=steps, max_seconds=0.0)),
        ("sync, R=2 + 1 backup", dict(consistency="sync", replicas=2, backup_replicas=1, max_steps=steps,
                                      max_seconds=0.0)),
        ("async, 3 replicas", dict(replicas=3, **budget)),
        ("ssp s=1, 3 replicas", dict(replicas=3, consistency="ssp", staleness_bound=1, **budget)),
    ]
    rows = []
    for name, extra in conditions:
        run_dir = out / "straggler" / name.replace(" ", "_").replace(",", "").replace("+", "plus")
        cfg = RunConfig(**common, **extra, out=str(run_dir))
        res = train_task(cfg, quiet=True, hooks=Faults(straggler_id=2, straggler_slowdown=4.0))
        s = res.summary
        # sync: lockstep steps per second (one update per shard per step); async/ssp: a replica's mean steps/s
        if s["strategy"] == "sync":
            step_rate = s["updates"] / common["shards"] / s["wall_s"]
        else:
            step_rate = sum(s["steps_per_replica"]) / len(s["steps_per_replica"]) / s["wall_s"]
        rows.append({"condition": name, "steps_per_s": step_rate, "wall_s": s["wall_s"],
                     "steps_per_replica": s["steps_per_replica"], "updates": s["updates"],
                     "examples_per_s": s["examples_per_s"], "dropped_gradients": s.get("dropped_gradients"),
                     "clock_waits": s.get("clock_waits"), "clock_gap_max": s.get("clock_gap_max")})
        log(f"[straggler] {name}: {step_rate:.2f} steps/s over {s['wall_s']:.1f}s, "
            f"{s['examples_per_s']:.0f} examples/s, dropped {s.get('dropped_gradients')}")
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in rows:
        if r["curve"]:
            t, a = zip(*r["curve"])
            ax1.plot(t, a, label=r["mode"])
    ax1.axhline(FULL.target_accuracy, color="grey", ls=":", lw=1)
    ax1.set_xlabel("training time (s)")
    ax1.set_ylabel("test accuracy")
    ax1.set_title("Fig. 4 setup, 2 replicas: accuracy by consistency mode")
    ax1.legend(fontsize=8)
    width = 0.8 / max(1, len(rows))
    x = np.arange(len(BUCKETS))
    for i, r in enumerate(rows):
        h = np.asarray(r["staleness_histogram"] or [0] * len(BUCKETS), dtype=float)
        ax2.bar(x + i * width, h / max(1.0, h.sum()), width, label=r["mode"])
    ax2.set_xticks(x + 0.4 - width / 2, BUCKETS)
    ax2.set_xlabel("staleness of an applied update (updates)")
    ax2.set_ylabel("fraction of updates")
    ax2.set_title("staleness histogram")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("fig4", "straggler", "all"), default="all")
    ap.add_argument("--out", default=str(HERE / "results" / f"consistency-{time.strftime('%Y-%m-%d')}"))
    ap.add_argument("--max-seconds", type=float, default=FULL.max_seconds)
    ap.add_argument("--steps", type=int, default=120, help="straggler: steps per run")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    results["machine"] = {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                          "date": time.strftime("%Y-%m-%d %H:%M")}
    if args.part in ("fig4", "all"):
        rows = fig4_modes(out, args.max_seconds)
        results["fig4"] = {"target_accuracy": FULL.target_accuracy, "max_seconds": args.max_seconds, "modes": rows}
        plot(rows, out / "consistency.png")
    if args.part in ("straggler", "all"):
        rows = straggler(out, args.steps)
        by = {r["condition"]: r for r in rows}
        ratio = by["sync, R=2 + 1 backup"]["steps_per_s"] / by["sync, R=3"]["steps_per_s"]
        results["straggler"] = {"slowdown": 4.0, "steps": args.steps, "conditions": rows,
                                "backup_vs_plain_sync": ratio, "goal": 1.5}
        print(f"[straggler] sync + 1 backup vs plain sync: {ratio:.2f}x (goal >= 1.5x)")
    results_path.write_text(json.dumps(results, indent=1))
    print(f"wrote {results_path}")


if __name__ == "__main__":
    main()
