"""The benchmark tables of README.md (and of any Markdown file given), rendered from the results.json they cite.

    .venv/bin/python benchmarks/readme_tables.py            # rewrite every marked table in README.md
    .venv/bin/python benchmarks/readme_tables.py --check    # exit 1 (and show the difference) if one disagrees
    .venv/bin/python benchmarks/readme_tables.py --check README.md benchmarks/RESULTS.md

A table is marked in the Markdown by two comment lines; everything between them is generated:

    <!-- table: benchmarks/results/throughput-2026-12-05-defaults/results.json -->
    ...
    <!-- end table -->

The paths are relative to the repository root. What is rendered depends on the file: a `bench throughput` record
gives one row per method and one column per model (median examples/s and its ratio to single-process SGD with one
thread); a `bench fig4` record gives benchmarks/table.py's fig4 table (per method over its runs: the smoothed
crossing's median and min–max, its ratios to single-process SGD, the first crossing, examples/s, best accuracy);
several `bench fig4` records on one marker line (space-separated) give one row per record: Downpour + Adagrad
against single-process SGD with 1 and with all threads, the paper's ordering as each sweep measured it. Each
table starts with a line naming its files, dates, machine and protocol. tests/unit/test_readme_tables.py runs
``--check`` on the repository's README.md and RESULTS.md, so a number edited by hand, or a results.json that
changed, fails the tests. Not a benchmark: it reads records, it measures nothing.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from table import fig4_table  # benchmarks/table.py, beside this file

from distbelief.bench.targets import method_summaries, spread_text

START = re.compile(r"^<!-- table: (?P<paths>\S+(?: \S+)*) -->$")
END = "<!-- end table -->"

# Column names of the throughput models (their results.json labels are long); an unknown model keeps its key.
MODEL_COLUMNS = {"paper": "paper's speech model (42M parameters)", "fig4": "Fig. 4 model (2.3M, 8192 classes)",
                 "ctr": "click model (dlrm-small, 23.7M)", "quick": "quick (tiny)"}


class TableError(Exception):
    pass


def _date(res: dict) -> str:
    return str(res.get("date") or res["machine"].get("date", "?"))


def _machine(res: dict) -> str:
    m = res["machine"]
    return f"{m['cores']} cores ({m['cpu_model']}), torch {m['torch']}, Ray {m['ray']}"


def throughput_table(res: dict, rel: str) -> list[str]:
    models = list(res["models"])
    methods = list(res["methods"])
    head = (f"_From `{rel}` ({_date(res)}; {_machine(res)}): median of {res['repeats']} × "
            f"{res['max_seconds']:.0f} s per method, interleaved; each cell is examples/s (× single-process SGD, "
            f"1 thread)._")
    out = [head, "", "| method | " + " | ".join(MODEL_COLUMNS.get(m, m) for m in models) + " |",
           "|---" * (len(models) + 1) + "|"]
    for method in methods:
        label, cells = None, []
        for model in models:
            entry = res["models"][model]["methods"].get(method)
            if entry is None:
                cells.append("—")
                continue
            label = label or entry["label"]
            med = entry["median_examples_per_s"]
            base = res["models"][model]["methods"].get("sgd-1", {}).get("median_examples_per_s")
            cells.append("—" if med is None else f"{med:,.0f}" + (f" ({med / base:.2f}×)" if base else ""))
        label = (label or method).replace(" x ", " × ")
        if method == "downpour":
            label, cells = f"**{label}**", [f"**{c}**" for c in cells]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def fig4_block(res: dict, rel: str) -> list[str]:
    runs = {r["method"]: 0 for r in res["runs"]}
    for r in res["runs"]:
        runs[r["method"]] += 1
    n = sorted(set(runs.values()))
    per = "–".join(map(str, (n[0], n[-1]) if len(n) > 1 else n[:1]))
    stat = (f"{per} runs per method, median (min–max)" if max(n) > 1 else
            "one run per method (no spread measured)")
    head = (f"_From `{rel}` ({_date(res)}; {_machine(res)}): {stat}; target "
            f"{res['target_accuracy']:.2f} test accuracy from a shared warmstart at {res['warmstart']['test_accuracy']:.3f}; "
            f"smoothed crossing = the first evaluation at which the median of the 5 evaluations centred on it "
            f"reaches the target._")
    return [head, ""] + fig4_table(res)


def fig4_ordering(records: list[tuple[str, dict]]) -> list[str]:
    """One row per fig4 record: the smoothed crossing of sgd-1, sgd-all and downpour-adagrad (median, min–max)
    and Downpour + Adagrad's ratios to the two (medians), with the first crossing's ratio beside them."""
    head = ("_One row per `bench fig4` record: seconds to the target by the smoothed crossing (the first evaluation "
            "at which the median of the 5 evaluations centred on it reaches the target; median (min–max) where a "
            "record holds several runs of a method), and the ratio of Downpour + Adagrad's (DA) median to each "
            "single-process SGD's; the last column is the same ratio on the first evaluation at the target._")
    columns = ("| record | runs per method | SGD 1 thread | SGD 2 threads | Downpour + Adagrad | DA / SGD 1 thread | "
               "DA / SGD 2 threads | DA / SGD 2 threads, first crossing |")
    out = [head, "", columns, "|---|---|---|---|---|---|---|---|"]
    for rel, res in records:
        rows = {m["method"]: m for m in method_summaries(res["runs"], res["target_accuracy"])}
        need = ("sgd-1", "sgd-all", "downpour-adagrad")
        if not all(k in rows for k in need):
            raise TableError(f"{rel}: a fig4 record without {', '.join(k for k in need if k not in rows)}")
        one, two, da = (rows[k] for k in need)

        def ratio(a, b):
            return f"{a / b:.2f}×" if a is not None and b else "—"

        runs = sorted({m["runs"] for m in rows.values()})
        out.append(f"| `{Path(rel).parent.name}` | {'–'.join(map(str, runs))} | {spread_text(one['smoothed'])} | "
                   f"{spread_text(two['smoothed'])} | {spread_text(da['smoothed'])} | "
                   f"{ratio(da['smoothed']['median'], one['smoothed']['median'])} | "
                   f"{ratio(da['smoothed']['median'], two['smoothed']['median'])} | "
                   f"{ratio(da['first']['median'], two['first']['median'])} |")
    return out


def _load(rel: str, root: Path) -> dict:
    path = root / rel
    if not path.is_file():
        raise TableError(f"{rel}: no such results file")
    return json.loads(path.read_text())


def render(rels: list[str], root: Path = ROOT) -> list[str]:
    records = [(rel, _load(rel, root)) for rel in rels]
    if len(records) > 1:
        if any(res.get("figure") != "fig4" for _, res in records):
            raise TableError(f"{' '.join(rels)}: several files on one marker must all be `bench fig4` records")
        return fig4_ordering(records)
    rel, res = records[0]
    if res.get("benchmark") == "throughput":
        return throughput_table(res, rel)
    if res.get("figure") == "fig4":
        return fig4_block(res, rel)
    raise TableError(f"{rel}: not a `bench throughput` or `bench fig4` record (nothing to render)")


def regenerate(text: str, where: str = "", root: Path = ROOT) -> str:
    """``text`` with every marked table rendered afresh from its file."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        out.append(lines[i])
        m = START.match(lines[i].strip())
        i += 1
        if not m:
            continue
        try:
            j = next(k for k in range(i, len(lines)) if lines[k].strip() == END)
        except StopIteration:
            raise TableError(f"{where}: `{lines[i - 1].strip()}` has no `{END}` after it") from None
        out += render(m["paths"].split(), root)
        out.append(lines[j])
        i = j + 1
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", default=["README.md"], help="Markdown files (default README.md)")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table disagrees with its file")
    p.add_argument("--root", default=str(ROOT), help="where the tables' paths start (default: the repository)")
    args = p.parse_args(argv)
    root, bad = Path(args.root), 0
    for name in args.files:
        f = Path(name) if Path(name).is_absolute() or Path(name).exists() else root / name
        text = f.read_text()
        try:
            new = regenerate(text, str(f), root)
        except TableError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if new == text:
            continue
        if args.check:
            bad += 1
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                       f"{f} (as written)", f"{f} (from the results files)"))
        else:
            f.write_text(new)
            print(f"rewrote the tables of {f}")
    if bad:
        print(f"{bad} file(s) disagree with their results files: run benchmarks/readme_tables.py to regenerate",
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
