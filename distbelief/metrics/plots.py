"""Plots of run directories: test accuracy and train loss vs wall-clock time, one or more runs overlaid in one
PNG. Matplotlib is imported only when a plot is drawn."""

from __future__ import annotations

import json
from pathlib import Path

from distbelief.metrics.rundir import read_metrics


def plot_runs(run_dirs: list[str | Path], out_png: str | Path) -> Path:
    """Overlay test accuracy (and train loss) vs wall-clock time of one or more runs into one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
    for d in run_dirs:
        recs = read_metrics(d)
        label = Path(d).name
        summ = Path(d) / "summary.json"
        if summ.is_file():
            s = json.loads(summ.read_text())
            label = f"{label} ({s.get('strategy')}, {s.get('replicas')}r)"
        t = [r["wall_s"] for r in recs]
        ax_acc.plot(t, [r.get("test_accuracy") for r in recs], marker=".", label=label)
        ax_loss.plot(t, [r.get("train_loss") for r in recs], marker=".", label=label)
    ax_acc.set(xlabel="wall-clock time (s)", ylabel="test accuracy", title="test accuracy")
    ax_loss.set(xlabel="wall-clock time (s)", ylabel="train loss", title="training loss")
    ax_acc.grid(alpha=0.3)
    ax_loss.grid(alpha=0.3)
    ax_acc.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
