"""Calibration behind the Fig. 4/5 recipe (distbelief/bench/recipes.toml, [full]): which rates, cadences and target.

    .venv/bin/python benchmarks/calibrate_fig4.py --seconds 150 [--variants NAME ...]

Runs the recipe's warmstart once, then each variant (a method's settings with one change) from it for --seconds,
and reports, per variant, examples/s and the training time to reach each candidate target accuracy. The variants
run back to back; repeat a variant (e.g. sgd-1 first and last) to see the machine's drift. Output:
benchmarks/results/fig4-calibration-DATE.json. docs/reproducing.md records what was chosen from it and why.
Not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from distbelief.bench.machine import machine_info
from distbelief.bench.recipes import FULL, method_settings
from distbelief.bench.sweep import Sweep
from distbelief.bench.targets import series_of

TARGETS = (0.12, 0.13, 0.14, 0.15, 0.16, 0.17, 0.18)


def variants(cores: int) -> dict[str, dict]:
    m = lambda name, **kw: dict(method_settings(FULL, name, 1 if name == "sgd-1" else cores), **kw)  # noqa: E731
    return {
        "sgd-1 lr=1": m("sgd-1", lr=1.0),
        "sgd-1 lr=2": m("sgd-1", lr=2.0),
        "sgd-all lr=2": m("sgd-all", lr=2.0),
        "adagrad-all g=0.5": m("adagrad-all", lr=0.5, adagrad_initial_accumulator=0.1),
        "downpour-adagrad g=0.5 n=1": m("downpour-adagrad", lr=0.5, adagrad_initial_accumulator=0.1),
        "downpour-adagrad g=0.5 n=2": m("downpour-adagrad", lr=0.5, adagrad_initial_accumulator=0.1,
                                        fetch_every=2, push_every=2),
        "downpour-adagrad g=0.5 n=4": m("downpour-adagrad", lr=0.5, adagrad_initial_accumulator=0.1,
                                        fetch_every=4, push_every=4),
        "downpour-adagrad g=0.5 n=4 a=0.5": m("downpour-adagrad", lr=0.5, adagrad_initial_accumulator=0.1,
                                              fetch_every=4, push_every=4, local_lr=0.5),
        "downpour-adagrad g=0.3 n=1 k=1": m("downpour-adagrad", lr=0.3, adagrad_initial_accumulator=0.1, shards=1),
        "downpour-adagrad g=0.5 n=1 overlap": m("downpour-adagrad", lr=0.5, adagrad_initial_accumulator=0.1,
                                                overlap=True),
        "downpour-adagrad g=0.5 n=1 sync-fetch": m("downpour-adagrad", lr=0.5, adagrad_initial_accumulator=0.1,
                                                   overlap=False),
        "downpour-adagrad g=0.3 n=1 sync-fetch": m("downpour-adagrad", lr=0.3, adagrad_initial_accumulator=0.1,
                                                   overlap=False),
        "downpour-adagrad g=1 n=1 sync-fetch": m("downpour-adagrad", lr=1.0, adagrad_initial_accumulator=0.1,
                                                 overlap=False),
        "downpour-sgd lr=2 n=1 sync-fetch": m("downpour-sgd", lr=2.0, overlap=False),
        "downpour-sgd lr=1 n=1": m("downpour-sgd", lr=1.0),
        "downpour-sgd lr=2 n=1": m("downpour-sgd", lr=2.0),
        "hogwild lr=2": m("hogwild", lr=2.0),
        "ddp lr=2": m("ddp", lr=2.0),
        "ddp lr=4": m("ddp", lr=4.0),
        "sandblaster b=16384": m("sandblaster"),
        "sandblaster b=4096": m("sandblaster", lbfgs_batch=4096, portion_size=512),
        "sandblaster b=2048": m("sandblaster", lbfgs_batch=2048, portion_size=256),
    }


def main() -> None:
    import os

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=150.0)
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--variants", nargs="+", default=None)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    all_variants = variants(args.cores)
    chosen = args.variants or list(all_variants)
    for v in chosen:
        if v not in all_variants:
            raise SystemExit(f"unknown variant {v!r}; choose from: {', '.join(all_variants)}")
    scratch = Path("/tmp") / f"distbelief-calibration-{os.getpid()}"
    recipe = dataclasses.replace(FULL, max_seconds=args.seconds)
    sweep = Sweep("calibration", recipe, scratch, args.cores, quick=True)
    from distbelief.runtime.ray_runtime import connect

    connect(num_cpus=args.cores)
    sweep.warmstart()
    rows = []
    for v in chosen:
        settings = dict(all_variants[v], init_params=sweep.warm["run_dir"], max_seconds=args.seconds,
                        target_accuracy=0.0)
        r = sweep.run_one(v.replace(" ", "_").replace("=", ""), settings)
        s = series_of(r["metrics"])
        tta = {str(t): next((w for w, a in zip(s["wall_s"], s["test_accuracy"]) if a >= t), None) for t in TARGETS}
        row = {"variant": v, "examples_per_s": r["summary"]["examples_per_s"],
               "best_test_accuracy": r["summary"]["best_test_accuracy"], "time_to": tta,
               "staleness_mean": r["summary"].get("staleness_mean"), "series": s, "settings": settings}
        rows.append(row)
        print(f"{v:36s} {row['examples_per_s']:8.0f} ex/s  best {row['best_test_accuracy']:.4f}  "
              + "  ".join(f"{t}:{'-' if x is None else f'{x:.0f}s'}" for t, x in tta.items()), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"fig4-calibration-{time.strftime('%Y-%m-%d')}.json"
    path.write_text(json.dumps({"machine": machine_info(), "seconds": args.seconds, "warmstart": sweep.warm,
                                "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
