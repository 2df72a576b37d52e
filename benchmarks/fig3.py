"""The paper's Fig. 3 on this machine: speedup of one training step vs partitions per model replica.

    .venv/bin/python benchmarks/fig3.py [--steps 5] [--partitions 1 2 4 8] [--out benchmarks/results]

For P in --partitions, each model runs as P Ray partition actors (one torch thread each: one partition = one
"machine" of one core) exchanging boundary activations and gradients; we time ``--steps`` forward+backward steps
on a fixed minibatch after one warm-up step, and report speedup = time(P=1) / time(P), plus the bytes each
partition sends per step. Models:

  (a) fully connected speech model, scaled: 440-1024x4-4096 sigmoid, softmax (every layer needs every unit)
  (b) locally connected image model on 96x96 inputs: 5x5 and 3x3 untied filter banks, pooling, LCN
      (compute per partition >> its halo)

Writes a PNG with both curves, a JSON with the numbers, and appends a dated section to benchmarks/RESULTS.md.
Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent


def speech_fc(P: int):
    from distbelief.partition import Activation, FullyConnected, PartitionedModel

    layers = [x for _ in range(4) for x in (FullyConnected(1024), Activation("sigmoid"))] + [FullyConnected(4096)]
    return PartitionedModel((440,), layers, P)


def lc_image(P: int):
    """The paper's image model in miniature at 96x96 (the paper used 100x100): untied 5x5 and 3x3 filter banks,
    pooling, LCN. At this size a partition's compute (area) dominates its halo traffic (perimeter)."""
    from distbelief.partition import (
        Activation,
        FullyConnected,
        LocalContrastNorm,
        LocallyConnected2d,
        MaxPool,
        PartitionedModel,
    )

    layers = [LocallyConnected2d(32, 5, 1), Activation("relu"), MaxPool(2), LocalContrastNorm(1),
              LocallyConnected2d(64, 3, 1), Activation("relu"), MaxPool(2), MaxPool(2), FullyConnected(8)]
    return PartitionedModel((1, 96, 96), layers, P)


MODELS = {
    "speech-fc 440-1024x4-4096": (speech_fc, (440,), 4096, 128),
    "lc-image 1x96x96": (lc_image, (1, 96, 96), 8, 32),
}


def measure(runtime, make, input_shape, classes, batch, P, steps):
    from distbelief.partition.executor import StepWorkerRecipe
    from distbelief.runtime.partition_groups import create_partition_group

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, *input_shape, generator=g), torch.randint(0, classes, (batch,), generator=g)
    role = create_partition_group(runtime, 0, StepWorkerRecipe(partial(make, P), F.cross_entropy), None, None,
                                  1, P)
    try:
        runtime.call(role, "broadcast", "timed_steps", x, y, 1).result(600)  # warm-up
        res = runtime.call(role, "broadcast", "timed_steps", x, y, steps).result(1200)
    finally:
        runtime.call(role, "close").result(60)
        runtime.kill(role)
    seconds = max(r["seconds"] for r in res) / steps  # lockstep: the slowest partition sets the pace
    n_params = sum(p.numel() for p in make(1).parameters())
    return {"P": P, "step_s": seconds, "num_parameters": n_params,
            "bytes_per_step": [r["bytes_per_step"] for r in sorted(res, key=lambda r: r["partition_id"])],
            "messages_per_step": [r["messages_per_step"] for r in sorted(res, key=lambda r: r["partition_id"])]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--partitions", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args()
    import ray

    from distbelief.runtime.ray_runtime import RayRuntime

    # address="local": always a fresh local instance sized for P=max, never a cluster left running elsewhere
    ray.init(address="local", num_cpus=max(args.partitions), include_dashboard=False, logging_level="ERROR")
    runtime = RayRuntime(remote_timeout_s=600)
    results = {}
    for name, (make, shape, classes, batch) in MODELS.items():
        rows = []
        for P in args.partitions:
            row = measure(runtime, make, shape, classes, batch, P, args.steps)
            row["speedup"] = rows[0]["step_s"] / row["step_s"] if rows else 1.0
            rows.append(row)
            print(f"{name:28s} P={P}: {row['step_s'] * 1e3:8.1f} ms/step  speedup {row['speedup']:.2f}x  "
                  f"sent {sum(row['bytes_per_step']) / 1e6:7.2f} MB/step", flush=True)
        results[name] = {"batch": batch, "rows": rows}
    ray.shutdown()

    date = time.strftime("%Y-%m-%d")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": date, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "ray": ray.__version__, "steps": args.steps, "command": "python benchmarks/fig3.py " +
            " ".join(f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()
                     if k != "out")}
    (out / f"fig3-{date}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in results.items():
        ax.plot([row["P"] for row in r["rows"]], [row["speedup"] for row in r["rows"]], marker="o", label=name)
    ax.plot(args.partitions, [min(p, os.cpu_count() or 1) for p in args.partitions], ":", color="grey",
            label=f"ideal on {os.cpu_count()} cores")
    ax.set(xlabel="partitions per model replica", ylabel="step speedup vs 1 partition", xscale="log", xticks=[],
           title=f"Fig. 3 on this machine ({os.cpu_count()} cores)")
    ax.set_xticks(args.partitions, [str(p) for p in args.partitions])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = out / f"fig3-{date}.png"
    fig.savefig(png, dpi=100)

    lines = [f"\n## Fig. 3 — step speedup vs partitions ({date})\n",
             f"- machine: {os.cpu_count()} cores, Python {meta['python']}, torch {meta['torch']}, Ray {meta['ray']}",
             f"- command: `{meta['command']}`; plot `{png.relative_to(ROOT.parent)}`", "",
             "| model | P | ms/step | speedup | MB sent/step (all partitions) |", "|---|---|---|---|---|"]
    for name, r in results.items():
        for row in r["rows"]:
            lines.append(f"| {name} (batch {r['batch']}) | {row['P']} | {row['step_s'] * 1e3:.1f} | "
                         f"{row['speedup']:.2f}x | {sum(row['bytes_per_step']) / 1e6:.2f} |")
    with open(ROOT / "RESULTS.md", "a") as f:
        if f.tell() == 0:
            f.write("# Benchmark results\n\nDated reports; newest last. Benchmarks are not tests.\n")
        f.write("\n".join(lines) + "\n")
    print(f"wrote {png}, {out / f'fig3-{date}.json'} and a section of {ROOT / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
