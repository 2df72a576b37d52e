"""Plots of a prediction: where a replica's step goes, and how busy every resource is."""

from __future__ import annotations

from distbelief.simulate.outcome import SATURATED, Prediction


def plot_prediction(pred: Prediction, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"shard {k}" for k in range(len(pred.shard_busy))]
    names += ["cores" if len(pred.cpu_busy) == 1 else f"cores {p}" for p in range(len(pred.cpu_busy))]
    names += list(pred.link_busy)
    busy = list(pred.shard_busy) + list(pred.cpu_busy) + list(pred.link_busy.values())
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [1, 3]})
    a.bar(["step"], [pred.compute_s * 1e3], label="compute")
    a.bar(["step"], [pred.wait_s * 1e3], bottom=[pred.compute_s * 1e3], label="waiting")
    a.set_ylabel("ms per replica step")
    a.legend()
    a.set_title(f"{pred.examples_per_s:,.0f} examples/s")
    b.bar(range(len(busy)), [100 * x for x in busy], color=["C3" if x >= SATURATED else "C0" for x in busy])
    b.axhline(100 * SATURATED, color="grey", ls="--", lw=1)
    b.set_xticks(range(len(busy)), names, rotation=60, ha="right", fontsize=7)
    b.set_ylabel("% busy")
    b.set_ylim(0, 105)
    b.set_title(f"bottleneck: {pred.bottleneck}")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
