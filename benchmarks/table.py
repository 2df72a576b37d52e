"""Markdown tables of a `distbelief bench fig4|fig5` results.json, as pasted into benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/table.py benchmarks/results/fig4-DATE/results.json

Prints what the sweep measured, nothing else: per run its throughput, staleness, time to the target and accuracy
(fig4: the first evaluation at the target, and the first at which the mean of the last 3 evaluations is at
the target, which discounts one lucky evaluation), or time to the target per method and core count (fig5), then the targets evaluated as ratios. Not a test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from distbelief.bench.targets import time_to_target


def _s(v, fmt="{:.1f}", missing="missed"):
    return missing if v is None else fmt.format(v)


def fig4_table(res: dict) -> list[str]:
    runs, target = res["runs"], res["target_accuracy"]
    first = {r["method"]: time_to_target(r["series"], target) for r in runs}
    mean3 = {r["method"]: time_to_target(r["series"], target, window=3) for r in runs}

    def vs(t, base):
        return f"{t / base:.2f}x" if t is not None and base else "—"

    out = [f"| method | examples/s | mean staleness | s to {target:.2f} (first) | vs SGD 1 thread | "
           f"s to {target:.2f} (mean of 3) | vs SGD 1 thread | best test acc | final train acc |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        m = r["method"]
        train = [a for a in r["series"]["train_accuracy"] if a is not None]
        out.append(f"| {r['label']} | {_s(r['examples_per_s'], '{:,.0f}', '—')} | "
                   f"{_s(r['staleness_mean'], '{:.2f}', '—')} | {_s(first[m])} | {vs(first[m], first.get('sgd-1'))} | "
                   f"{_s(mean3[m])} | {vs(mean3[m], mean3.get('sgd-1'))} | "
                   f"{_s(r['best_test_accuracy'], '{:.4f}', '—')} | {_s(train[-1] if train else None, '{:.4f}', '—')} |")
    return out


def fig5_table(res: dict) -> list[str]:
    runs = res["runs"]
    cores = sorted({r["cores"] for r in runs})
    methods = list(dict.fromkeys(r["method"] for r in runs))
    out = [f"| method (s to {res['target_accuracy']:.2f}; examples/s) | " + " | ".join(f"{c} core(s)" for c in cores)
           + " |", "|---|" + "---|" * len(cores)]
    for m in methods:
        cells = []
        for c in cores:
            r = next((r for r in runs if r["method"] == m and r["cores"] == c), None)
            if r is None:
                cells.append("—")
            elif r.get("error"):
                cells.append("failed")
            else:
                cells.append(f"{_s(r['time_to_target_s'], missing='missed in ' + str(int(res['recipe']['max_seconds'])) + ' s')}"
                             f"; {_s(r['examples_per_s'], '{:,.0f}', '—')}")
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    return out


def main(path: str) -> None:
    res = json.loads(Path(path).read_text())
    m = res["machine"]
    print(f"- machine: {m['cores']} cores ({m['cpu_model']}), {m['memory_gib']} GiB, Python {m['python']}, "
          f"torch {m['torch']}, Ray {m['ray']}; load average at the end {m['load_average']}")
    print(f"- recipe: {res['recipe']['label']}; target {res['target_accuracy']}, budget "
          f"{res['recipe']['max_seconds']:.0f} s per run; warmstart test accuracy {res['warmstart']['test_accuracy']}")
    print()
    print("\n".join(fig4_table(res) if res["figure"] == "fig4" else fig5_table(res)))
    print()
    for t in res["targets"]:
        state = {True: "MET", False: "NOT MET", None: "not measured"}[t["met"]]
        print(f"- {state}: {t['description']} (ratio {_s(t['ratio'], '{:.2f}', '—')}, threshold {t['threshold']})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
