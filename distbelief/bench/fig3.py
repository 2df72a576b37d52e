"""The paper's Fig. 3 on this machine: speedup of one training step vs partitions per model replica.

For each P, the model runs as P Ray partition actors (one torch thread each: one partition = one "machine" of one
core) exchanging boundary activations and gradients. We time ``steps`` forward+backward steps on a fixed
minibatch after one warm-up step and report speedup = time(P=1) / time(P), plus the bytes each partition sends per
step. Models:

  (a) fully connected speech model: 440-1024x4-4096 sigmoid, softmax (every layer needs every unit)
  (b) locally connected image model on 96x96 inputs: 5x5 and 3x3 untied filter banks, pooling, LCN
      (a partition's compute grows with its area, its halo traffic only with its perimeter)

``quick`` shrinks both models (and P to 1, 2) so that the sweep runs in seconds; its numbers show the mechanics,
not the speedups.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F


def speech_fc(P: int, width: int = 1024, depth: int = 4, classes: int = 4096):
    from distbelief.partition import Activation, FullyConnected, PartitionedModel

    layers = [x for _ in range(depth) for x in (FullyConnected(width), Activation("sigmoid"))]
    return PartitionedModel((440,), layers + [FullyConnected(classes)], P)


def lc_image(P: int, size: int = 96, c1: int = 32, c2: int = 64):
    """The paper's image model in miniature (the paper used 100x100 inputs): untied 5x5 and 3x3 filter banks,
    pooling and local contrast normalisation, then an 8-way output."""
    from distbelief.partition import (
        Activation,
        FullyConnected,
        LocalContrastNorm,
        LocallyConnected2d,
        MaxPool,
        PartitionedModel,
    )

    layers = [LocallyConnected2d(c1, 5, 1), Activation("relu"), MaxPool(2), LocalContrastNorm(1),
              LocallyConnected2d(c2, 3, 1), Activation("relu"), MaxPool(2), MaxPool(2), FullyConnected(8)]
    return PartitionedModel((1, size, size), layers, P)


@dataclass(frozen=True)
class Fig3Model:
    name: str
    kind: str  # "fully connected" | "locally connected"
    make: Callable[[int], torch.nn.Module]
    input_shape: tuple[int, ...]
    classes: int
    batch: int


def models(quick: bool) -> list[Fig3Model]:
    if quick:
        return [Fig3Model("speech-fc 440-256x2-512", "fully connected",
                          partial(speech_fc, width=256, depth=2, classes=512), (440,), 512, 32),
                Fig3Model("lc-image 1x32x32", "locally connected", partial(lc_image, size=32, c1=8, c2=16),
                          (1, 32, 32), 8, 16)]
    return [Fig3Model("speech-fc 440-1024x4-4096", "fully connected", speech_fc, (440,), 4096, 128),
            Fig3Model("lc-image 1x96x96", "locally connected", lc_image, (1, 96, 96), 8, 32)]


def partition_counts(cores: int, quick: bool) -> list[int]:
    """1, 2, 4, ... up to max(8, cores): past the core count, to show where partitioning stops paying."""
    if quick:
        return [1, 2]
    top, out, p = max(8, cores), [], 1
    while p <= top:
        out.append(p)
        p *= 2
    return out


def measure(runtime, m: Fig3Model, P: int, steps: int, timeout_s: float = 1200.0) -> dict:
    from distbelief.partition.executor import StepWorkerRecipe

    g = torch.Generator().manual_seed(0)
    x = torch.randn(m.batch, *m.input_shape, generator=g)
    y = torch.randint(0, m.classes, (m.batch,), generator=g)
    role = runtime.create_partition_group(0, StepWorkerRecipe(partial(m.make, P), F.cross_entropy), None, None,
                                          1, P)
    try:
        runtime.call(role, "broadcast", "timed_steps", x, y, 1).result(timeout_s)  # warm-up
        res = runtime.call(role, "broadcast", "timed_steps", x, y, steps).result(timeout_s)
    finally:
        runtime.call(role, "close").result(60)
        runtime.kill(role)
    res = sorted(res, key=lambda r: r["partition_id"])
    return {"P": P, "step_s": max(r["seconds"] for r in res) / steps,  # lockstep: the slowest sets the pace
            "num_parameters": sum(p.numel() for p in m.make(1).parameters()),
            "bytes_per_step": [r["bytes_per_step"] for r in res],
            "messages_per_step": [r["messages_per_step"] for r in res]}


def run_fig3(out: Path, cores: int, quick: bool, steps: int | None = None, log=print) -> dict:
    """Run the sweep; write ``results.json`` and ``fig3.png`` into ``out``; return the results."""
    from distbelief.bench.machine import machine_info
    from distbelief.bench.plots import plot_fig3
    from distbelief.runtime.ray_runtime import RayRuntime, connect

    steps = steps or (2 if quick else 6)
    counts = partition_counts(cores, quick)
    # Ray's CPU resources are logical: P partitions of one CPU each must be placeable even for P > cores.
    connect(num_cpus=max(max(counts), cores))
    runtime = RayRuntime(remote_timeout_s=1200)
    started = time.time()
    results: dict = {"figure": "fig3", "quick": quick, "machine": machine_info(), "steps": steps,
                     "partitions": counts, "models": []}
    try:
        for m in models(quick):
            rows: list[dict] = []
            for P in counts:
                row = measure(runtime, m, P, steps)
                row["speedup"] = rows[0]["step_s"] / row["step_s"] if rows else 1.0
                rows.append(row)
                log(f"[fig3] {m.name:28s} P={P}: {row['step_s'] * 1e3:8.1f} ms/step  speedup "
                    f"{row['speedup']:.2f}x  sent {sum(row['bytes_per_step']) / 1e6:7.2f} MB/step")
            results["models"].append({"name": m.name, "kind": m.kind, "batch": m.batch, "rows": rows})
    finally:
        runtime.shutdown()
    results["wall_s"] = time.time() - started
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot_fig3(results, out / "fig3.png")
    log(f"[fig3] wrote {out / 'results.json'} and {out / 'fig3.png'}")
    return results
