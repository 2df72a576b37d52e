"""Markdown tables of a `distbelief bench fig4|fig5` results.json, as pasted into benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/table.py benchmarks/results/fig4-DATE/results.json [--first-mean3]

Prints what the sweep measured, nothing else. fig4: per method, over its runs (``--repeats``), the median and
min–max of the time to the target by the smoothed crossing (the first evaluation at which the median of the 5
evaluations centred on it is at the target; distbelief/bench/targets.py says why), its ratio to single-process
SGD's median, the first crossing, and the medians of examples/s and best test accuracy; then the targets,
evaluated on those medians. ``--first-mean3`` prints the table in the form RESULTS.md used up to 2026-12-05 (first
crossing, and the first evaluation at which the mean of the last 3 is at the target; one run per method).
fig5: time to the target per method and core count. Records made before the smoothed crossing existed get it
computed from their series. Not a test; benchmarks/readme_tables.py renders the same fig4 table into README.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from distbelief.bench.targets import (
    evaluate_targets,
    method_summaries,
    smoothed_crossing,
    spread_text,
    time_to_target,
)


def _s(v, fmt="{:.1f}", missing="missed"):
    return missing if v is None else fmt.format(v)


def _ratio(a, b) -> str:
    return f"{a / b:.2f}×" if a is not None and b else "—"


def fig4_table(res: dict) -> list[str]:
    """One row per method: medians over its runs, with min–max where it ran more than once."""
    target = res["target_accuracy"]
    rows = method_summaries(res["runs"], target)
    med = {(m["method"]): m["smoothed"]["median"] for m in rows}
    base1 = med.get("sgd-1")
    all_cores = next((m["cores"] for m in rows if m["method"] == "sgd-all"), None)
    base_all = med.get("sgd-all")
    head = (f"| method | runs | examples/s | s to {target:.2f}, smoothed crossing | vs SGD 1 thread | "
            + (f"vs SGD {all_cores} threads | " if all_cores else "")
            + f"s to {target:.2f}, first evaluation | best test acc |")
    out = [head, "|---" * (head.count("|") - 1) + "|"]
    for m in rows:
        runs = str(m["runs"]) + (f" ({m['failed']} failed)" if m["failed"] else "")
        t = m["smoothed"]["median"]
        out.append(f"| {m['label']} | {runs} | {_s(m['examples_per_s'], '{:,.0f}', '—')} | "
                   f"{spread_text(m['smoothed'])} | {_ratio(t, base1)} | "
                   + (f"{_ratio(t, base_all)} | " if all_cores else "")
                   + f"{spread_text(m['first'])} | {_s(m['best_test_accuracy'], '{:.4f}', '—')} |")
    return out


def fig4_targets(res: dict) -> list[dict]:
    """The fig4 targets on the smoothed crossing's medians (recomputed from the series for older records)."""
    runs = [r if "time_to_target_smoothed_s" in r or r.get("error") else
            dict(r, time_to_target_smoothed_s=smoothed_crossing(r["series"], res["target_accuracy"]))
            for r in res["runs"]]
    return evaluate_targets("fig4", runs, res["cores"])


def fig4_table_first_mean3(res: dict) -> list[str]:
    """The table as RESULTS.md printed it up to 2026-12-05: one run per method, first crossing and mean of 3."""
    runs, target = res["runs"], res["target_accuracy"]
    first = {r["method"]: time_to_target(r["series"], target) for r in runs}
    mean3 = {r["method"]: time_to_target(r["series"], target, window=3) for r in runs}

    def vs(t, base):
        return f"{t / base:.2f}x" if t is not None and base else "—"

    head = (f"| method | examples/s | mean staleness | s to {target:.2f} (first) | vs SGD 1 thread | "
            f"s to {target:.2f} (mean of 3) | vs SGD 1 thread | best test acc | final train acc |")
    out = [head, "|---|---|---|---|---|---|---|---|---|"]
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


def main(path: str, first_mean3: bool = False) -> None:
    res = json.loads(Path(path).read_text())
    m = res["machine"]
    print(f"- machine: {m['cores']} cores ({m['cpu_model']}), {m['memory_gib']} GiB, Python {m['python']}, "
          f"torch {m['torch']}, Ray {m['ray']}; load average at the end {m['load_average']}")
    print(f"- recipe: {res['recipe']['label']}; target {res['target_accuracy']}, budget "
          f"{res['recipe']['max_seconds']:.0f} s per run; warmstart test accuracy {res['warmstart']['test_accuracy']}")
    print()
    if res["figure"] == "fig4":
        print("\n".join(fig4_table_first_mean3(res) if first_mean3 else fig4_table(res)))
        targets = res["targets"] if first_mean3 else fig4_targets(res)
    else:
        print("\n".join(fig5_table(res)))
        targets = res["targets"]
    print()
    for t in targets:
        state = {True: "MET", False: "NOT MET", None: "not measured"}[t["met"]]
        print(f"- {state}: {t['description']} (ratio {_s(t['ratio'], '{:.2f}', '—')}, threshold {t['threshold']})")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--first-mean3"]
    if len(args) != 1:
        sys.exit(__doc__)
    main(args[0], first_mean3="--first-mean3" in sys.argv[1:])
