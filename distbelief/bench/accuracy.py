"""Time-to-accuracy sweeps: the paper's Fig. 4 (accuracy vs wall-clock time per method) and Fig. 5 (time to a fixed
test accuracy vs cores used per method), on this machine, against the baselines a user would otherwise pick.

Protocol (as in the paper, §5): one single-process SGD warmstart is run first and saved; every method then starts
from that same checkpoint (``init_params``) with a fresh optimizer state. Each method's clock is its trainer's
training clock: it starts when the method's workers are up (process start-up is excluded for every method alike)
and single-process SGD pauses it while it evaluates (the distributed methods evaluate in the driver while their
workers keep training, so evaluation costs them CPU time and never costs SGD any). Time to target is the training
time of the first evaluation at or above the target accuracy.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distbelief.config import RunConfig
from distbelief.exceptions import ConfigError, DistBeliefError


@dataclass(frozen=True)
class Recipe:
    """Task, model, budget and each method's calibrated settings for one sweep."""

    label: str
    common: dict[str, Any]  # RunConfig settings every run shares (task, model, batch size, eval cadence...)
    warmstart: dict[str, Any]  # the single-process SGD warmstart run's settings
    target_accuracy: float
    max_seconds: float  # budget per run
    methods: dict[str, dict[str, Any]]  # method name -> RunConfig settings (calibrated rates)
    shards: int = 2
    notes: str = ""


# The calibrated recipe (docs/reproducing.md tells how each number was chosen). The paper's speech task shape:
# 440 inputs, 8192 classes; classes skewed like acoustic states (Zipf exponent 1); a 2.3M-parameter sigmoid MLP,
# small enough for a 2-core machine, big enough that single-process SGD needs minutes to reach the target.
FULL = Recipe(
    label="speech 440-256x2-8192 sigmoid (2.3M parameters), 8192 Zipf classes",
    common=dict(task="speech", num_samples=300_000, num_classes=8192, class_prior=1.0, model="speech-tiny",
                batch_size=128, eval_every_seconds=5.0, eval_samples=3000, train_eval_samples=1000, seed=0),
    warmstart=dict(strategy="sgd", server_optimizer="sgd", lr=2.0, threads=1, max_steps=500),
    # Calibrated on this 2-core machine (docs/reproducing.md, benchmarks/results/fig4-calibration-*.json): every
    # method but Sandblaster reached 0.13 within 100 s in the calibration runs; 0.14 took 135-140 s for the best.
    target_accuracy=0.13,
    max_seconds=240.0,
    methods={
        "sgd-1": dict(strategy="sgd", server_optimizer="sgd", lr=2.0, threads=1),
        "sgd-all": dict(strategy="sgd", server_optimizer="sgd", lr=2.0),
        "adagrad-all": dict(strategy="sgd", server_optimizer="adagrad", lr=0.5, adagrad_initial_accumulator=0.1),
        # Synchronous fetch (overlap=False): on 2 cores the prefetch's extra staleness cost more accuracy per
        # second than its throughput gained (calibration: 0.13 at 84 s vs 93 s).
        "downpour-sgd": dict(strategy="downpour", server_optimizer="sgd", lr=2.0, overlap=False),
        "downpour-adagrad": dict(strategy="downpour", server_optimizer="adagrad", lr=0.5,
                                 adagrad_initial_accumulator=0.1, overlap=False),
        "sandblaster": dict(strategy="sandblaster", batch_size=4096, portion_size=512, history=10),
        "ddp": dict(strategy="ddp", server_optimizer="sgd", lr=4.0),
        "hogwild": dict(strategy="hogwild", server_optimizer="sgd", lr=2.0),
    },
)

# Tiny sizes: the whole sweep's mechanics in a few minutes (CI runs it); its numbers mean nothing.
QUICK = Recipe(
    label="quick: speech 440-256x2-64 sigmoid, 64 classes (mechanics only)",
    common=dict(task="speech", num_samples=4000, num_classes=64, class_prior=1.0, model="speech-tiny",
                batch_size=64, eval_every_seconds=0.5, eval_samples=400, train_eval_samples=400, seed=0,
                remote_timeout_s=120.0),
    warmstart=dict(strategy="sgd", server_optimizer="sgd", lr=0.5, threads=1, max_steps=10),
    target_accuracy=0.12,
    max_seconds=1.5,
    methods={
        "sgd-1": dict(strategy="sgd", server_optimizer="sgd", lr=0.5, threads=1),
        "sgd-all": dict(strategy="sgd", server_optimizer="sgd", lr=0.5),
        "adagrad-all": dict(strategy="sgd", server_optimizer="adagrad", lr=0.02),
        "downpour-sgd": dict(strategy="downpour", server_optimizer="sgd", lr=0.5),
        "downpour-adagrad": dict(strategy="downpour", server_optimizer="adagrad", lr=0.02),
        "sandblaster": dict(strategy="sandblaster", batch_size=2048, portion_size=256, history=5),
        "ddp": dict(strategy="ddp", server_optimizer="sgd", lr=0.5),
        "hogwild": dict(strategy="hogwild", server_optimizer="sgd", lr=0.5),
    },
)

LABELS = {
    "sgd-1": "single-process SGD, 1 thread",
    "sgd-all": "single-process SGD, {c} threads",
    "adagrad-all": "single-process Adagrad, {c} threads (reference)",
    "downpour-sgd": "Downpour, fixed rate, {c} replicas",
    "downpour-adagrad": "Downpour + Adagrad, {c} replicas",
    "sandblaster": "Sandblaster L-BFGS, {c} replicas",
    "ddp": "synchronous data parallel (torch DDP), {c} ranks",
    "hogwild": "Hogwild (torch.multiprocessing), {c} workers",
}
FIG5_METHODS = ("sgd-all", "adagrad-all", "downpour-sgd", "downpour-adagrad", "sandblaster", "ddp", "hogwild")


def method_settings(recipe: Recipe, method: str, cores: int) -> dict[str, Any]:
    """RunConfig settings of ``method`` using ``cores`` cores: threads for one process, else one worker a core."""
    s = dict(recipe.common, **recipe.methods[method])
    if s["strategy"] == "sgd":
        s.setdefault("threads", cores)
    else:
        s.update(replicas=cores, threads=1)
        if s["strategy"] in ("downpour", "sandblaster"):
            s.setdefault("shards", recipe.shards)
    return s


def label(method: str, cores: int) -> str:
    text = LABELS[method].format(c=cores)
    return re.sub(r"\b1 (thread|replica|rank|worker)s\b", r"1 \1", text)


@dataclass
class Sweep:
    """One ``distbelief bench fig4|fig5`` invocation: where it writes and what it has measured so far."""

    figure: str
    recipe: Recipe
    out: Path
    cores: int
    quick: bool
    log: Any = print
    runs: list[dict] = field(default_factory=list)
    warm: dict = field(default_factory=dict)
    results_name: str = "results.json"

    def run_one(self, name: str, settings: dict[str, Any]) -> dict:
        from distbelief.api import train_task

        run_dir = self.out / "runs" / name
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a rerun replaces the old series; never mixes two runs' metrics
        cfg = dataclasses.replace(RunConfig(), **settings, out=str(run_dir)).validate()
        t0 = time.monotonic()
        res = train_task(cfg, quiet=self.quick)
        return {"config": cfg.to_dict(), "summary": res.summary, "metrics": res.metrics,
                "elapsed_s": time.monotonic() - t0, "run_dir": str(run_dir)}

    def warmstart(self) -> str:
        """Run the shared single-process SGD warmstart once; every method then starts from its parameters."""
        settings = dict(self.recipe.common, **self.recipe.warmstart, max_seconds=0.0)
        self.log(f"[{self.figure}] warmstart: single-process SGD for {settings['max_steps']} steps")
        r = self.run_one("warmstart", settings)
        self.warm = {"run_dir": r["run_dir"], "settings": settings,
                     "test_accuracy": r["summary"]["final_test_accuracy"], "elapsed_s": r["elapsed_s"]}
        self.log(f"[{self.figure}] warmstart done: test accuracy {self.warm['test_accuracy']:.4f}")
        return r["run_dir"]

    def measure(self, method: str, cores: int, stop_at_target: bool) -> dict:
        settings = method_settings(self.recipe, method, cores)
        settings.update(init_params=self.warm["run_dir"], max_seconds=self.recipe.max_seconds,
                        target_accuracy=self.recipe.target_accuracy if stop_at_target else 0.0)
        n = len(self.runs) + 1
        self.log(f"[{self.figure}] run {n}: {label(method, cores)} for up to {self.recipe.max_seconds:.0f}s")
        try:
            r = self.run_one(f"{method}-c{cores}", settings)
        except ConfigError:
            raise  # a recipe or option error: fix it, measuring on would be pointless
        except DistBeliefError as e:  # one failed method must not cost the sweep's other hour of measurements
            self.log(f"[{self.figure}] {label(method, cores)} FAILED: {e}")
            run = {"method": method, "label": label(method, cores), "cores": cores, "config": settings,
                   "series": series_of([]), "time_to_target_s": None, "reached": False, "error": str(e),
                   "time_to_target_mean3_s": None,
                   "final_test_accuracy": None, "best_test_accuracy": None, "examples_per_s": None,
                   "wall_s": None, "stop_reason": "failed", "elapsed_s": None, "run_dir": None,
                   "staleness_mean": None}
            self.runs.append(run)
            self.save()
            return run
        series = series_of(r["metrics"])
        tta = time_to_target(series, self.recipe.target_accuracy)
        run = {"method": method, "label": label(method, cores), "cores": cores, "config": r["config"],
               "series": series, "time_to_target_s": tta, "reached": tta is not None,
               "time_to_target_mean3_s": time_to_target(series, self.recipe.target_accuracy, window=3),
               "final_test_accuracy": r["summary"]["final_test_accuracy"],
               "best_test_accuracy": r["summary"]["best_test_accuracy"],
               "examples_per_s": r["summary"]["examples_per_s"], "wall_s": r["summary"]["wall_s"],
               "stop_reason": r["summary"]["stop_reason"], "elapsed_s": r["elapsed_s"], "run_dir": r["run_dir"],
               "staleness_mean": r["summary"].get("staleness_mean")}
        self.runs.append(run)
        self.log(f"[{self.figure}] {run['label']}: " + (f"target {self.recipe.target_accuracy:.3f} at "
                 f"{tta:.1f}s" if tta is not None else f"missed the target {self.recipe.target_accuracy:.3f}")
                 + f", best accuracy {run['best_test_accuracy']:.4f}, {run['examples_per_s']:,.0f} examples/s")
        self.save()
        return run

    def results(self) -> dict:
        from distbelief.bench.machine import machine_info

        rec = dataclasses.asdict(self.recipe)
        return {"figure": self.figure, "quick": self.quick, "cores": self.cores, "machine": machine_info(),
                "recipe": rec, "target_accuracy": self.recipe.target_accuracy, "warmstart": self.warm,
                "runs": self.runs, "targets": evaluate_targets(self.figure, self.runs, self.cores)}

    def save(self) -> dict:
        """Write results.json now (after every run: a sweep stopped half-way keeps what it measured)."""
        res = self.results()
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / (self.results_name + ".tmp")
        tmp.write_text(json.dumps(res, indent=2) + "\n")
        os.replace(tmp, self.out / self.results_name)
        return res


def series_of(metrics: list[dict]) -> dict[str, list]:
    keys = ("wall_s", "test_accuracy", "train_accuracy", "train_loss", "examples", "updates", "staleness_mean")
    return {k: [m.get(k) for m in metrics] for k in keys}


def time_to_target(series: dict[str, list], target: float, window: int = 1) -> float | None:
    """Training time of the first evaluation at which the mean test accuracy of the last ``window`` evaluations
    is at or above ``target`` (``window`` 1: the first crossing; larger windows discount one lucky evaluation)."""
    accs = [(t, a) for t, a in zip(series["wall_s"], series["test_accuracy"]) if a is not None]
    for i in range(window - 1, len(accs)):
        if sum(a for _, a in accs[i - window + 1:i + 1]) / window >= target:
            return accs[i][0]
    return None


def _tta(runs: list[dict], method: str, cores: int) -> float | None:
    for r in runs:
        if r["method"] == method and r["cores"] == cores:
            return r["time_to_target_s"]
    return None


def evaluate_targets(figure: str, runs: list[dict], cores: int) -> list[dict]:
    """The issue's targets as ratios of times measured in this sweep (None where a run is missing or missed)."""
    def ratio(a: str, b: str, ca: int, cb: int, threshold: float, text: str, strict: bool = False) -> dict:
        ta, tb = _tta(runs, a, ca), _tta(runs, b, cb)
        value = ta / tb if ta is not None and tb is not None and tb > 0 else None
        if ta is not None and tb is None and any(r["method"] == b and r["cores"] == cb for r in runs):
            met = True  # b missed the target within the budget, a reached it: a is faster whatever b's time
        elif value is None:
            met = None
        else:
            met = value < threshold if strict else value <= threshold
        return {"name": f"{a}@{ca} vs {b}@{cb}", "description": text, "ratio": value, "threshold": threshold,
                "met": met}

    if figure == "fig4":
        return [
            ratio("downpour-adagrad", "sgd-1", cores, 1, 0.6,
                  f"Downpour + Adagrad ({cores} replicas) reaches the target in <= 0.6x the time of single-process "
                  f"SGD with 1 thread"),
            ratio("downpour-adagrad", "sgd-all", cores, cores, 1.0,
                  f"Downpour + Adagrad ({cores} replicas) reaches the target in less time than single-process SGD "
                  f"with {cores} threads", strict=True),
            ratio("downpour-adagrad", "downpour-sgd", cores, cores, 1.0,
                  "Downpour + Adagrad reaches the target no later than Downpour with a fixed rate"),
        ]
    out = []
    for c in sorted({r["cores"] for r in runs}):
        out.append(ratio("downpour-adagrad", "downpour-sgd", c, c, 1.0,
                         f"at {c} cores, Downpour + Adagrad no later than Downpour with a fixed rate"))
    return out


def run_fig4(out: Path, cores: int, quick: bool, methods: list[str] | None = None, log=print,
             max_seconds: float | None = None) -> dict:
    """Every method from one warmstart, each for the whole budget (full curves); write results.json, fig4.png."""
    from distbelief.bench.plots import plot_fig4

    recipe = _recipe(quick, max_seconds)
    methods = _methods(recipe, methods, ("sgd-1",) + tuple(m for m in recipe.methods if m != "sgd-1"))
    sweep = Sweep("fig4", recipe, out, cores, quick, log)
    _connect_ray(cores, methods, recipe)
    sweep.warmstart()
    for m in methods:
        sweep.measure(m, 1 if m == "sgd-1" else cores, stop_at_target=False)
    res = sweep.save()
    plot_fig4(res, out / "fig4.png")
    _report_targets(res, log)
    log(f"[fig4] wrote {out / 'results.json'} and {out / 'fig4.png'}")
    return res


def fig5_core_counts(cores: int) -> list[int]:
    counts, c = [], 1
    while c < cores:
        counts.append(c)
        c *= 2
    return counts + [cores]


def run_fig5(out: Path, cores: int, quick: bool, methods: list[str] | None = None, log=print,
             max_seconds: float | None = None) -> dict:
    """Each method at 1, 2, 4, ... cores, stopping at the target; write results.json and fig5.png.

    Each core count runs in a child process pinned to that many CPUs (``sched_setaffinity``), with a Ray instance
    of its own: every process of the job — replicas, shards, the driver's evaluation, Hogwild's and DDP's workers
    — shares those cores, so "cores used" means the whole job's, not only its replicas'.
    """
    from distbelief.bench.plots import plot_fig5

    recipe = _recipe(quick, max_seconds)
    methods = _methods(recipe, methods, FIG5_METHODS)
    sweep = Sweep("fig5", recipe, out, cores, quick, log)
    sweep.warmstart()
    for c in fig5_core_counts(cores):
        sweep.runs.extend(_pinned_group(out, c, quick, methods, recipe, sweep.warm, log))
        sweep.save()
    res = sweep.save()
    plot_fig5(res, out / "fig5.png")
    _report_targets(res, log)
    log(f"[fig5] wrote {out / 'results.json'} and {out / 'fig5.png'}")
    return res


def _pinned_group(out: Path, cores: int, quick: bool, methods: list[str], recipe: Recipe, warm: dict,
                  log) -> list[dict]:
    """Run ``methods`` at ``cores`` cores in a child process confined to the first ``cores`` CPUs."""
    import subprocess
    import sys

    from distbelief.exceptions import DistBeliefError, RemoteTimeoutError

    group = out / f"group-c{cores}.json"
    group.unlink(missing_ok=True)
    spec = {"out": str(out), "cores": cores, "quick": quick, "methods": methods,
            "max_seconds": recipe.max_seconds, "warm": warm, "group": str(group)}
    cpus = sorted(os.sched_getaffinity(0))[:cores] if hasattr(os, "sched_setaffinity") else None
    if cpus is None:
        log(f"[fig5] this platform cannot pin processes to CPUs: the {cores}-core runs may use more cores")
    timeout_s = len(methods) * (recipe.max_seconds + 300.0)
    try:
        proc = subprocess.run([sys.executable, "-m", "distbelief.bench.accuracy", json.dumps(spec)],
                              timeout=timeout_s, preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    except subprocess.TimeoutExpired:
        raise RemoteTimeoutError(f"the fig5 runs at {cores} cores did not finish within {timeout_s:.0f}s") from None
    runs = json.loads(group.read_text())["runs"] if group.is_file() else []
    if proc.returncode != 0:
        raise DistBeliefError(f"the fig5 runs at {cores} cores failed (exit status {proc.returncode}) after "
                              f"{len(runs)} of {len(methods)} methods; see the messages above")
    for r in runs:
        r["pinned_cpus"] = cpus
    group.unlink(missing_ok=True)
    return runs


def _group_main(spec: dict) -> None:
    """Child side of :func:`_pinned_group`: run the methods, write the group's runs."""
    import sys

    recipe = _recipe(spec["quick"], spec["max_seconds"])
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    sweep = Sweep("fig5", recipe, Path(spec["out"]), spec["cores"], spec["quick"], log,
                  results_name=Path(spec["group"]).name)
    sweep.warm = spec["warm"]
    _connect_ray(spec["cores"], spec["methods"], recipe)
    for m in spec["methods"]:
        sweep.measure(m, spec["cores"], stop_at_target=True)


def _recipe(quick: bool, max_seconds: float | None) -> Recipe:
    recipe = QUICK if quick else FULL
    if max_seconds is not None:
        if not max_seconds > 0:
            raise ConfigError("max_seconds", f"the per-run budget must be > 0, got {max_seconds}")
        recipe = dataclasses.replace(recipe, max_seconds=float(max_seconds))
    return recipe


def _methods(recipe: Recipe, chosen: list[str] | None, default: tuple[str, ...]) -> list[str]:
    if not chosen:
        return list(default)
    unknown = [m for m in chosen if m not in recipe.methods]
    if unknown:
        raise ConfigError("methods", f"unknown method(s) {', '.join(unknown)}; choose from "
                                     f"{', '.join(recipe.methods)}")
    return list(chosen)


def _connect_ray(cores: int, methods: list[str], recipe: Recipe) -> None:
    """Start the local Ray instance once for the whole sweep (only if a method needs it)."""
    if any(recipe.methods[m]["strategy"] in ("downpour", "sandblaster", "sync") for m in methods):
        from distbelief.runtime.ray_runtime import connect

        connect(num_cpus=cores)


def _report_targets(res: dict, log) -> None:
    for t in res["targets"]:
        state = {True: "MET", False: "NOT MET", None: "not measured"}[t["met"]]
        value = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
        log(f"[{res['figure']}] target {state}: {t['description']} (ratio {value}, threshold {t['threshold']})")


if __name__ == "__main__":  # a fig5 core-count group, started by _pinned_group
    import sys

    _group_main(json.loads(sys.argv[1]))
