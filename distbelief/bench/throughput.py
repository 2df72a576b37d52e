"""``distbelief bench throughput``: examples/s of Downpour against the baselines a user would otherwise pick,
measured back to back in one run on this machine, **with the settings a user gets**.

Why it exists: every performance claim about the defaults is a ratio to a baseline measured on the same
machine at the same time (a number from another day or another load is not comparable). So this benchmark
sets only what names the experiment — task, model, classes, class prior, batch size — and each method's
strategy, worker counts and budget; every other setting (learning rate, durability, overlap, evaluation
cadence, ...) is the RunConfig default of the checkout being measured. If a default changes, the next run
measures the new one.

Protocol: for each model, ``repeats`` rounds; each round runs every method once, in order (interleaved, so
slow drift of the machine's load hits every method alike). A method's number is the median of its rounds'
examples/s (the run summary's ``examples_per_s``: examples over the trainer's training clock, process start-up
excluded). A run that fails is recorded with its error and the sweep goes on. ``results.json`` is rewritten
after every run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from distbelief.config import RunConfig
from distbelief.exceptions import ConfigError

# What names each model's experiment; nothing else is pinned (see the module docstring).
MODELS: dict[str, dict[str, Any]] = {
    "paper": dict(task="speech", model="speech-paper", num_classes=8192, batch_size=128),
    "fig4": dict(task="speech", model="speech-tiny", num_classes=8192, class_prior=1.0, batch_size=128),
    # Criteo-like click logs, DLRM with 26 embedding tables (tens of millions of rows x 16) held row-sharded
    "ctr": dict(task="ctr", model="dlrm-small", batch_size=128),
}
DEFAULT_MODELS = ("paper", "fig4")  # `--models ctr` measures the click model (its own methods, below)
# What a user of a model writes instead of distbelief, where it is not the method's default: for the click model,
# torch with sparse gradients and Adagrad (the model's tables are sparse=True).
MODEL_METHODS: dict[str, dict[str, dict[str, Any]]] = {
    "ctr": {"sgd-1": dict(optimizer="adagrad"), "sgd-2": dict(optimizer="adagrad")},
}
# Methods a model runs when --methods is not given (default: DEFAULT_METHODS)
MODEL_DEFAULT_METHODS: dict[str, tuple[str, ...]] = {"ctr": ("sgd-1", "sgd-2", "downpour")}
MODEL_LABELS = {
    "paper": "paper model: speech 440-2560x4-8192 sigmoid (42M parameters), 8192 classes",
    "fig4": "Fig. 4 model: speech-tiny 440-256x2-8192 sigmoid (2.3M parameters), 8192 Zipf classes",
    "ctr": "click model: dlrm-small on the ctr task (26 embedding tables, rows of 16), torch baselines with Adagrad",
    "quick": "quick: mnist1d mlp, 4000 examples (mechanics only; the numbers mean nothing)",
}
# --quick: a tiny model, so that the sweep's mechanics run in well under a minute on 2 cores (tests, CI).
QUICK_MODEL = dict(task="mnist1d", model="mlp", num_samples=4000)

# Each method's strategy and worker counts; everything else at the defaults.
METHODS: dict[str, dict[str, Any]] = {
    "sgd-1": dict(strategy="sgd", threads=1),
    "sgd-2": dict(strategy="sgd", threads=2),
    "hogwild": dict(strategy="hogwild", replicas=2),
    "downpour": dict(strategy="downpour", replicas=2, shards=2),
    "ddp": dict(strategy="ddp", replicas=2),
    # Not the default: Downpour with the baselines' update rule (like for like; never the headline ratio)
    "downpour-sgd": dict(strategy="downpour", replicas=2, shards=2, optimizer="sgd"),
    # Not the default either: the cost of shard replication, against no durability at all
    "downpour-off": dict(strategy="downpour", replicas=2, shards=2, durability="off"),
    "downpour-replicate": dict(strategy="downpour", replicas=2, shards=2, durability="replicate"),
}
METHOD_LABELS = {
    "sgd-1": "single-process SGD, 1 thread",
    "sgd-2": "single-process SGD, 2 threads",
    "hogwild": "Hogwild, 2 workers",
    "downpour": "Downpour, 2 replicas x 2 shards",
    "ddp": "torch DDP, 2 ranks",
    "downpour-sgd": "Downpour, 2 replicas x 2 shards, --optimizer sgd (not the default)",
    "downpour-off": "Downpour, 2 replicas x 2 shards, --durability off (not the default)",
    "downpour-replicate": "Downpour, 2 replicas x 2 shards, --durability replicate (not the default)",
}
DEFAULT_METHODS = ("sgd-1", "sgd-2", "hogwild", "downpour")
QUICK_METHODS = ("sgd-1", "downpour")
RAY_STRATEGIES = ("downpour", "sync", "sandblaster")

# The issue's targets: Downpour's median examples/s over the baseline's, at least the threshold.
TARGETS: dict[str, list[tuple[str, float]]] = {
    "paper": [("sgd-1", 1.8), ("sgd-2", 1.1), ("hogwild", 1.1)],
    "fig4": [("sgd-1", 1.7), ("hogwild", 0.95)],
    "ctr": [("sgd-1", 1.6), ("sgd-2", 1.0)],
}
TARGETS["quick"] = TARGETS["paper"]  # evaluated for the structure only: quick numbers mean nothing


@dataclass(frozen=True)
class Plan:
    """What one invocation measures: resolved from the options, validated before any run starts."""

    quick: bool
    models: list[str]
    methods: list[str]
    repeats: int
    max_seconds: float
    address: str = ""  # a Ray cluster for the Ray strategies; the local baselines run on this machine

    def settings(self, model: str, method: str) -> dict[str, Any]:
        """The only settings this benchmark chooses for one run (the rest are RunConfig defaults)."""
        named = QUICK_MODEL if model == "quick" else MODELS[model]
        out = dict(named, **METHODS[method], **MODEL_METHODS.get(model, {}).get(method, {}),
                   max_seconds=self.max_seconds)
        if self.address and out.get("strategy", "downpour") in RAY_STRATEGIES:
            out["address"] = self.address
        return out


def make_plan(quick: bool, models: list[str] | None, methods: list[str] | None, repeats: int | None,
              max_seconds: float | None, address: str = "") -> Plan:
    """Options to a Plan; --quick changes only the defaults of what was not given explicitly."""
    if quick:
        models = ["quick"]
    else:
        models = list(models or DEFAULT_MODELS)
        unknown = [m for m in models if m not in MODELS]
        if unknown:
            raise ConfigError("models", f"unknown model(s) {', '.join(unknown)}; choose from "
                                        f"{', '.join(MODELS)}")
    if not methods and not quick and models and all(m in MODEL_DEFAULT_METHODS for m in models):
        methods = list(dict.fromkeys(x for m in models for x in MODEL_DEFAULT_METHODS[m]))
    methods = list(methods or (QUICK_METHODS if quick else DEFAULT_METHODS))
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError("methods", f"unknown method(s) {', '.join(unknown)}; choose from "
                                     f"{', '.join(METHODS)}")
    repeats = repeats if repeats is not None else (1 if quick else 3)
    if repeats < 1:
        raise ConfigError("repeats", f"must be >= 1, got {repeats}")
    max_seconds = max_seconds if max_seconds is not None else (3.0 if quick else 40.0)
    if not max_seconds > 0:
        raise ConfigError("max_seconds", f"the per-run budget must be > 0, got {max_seconds}")
    return Plan(quick, models, list(dict.fromkeys(methods)), repeats, float(max_seconds), address or "")


def run_config(settings: dict[str, Any], run_dir: Path) -> RunConfig:
    """The RunConfig of one run: the defaults with ``settings`` applied, validated (errors before any run)."""
    return dataclasses.replace(RunConfig(), **settings, out=str(run_dir)).validate()


def best_until(trace: list, examples: int) -> float | None:
    """The best metric of the evaluations made within ``examples`` training examples."""
    seen = [m for n, m in trace if n <= examples and m is not None]
    return max(seen) if seen else None


def metric_at_same_examples(base_runs: list[dict], runs: list[dict]) -> dict:
    """Repeat by repeat, Downpour's best test metric within the examples the baseline processed, minus the
    baseline's best; and each run's best against the planted optimum (runs with a metric trace: the ctr task)."""
    gaps, to_optimum = [], []
    for b, r in zip(base_runs, runs):
        if not b.get("trace") or not r.get("trace"):
            continue
        n = max(n for n, _ in b["trace"])
        ours, theirs = best_until(r["trace"], n), best_until(b["trace"], n)
        if ours is not None and theirs is not None:
            gaps.append(ours - theirs)
        if r.get("planted_auc") is not None and r.get("best_test_auc") is not None:
            to_optimum.append(r["planted_auc"] - r["best_test_auc"])
    if not gaps:
        return {}
    return {"downpour_minus_sgd1_best_metric_same_examples": gaps,
            "downpour_planted_minus_best_auc": to_optimum}


def median_or_none(values: list[float | None]) -> float | None:
    ok = [v for v in values if v is not None]
    return statistics.median(ok) if ok else None


def ratios_to_baselines(medians: dict[str, float | None]) -> dict[str, float | None]:
    """Downpour's median over each baseline's median (None where either is missing): what targets compare."""
    d = medians.get("downpour")
    return {f"downpour/{b}": (d / v if d is not None and v else None)
            for b, v in medians.items() if b != "downpour"}


def evaluate_targets(model: str, ratios: dict[str, float | None]) -> list[dict]:
    """The issue's targets for ``model``: met is True/False from the measured ratio, None if not measured."""
    out = []
    for baseline, threshold in TARGETS.get(model, []):
        ratio = ratios.get(f"downpour/{baseline}")
        out.append({"name": f"downpour vs {baseline}", "threshold": threshold, "ratio": ratio,
                    "met": None if ratio is None else ratio >= threshold,
                    "description": f"{MODEL_LABELS[model]}: Downpour (2 replicas x 2 shards) >= {threshold}x "
                                   f"the examples/s of {METHOD_LABELS[baseline]}"})
    return out


def _stop_ray() -> None:
    """Stop the Ray instance a Downpour run started, so the baselines after it run without Ray's daemons on
    the cores (as a user's ``distbelief train --strategy sgd`` would). The next Ray run starts a fresh one."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _prune(run_dir: Path) -> None:
    """Drop a finished run's parameters and shard checkpoints (168 MB each for the paper model): only its
    summary, metrics and config matter here."""
    for p in run_dir.glob("*.safetensors"):
        p.unlink(missing_ok=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def table_traffic(s: dict) -> dict:
    """For a run with embedding tables: its metric, and the bytes its replicas moved per step against the least
    a sparse step can move (each unique row once with its 8-byte id, plus the dense part), each way."""
    out = {k: s[k] for k in ("best_test_auc", "final_test_auc", "planted_auc", "test_logloss") if k in s}
    if not s.get("rows_pushed"):
        return out
    steps = sum(s["steps_per_replica"])
    dense = s["num_parameters"] - s["table_parameters"]
    row_bytes = s["table_parameters"] // s["table_rows"] * 4 + 8  # the tables' width (dlrm-small: one width)
    pushed, fetched = sum(s["bytes_pushed_per_shard"]), sum(s["bytes_fetched_per_shard"])
    least_push = s["rows_pushed"] * row_bytes + steps * dense * 4
    least_fetch = s["rows_fetched"] * row_bytes + steps * dense * 4
    out.update(bytes_pushed_per_step=pushed / steps, bytes_fetched_per_step=fetched / steps,
               unique_rows_per_step=s["rows_pushed"] / steps,
               push_bytes_over_least=pushed / least_push, fetch_bytes_over_least=fetched / least_fetch)
    return out


def measure_once(cfg: RunConfig) -> dict:
    """One run: its examples/s and wall time, or the error it failed with (the sweep goes on either way)."""
    from distbelief.api import train_task

    t0 = time.monotonic()
    try:
        res = train_task(cfg, quiet=True)
        s = res.summary
        run = {"examples_per_s": s["examples_per_s"], "wall_s": s.get("wall_s"),
               "stop_reason": s.get("stop_reason"), "error": None}
        run.update(table_traffic(s))
        if "planted_auc" in s:  # the metric along the run: (examples, test AUC) of every evaluation
            run["trace"] = [[r["examples"], r["test_accuracy"]] for r in res.metrics if "examples" in r]
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - one failed run must not cost the other runs' measurements
        run = {"examples_per_s": None, "wall_s": None, "stop_reason": "failed",
               "error": f"{type(e).__name__}: {e}"}
    finally:
        if cfg.strategy in RAY_STRATEGIES:
            _stop_ray()
        if cfg.out:
            _prune(Path(cfg.out))
    run["elapsed_s"] = time.monotonic() - t0
    return run


class Sweep:
    """One invocation: the planned configs, the runs measured so far, and the results.json they make."""

    def __init__(self, plan: Plan, out: Path, log: Callable[[str], None]):
        from distbelief.bench.machine import machine_info

        self.plan, self.out, self.log = plan, out, log
        self.configs = {model: {method: run_config(plan.settings(model, method), out / "runs" / model / method)
                                for method in plan.methods} for model in plan.models}
        self.runs: dict[str, dict[str, list[dict]]] = {m: {k: [] for k in plan.methods} for m in plan.models}
        self.machine = machine_info()  # as the sweep starts: its load average is the one the runs began under
        self.started = time.time()

    def run(self) -> dict:
        for model in self.plan.models:
            for repeat in range(1, self.plan.repeats + 1):
                for method in self.plan.methods:
                    self._one(model, method, repeat)
        return self.save()

    def _one(self, model: str, method: str, repeat: int) -> None:
        base = self.configs[model][method]
        cfg = dataclasses.replace(base, out=f"{base.out}-r{repeat}")
        if Path(cfg.out).exists():
            shutil.rmtree(cfg.out)  # a rerun into the same --out replaces the old run, never resumes it
        run = measure_once(cfg)
        run.update(repeat=repeat, run_dir=cfg.out)
        self.runs[model][method].append(run)
        value = (f"{run['examples_per_s']:,.0f} examples/s" if run["error"] is None
                 else f"FAILED: {run['error']}")
        self.log(f"[throughput] {model} {method} repeat {repeat}/{self.plan.repeats}: {value}")
        self.save()

    def results(self) -> dict:
        models = {}
        for model in self.plan.models:
            methods = {}
            for method in self.plan.methods:
                runs = self.runs[model][method]
                methods[method] = {"label": METHOD_LABELS[method],
                                   "config": self.configs[model][method].to_dict(), "runs": runs,
                                   "median_examples_per_s": median_or_none([r["examples_per_s"] for r in runs])}
            medians = {m: v["median_examples_per_s"] for m, v in methods.items()}
            ratios = ratios_to_baselines(medians)
            models[model] = {"label": MODEL_LABELS[model], "methods": methods, "ratios": ratios,
                             "targets": evaluate_targets(model, ratios)}
            if "sgd-1" in methods and "downpour" in methods:
                models[model].update(metric_at_same_examples(methods["sgd-1"]["runs"], methods["downpour"]["runs"]))
        return {
            "benchmark": "throughput", "quick": self.plan.quick, "date": self.machine["date"],
            "machine": self.machine, "targets_measured_on_cores": 2,
            "repeats": self.plan.repeats, "max_seconds": self.plan.max_seconds, "statistic": "median",
            "address": self.plan.address or None,
            "order": "interleaved: every repeat runs every method once, in the listed order",
            "pinned_settings": self.pinned_settings(),
            "defaults": "every setting not in pinned_settings is the RunConfig default of this checkout; no "
                        "default is turned off (each method's full config is in models.*.methods.*.config)",
            "methods": self.plan.methods, "models": models, "wall_s": time.time() - self.started,
            # with machine.load_average (at the start): other work on the cores skews the ratios, sgd-2 most
            "load_average_last_save": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        }

    def pinned_settings(self) -> list[str]:
        """The settings this benchmark chose: the experiment's names, the methods' workers, the budget."""
        keys = {k for model in self.plan.models for method in self.plan.methods
                for k in self.plan.settings(model, method)}
        return sorted(keys | {"out"})

    def save(self) -> dict:
        """Write results.json now (after every run: a sweep stopped half-way keeps what it measured)."""
        res = self.results()
        res["table_markdown"] = markdown_table(res)
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(res, indent=2) + "\n")
        os.replace(tmp, self.out / "results.json")
        return res


def _fmt(v: float | None, spec: str = ",.0f") -> str:
    return "—" if v is None else format(v, spec)


def markdown_table(res: dict) -> str:
    """The results as Markdown for benchmarks/RESULTS.md: one row per model and method, then the targets."""
    m = res["machine"]
    head = (f"Throughput of the defaults{' (QUICK: mechanics only)' if res['quick'] else ''}, {res['date']}, "
            f"{m['cores']} cores ({m['cpu_model']}), torch {m['torch']}, median of {res['repeats']} x "
            f"{res['max_seconds']:g} s per method, back to back")
    lines = [head, "", "| model | method | median examples/s | runs (examples/s) | × sgd-1 |",
             "|---|---|---|---|---|"]
    targets = []
    for name, model in res["models"].items():
        base = model["methods"].get("sgd-1", {}).get("median_examples_per_s")
        for method, v in model["methods"].items():
            med = v["median_examples_per_s"]
            runs = ", ".join("failed" if r["error"] else _fmt(r["examples_per_s"]) for r in v["runs"]) or "—"
            ratio = med / base if med is not None and base else None
            lines.append(f"| {name} | {method} | {_fmt(med)} | {runs} | {_fmt(ratio, '.2f')} |")
        gaps = model.get("downpour_minus_sgd1_best_metric_same_examples")
        if gaps:
            listed = ", ".join(format(g, "+.4f") for g in gaps)
            targets.append(f"- {name}: Downpour's best test AUC within the examples sgd-1 processed, minus "
                           f"sgd-1's: {listed} (target: within 0.003)")
            optimum = ", ".join(format(g, ".4f") for g in model.get("downpour_planted_minus_best_auc") or [])
            targets.append(f"- {name}: planted AUC minus Downpour's best: {optimum} (target: within 0.01)")
        traffic = [r for r in model["methods"].get("downpour", {}).get("runs", []) if "push_bytes_over_least" in r]
        if traffic:
            pushed = ", ".join(format(r["push_bytes_over_least"], ".3f") for r in traffic)
            fetched = ", ".join(format(r["fetch_bytes_over_least"], ".3f") for r in traffic)
            targets.append(f"- {name}: Downpour bytes per step over the least a sparse step moves (unique rows x "
                           f"(dim x 4 + 8) + the dense part, each way): pushed {pushed}, fetched {fetched} "
                           f"(target: <= 1.2)")
        for t in model["targets"]:
            state = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
            targets.append(f"- {name}: {t['name']} = {_fmt(t['ratio'], '.2f')} (target >= {t['threshold']}): "
                           f"{state}")
    return "\n".join(lines + [""] + targets) + "\n"


def run_throughput(out: Path, quick: bool = False, models: list[str] | None = None,
                   methods: list[str] | None = None, repeats: int | None = None,
                   max_seconds: float | None = None, log: Callable[[str], None] = print,
                   address: str = "") -> dict:
    """Run the sweep; write ``out/results.json``; return the results (with ``table_markdown``). With
    ``address`` the Ray strategies join that cluster; the local baselines run on this machine."""
    plan = make_plan(quick, models, methods, repeats, max_seconds, address)
    sweep = Sweep(plan, out, log)  # builds and validates every config first: a bad setting costs no run
    log(f"[throughput] {len(plan.models)} model(s) x {len(plan.methods)} methods x {plan.repeats} repeats, "
        f"{plan.max_seconds:g} s each{' (quick)' if quick else ''}")
    return sweep.run()
