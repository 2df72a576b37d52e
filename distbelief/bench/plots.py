"""The figures, drawn the way the paper draws them (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import re
from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_fig3(results: dict, out_png: Path) -> Path:
    """Step speedup vs partitions per model replica, one line per model, with the core-count ceiling."""
    plt = _plt()
    cores = results["machine"]["cores"] or 1
    counts = results["partitions"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in results["models"]:
        ax.plot([r["P"] for r in m["rows"]], [r["speedup"] for r in m["rows"]], marker="o",
                label=f"{m['name']} ({m['kind']})")
    ax.plot(counts, [min(p, cores) for p in counts], ":", color="grey", label=f"ideal on {cores} cores")
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(p) for p in counts])
    ax.set(xlabel="partitions (machines) per model replica", ylabel="training step speedup vs 1 partition",
           title=f"Fig. 3 on this machine ({cores} cores)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def plot_fig4(results: dict, out_png: Path) -> Path:
    """Test and training accuracy vs wall-clock time, one line per method, the target as a dashed line."""
    plt = _plt()
    fig, (ax_test, ax_train) = plt.subplots(1, 2, figsize=(13, 4.8), sharex=True)
    target = results["target_accuracy"]
    for run in results["runs"]:
        s = run["series"]
        label = run["label"] + (f" #{run['repeat']}" if results.get("repeats", 1) > 1 else "")
        t = run.get("time_to_target_smoothed_s", run["time_to_target_s"])  # what the targets compare
        if t is not None:
            label += f" ({t:.0f}s)"
        line, = ax_test.plot(s["wall_s"], s["test_accuracy"], marker=".", markersize=3, label=label)
        if any(v is not None for v in s.get("train_accuracy", [])):
            ax_train.plot(s["wall_s"], s["train_accuracy"], marker=".", markersize=3, color=line.get_color(),
                          label=run["label"])
    for ax, what in ((ax_test, "test"), (ax_train, "training")):
        ax.axhline(target, ls="--", color="grey", lw=1, label=f"target {target:.3f}" if what == "test" else None)
        ax.set(xlabel="training time (s)", ylabel=f"{what} accuracy", title=f"{what} accuracy")
        ax.grid(alpha=0.3)
    ax_test.legend(fontsize=7, loc="lower right")
    cores = results["cores"]
    fig.suptitle(f"Fig. 4 on this machine: {results['recipe']['label']}, {cores} cores, from a shared warmstart",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def method_name(run_label: str) -> str:
    """A run's label without its worker count ("Downpour + Adagrad, 2 replicas" -> "Downpour + Adagrad"): on
    Fig. 5 the count is the x axis."""
    return re.sub(r",? \d+ (threads?|replicas?|ranks?|workers?)\b", "", run_label)


def plot_fig5(results: dict, out_png: Path) -> Path:
    """Time to reach the target accuracy vs cores used, per method. A run that missed the target within its
    budget is drawn as an open marker at the budget, with an upward arrow: it is a lower bound, not a value."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.8))
    budget = results["recipe"]["max_seconds"]
    by_method: dict[str, list[dict]] = {}
    for run in results["runs"]:
        by_method.setdefault(run["method"], []).append(run)
    for runs in by_method.values():
        runs = sorted(runs, key=lambda r: r["cores"])
        reached = [r for r in runs if r["time_to_target_s"] is not None]
        name = method_name(runs[0]["label"])
        line, = ax.plot([r["cores"] for r in reached], [r["time_to_target_s"] for r in reached], marker="o",
                        label=name)
        missed = [r for r in runs if r["time_to_target_s"] is None]
        if missed:
            if not reached:
                line.set_label(f"{name} (missed)")
            ax.plot([r["cores"] for r in missed], [budget] * len(missed), marker="^", ls="none",
                    markerfacecolor="none", markersize=9, color=line.get_color())
    ax.axhline(budget, ls=":", color="grey", lw=1, label=f"budget {budget:.0f}s (open ^ = missed)")
    cores = sorted({r["cores"] for r in results["runs"]})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(cores, [str(c) for c in cores])
    ax.set(xlabel="cores used", ylabel=f"time to {results['target_accuracy']:.3f} test accuracy (s)",
           title=f"Fig. 5 on this machine: {results['recipe']['label']}")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
