"""The paper at its scale: its two models and its Fig. 3 on 2012-era machines, beside the paper's own points.

Models (parameters are counted from the layer shapes; nothing is allocated):

- speech (paper §5): 440 inputs (11 frames x 40 log-energies), 4 fully connected hidden layers of 2560 sigmoid
  units, 8192 softmax outputs: 41.8 M parameters (the paper: about 42 M).
- image (paper §5): 100x100 RGB inputs, three stages of locally connected (untied) filtering over 10x10 patches,
  pooling and local contrast normalisation, then 21,841 one-vs-all logistic outputs (the ImageNet fall 2011
  release: 16 M images, "21k" classes). The paper gives "8 to 36 nodes per patch" and "up to 1.7 B parameters"
  and nothing else; our choices *(not in the paper)*: 36 nodes per patch in every stage (its largest model), patches
  one position apart, 2x2 max pooling one position apart in stages 1 and 2 and non-overlapping 7x7 max pooling in
  stage 3 (so the classifier reads a 10x10x36 map), contrast normalisation over 5x5 windows, max pooling as the
  non-linearity. Maps: 100 -> 91 -> 90 -> 81 -> 80 -> 71 -> 10; 1.672 B parameters, 95 % of them (and of the
  multiply-adds) in the locally connected layers.

Machines *(not in the paper; chosen once, not fitted to Fig. 3)*: a 2012 server of two 6-core Xeons (Westmere-EP,
2.66 GHz: 4 float32 multiply-adds per cycle with SSE, 10.6 G/s per core peak), dense layers at 5 G multiply-adds/s
per core (about half of peak) on all 12 cores; the other layer kinds at the same fraction of dense speed as the
given costs measured (``Costs.macs_per_s``); 1 Gbit/s Ethernet at the costs' link efficiency, 100 us one-way
latency, 50 us of RPC work per message; machine-speed jitter of log-sd 0.1 (a phase's compute varies by about
10 % from machine to machine: shared machines); minibatch 128 (the paper does not give one; the fixed and
per-message costs are the only thing it changes). A step with no jitter is drawn beside, for comparison.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from distbelief.partition.layers import (
    Activation,
    FullyConnected,
    LocalContrastNorm,
    LocallyConnected2d,
    Logistic,
    MaxPool,
)
from distbelief.simulate.costs import Costs
from distbelief.simulate.machines import Machines, format_bandwidth
from distbelief.simulate.partition import fig3_curve
from distbelief.simulate.profile import ModelProfile, profile_layers

SPEECH_HIDDEN, SPEECH_LAYERS, SPEECH_CLASSES = 2560, 4, 8192
IMAGE_SIZE, IMAGE_PATCH, IMAGE_NODES_PER_PATCH, IMAGE_CLASSES = 100, 10, 36, 21841

# 2012-era machines (module docstring)
CORES = 12
DENSE_MACS_PER_CORE = 5.0e9
BANDWIDTH = 1e9  # bits/s
LATENCY_S = 100e-6
CALL_S = 50e-6
JITTER = 0.1
BATCH = 128
SEED = 0

SPEECH_PARTITIONS = [1, 2, 4, 8, 16, 32]
IMAGE_PARTITIONS = [1, 2, 4, 8, 16, 32, 64, 81, 128, 144]
# What the paper reports for Fig. 3 (§3): (machines, speed-up, what the paper says of it).
PAPER_POINTS = {"speech": [(8, 2.2, "fastest: 2.2x at 8 machines, slower beyond")],
                "image": [(81, 12.0, "more than 12x at 81 machines")]}


def speech_profile() -> ModelProfile:
    """The paper's speech model, as ``models.build_partitioned`` builds ``speech-paper``: fully connected,
    partitioned by units, the softmax in the head's loss."""
    hidden = [x for _ in range(SPEECH_LAYERS) for x in (FullyConnected(SPEECH_HIDDEN), Activation("sigmoid"))]
    return profile_layers("speech 440-2560x4-8192", (1, 11 * 40), hidden + [FullyConnected(SPEECH_CLASSES)])


def image_profile() -> ModelProfile:
    """The paper's 1.7 B-parameter locally connected ImageNet model, with the choices of the module docstring."""
    layers = []
    for pool in (MaxPool(2, 1), MaxPool(2, 1), MaxPool(7)):
        layers += [LocallyConnected2d(IMAGE_NODES_PER_PATCH, IMAGE_PATCH, 1), pool, LocalContrastNorm(2)]
    layers += [FullyConnected(IMAGE_CLASSES), Logistic()]
    return profile_layers("image 3x100x100 locally connected, 21841 one-vs-all", (3, IMAGE_SIZE, IMAGE_SIZE),
                          layers)


def paper_costs(costs: Costs, local_at_dense: bool = True) -> Costs:
    """``costs`` moved to a 2012 machine: every layer kind's rate scaled by the same factor, so that dense layers
    run at ``DENSE_MACS_PER_CORE`` per core (the measured ratios between kinds are kept; no model's own timed
    step), and ``CALL_S`` per message. The other fields (fixed step costs, link efficiency) stay as measured.

    ``local_at_dense``: locally connected layers at the dense rate too. Ours run a few percent of the dense rate
    (many small matrix products from Python); DistBelief's were written for the image model, and a locally
    connected layer is the same multiply-adds over patches, so the paper-scale curve assumes its kernels as
    efficient as its dense ones. ``fig3_paper`` draws the image model both ways."""
    scale = DENSE_MACS_PER_CORE / costs.macs_per_s["dense"]
    rates = {k: v * scale for k, v in costs.macs_per_s.items()}
    if local_at_dense:
        rates["local"] = rates["dense"]
    # (the steps timed here are this machine's, not the 2012 server's: every model runs at the scaled rates)
    return dataclasses.replace(costs, machine=f"2012 server scaled from {costs.machine or 'costs'}",
                               macs_per_s=rates, call_s=CALL_S, call_cpu_s=CALL_S, step_measured={})


def paper_machines(nodes: int) -> Machines:
    return Machines(nodes=nodes, cores_per_node=CORES, bandwidth=BANDWIDTH, latency_s=LATENCY_S)


def assumptions(costs: Costs, machines: Machines) -> dict:
    """The numbers behind the curves, for the JSON and the figure's caption."""
    return {"cores_per_machine": machines.cores_per_node,
            "macs_per_s_per_core": dict(costs.macs_per_s), "bandwidth": format_bandwidth(machines.bandwidth),
            "link_efficiency": costs.link_efficiency, "latency_s": machines.latency_s, "call_s": costs.call_s,
            "step_s": costs.step_s, "example_s": costs.example_s, "jitter": JITTER, "batch": BATCH, "seed": SEED}


def fig3_paper(costs: Costs) -> dict:
    """Fig. 3 at the paper's scale for both models: speed-up per machine count with ``JITTER`` and without,
    the paper's points, and how long each model's curve took to compute."""
    measured = costs
    costs = paper_costs(measured)
    results: dict = {"figure": "fig3-paper-scale", "assumptions": assumptions(costs, paper_machines(1)),
                     "models": []}
    for key, profile, counts, kind_costs in (
            ("speech", speech_profile(), SPEECH_PARTITIONS, costs),
            ("image", image_profile(), IMAGE_PARTITIONS, costs),
            ("image, our locally connected kernels", image_profile(), IMAGE_PARTITIONS,
             paper_costs(measured, local_at_dense=False))):
        machines = paper_machines(max(counts))
        started = time.perf_counter()
        rows = fig3_curve(profile, counts, BATCH, kind_costs, machines, JITTER, seed=SEED)
        results["models"].append({
            "key": key, "name": profile.name, "params": profile.params, "macs_per_example": profile.macs,
            "local_macs_per_s": kind_costs.macs_per_s["local"],
            "paper": [{"P": P, "speedup": s, "says": says} for P, s, says in PAPER_POINTS[key.split(",")[0]]],
            "rows": rows, "compute_wall_s": time.perf_counter() - started})
    return results


def plot_fig3(results: dict, path: str | Path) -> Path:
    """Two panels (speech, image): the simulated speed-up with and without jitter, and the paper's points; the
    assumptions in the caption."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for m in results["models"]:
        ax = axes[0 if m["key"] == "speech" else 1]
        counts = [r["P"] for r in m["rows"]]
        variant = "" if "," not in m["key"] else f" ({m['key'].split(', ', 1)[1]})"
        local = f", locally connected at {m['local_macs_per_s'] / 1e9:.2g} G/s" if m["key"] != "speech" else ""
        ax.plot(counts, [r["speedup"] for r in m["rows"]], "-o",
                label=f"simulated, jitter {results['assumptions']['jitter']:g}{variant}{local}")
        if variant:
            continue
        ax.plot(counts, [r["speedup_no_jitter"] for r in m["rows"]], "--.", label="simulated, no jitter")
        for pt in m["paper"]:
            ax.plot(pt["P"], pt["speedup"], "r*", markersize=14, label=f"paper: {pt['says']}")
        ax.set(xlabel="machines per model replica", ylabel="training step speed-up vs 1 machine",
               title=f"{m['key']}: {m['params'] / 1e6:,.0f} M parameters")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    a = results["assumptions"]
    rates = ", ".join(f"{k} {v / 1e9:.2g}" for k, v in a["macs_per_s_per_core"].items())
    fig.suptitle("Fig. 3 at paper scale (simulated). Assumed 2012 machine: "
                 f"{a['cores_per_machine']} cores, G multiply-adds/s per core: {rates};\n{a['bandwidth']} links at "
                 f"{a['link_efficiency']:.0%}, {a['latency_s'] * 1e6:g} us latency, {a['call_s'] * 1e6:g} us per "
                 f"message; jitter log-sd {a['jitter']:g}; batch {a['batch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def paper_scale(out_dir: str | Path, costs: Costs) -> dict:
    """Fig. 3 at paper scale from ``costs``: writes ``fig3-paper-scale.json`` and ``.png`` into ``out_dir`` and
    returns the results."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = fig3_paper(costs)
    (out / "fig3-paper-scale.json").write_text(json.dumps(results, indent=1) + "\n")
    plot_fig3(results, out / "fig3-paper-scale.png")
    return results


# ---------------------------------------------------------------------- throughput vs replicas
REPLICA_COUNTS = [1, 10, 20, 50, 100, 200, 500, 1000, 2000]
SHARD_COUNTS = [1, 10, 50, 100, 200, 500]
FED = 0.9  # "kept fed": within this share of the most examples/s any shard count gave
PORTIONS_PER_REPLICA = 16  # Sandblaster's batch: this many 128-example portions per replica


def replicas_sweep(costs: Costs, replica_counts: list[int] | None = None, shard_counts: list[int] | None = None,
                   steps: int = 8, log=lambda m: None) -> dict:
    """Downpour (Adagrad, the paper's n_fetch = n_push = 1) and Sandblaster throughput of the speech model
    against replicas, each replica and each shard on a 2012 machine of its own (``paper_machines``), for every
    shard count: the examples/s, the bottleneck, and the fewest shards that keep the replicas fed (within
    ``FED`` of the best shard count). Sandblaster's batch is ``PORTIONS_PER_REPLICA`` portions of ``BATCH`` per
    replica, so its portions still balance at 2,000 replicas."""
    from distbelief.config import RunConfig
    from distbelief.simulate.predict import simulate
    from distbelief.simulate.workload import Workload

    costs = paper_costs(costs)
    profile = speech_profile()
    out: dict = {"figure": "replicas-paper-scale", "assumptions": assumptions(costs, paper_machines(1)),
                 "model": profile.name, "params": profile.params, "strategies": {}}
    for strategy in ("downpour", "sandblaster"):
        rows = []
        for r in replica_counts or REPLICA_COUNTS:
            points = []
            for s in shard_counts or SHARD_COUNTS:
                cfg = RunConfig(task="speech", model="speech-paper", strategy=strategy, replicas=r, shards=s,
                                batch_size=BATCH, lbfgs_batch=BATCH * PORTIONS_PER_REPLICA * r,
                                portion_size=BATCH)
                work = Workload.from_config(cfg, profile)
                p = simulate(work, paper_machines(r + s), costs, steps=steps if strategy == "downpour" else 40,
                             warmup_steps=3)
                points.append({"shards": s, "examples_per_s": p.examples_per_s, "bottleneck": p.bottleneck,
                               "staleness_mean": p.staleness_mean})
                log(f"paper scale: {strategy} {r} replicas x {s} shards: {p.examples_per_s:,.0f} examples/s "
                    f"({p.bottleneck})")
            best = max(x["examples_per_s"] for x in points)
            fed = min((x for x in points if x["examples_per_s"] >= FED * best), key=lambda x: x["shards"])
            rows.append({"replicas": r, "points": points, "best_examples_per_s": best, "shards_to_feed": fed["shards"],
                         "fed_examples_per_s": fed["examples_per_s"], "fed_bottleneck": fed["bottleneck"]})
        out["strategies"][strategy] = rows
    return out


def plot_replicas(results: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, (strategy, rows) in zip(axes, results["strategies"].items()):
        reps = [r["replicas"] for r in rows]
        shard_counts = [p["shards"] for p in rows[0]["points"]]
        for i, s in enumerate(shard_counts):
            ax.plot(reps, [r["points"][i]["examples_per_s"] for r in rows], "-", lw=1, alpha=0.6,
                    label=f"{s} shards")
        ax.plot(reps, [r["fed_examples_per_s"] for r in rows], "ko", label="fewest shards within 90% of best")
        for r in rows:
            ax.annotate(str(r["shards_to_feed"]), (r["replicas"], r["fed_examples_per_s"]), fontsize=7,
                        xytext=(3, -10), textcoords="offset points")
        ax.set(xscale="log", yscale="log", xlabel="model replicas", ylabel="examples/s",
               title=f"{strategy}: speech model, {results['params'] / 1e6:.0f} M parameters")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    a = results["assumptions"]
    fig.suptitle(f"Throughput vs replicas at paper scale (simulated): each replica and shard a 2012 machine of "
                 f"{a['cores_per_machine']} cores, {a['bandwidth']} links; numbers: shards that keep them fed",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
