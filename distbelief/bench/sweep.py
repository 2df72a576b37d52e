"""The sweep that runs the Fig. 4/5 methods: the shared warmstart, one measured run per method and core count
(written to results.json after each), Fig. 5's core-count groups in child processes pinned to that many CPUs, and
the sweep's Ray instance.

Run as ``python -m distbelief.bench.sweep SPEC_JSON``, it is the child side of one pinned group.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distbelief.bench.recipes import Recipe, label, method_settings, recipe_for
from distbelief.bench.targets import (
    SMOOTHED_RULE,
    evaluate_targets,
    method_summaries,
    series_of,
    smoothed_crossing,
    time_to_target,
)
from distbelief.config import RunConfig
from distbelief.exceptions import ConfigError, DistBeliefError, RemoteTimeoutError


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
    address: str = ""  # a Ray cluster for the Ray strategies (bench fig4 --address); "" = this machine
    repeats: int = 1  # fig4: runs of every method, in interleaved rounds (bench fig4 --repeats)

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

    def measure(self, method: str, cores: int, stop_at_target: bool, repeat: int = 1) -> dict:
        """One run of ``method`` at ``cores`` from the warmstart. A run that goes on past the target (fig4) also
        records its smoothed crossing, which fig4's targets compare (distbelief/bench/targets.py)."""
        settings = method_settings(self.recipe, method, cores)
        settings.update(init_params=self.warm["run_dir"], max_seconds=self.recipe.max_seconds,
                        target_accuracy=self.recipe.target_accuracy if stop_at_target else 0.0)
        if self.address and settings.get("strategy") in RAY_STRATEGIES:
            settings["address"] = self.address
        n = len(self.runs) + 1
        of = f" (repeat {repeat}/{self.repeats})" if self.repeats > 1 else ""
        self.log(f"[{self.figure}] run {n}: {label(method, cores)}{of} for up to {self.recipe.max_seconds:.0f}s")
        try:
            r = self.run_one(f"{method}-c{cores}" + (f"-r{repeat}" if self.repeats > 1 else ""), settings)
        except ConfigError:
            raise  # a recipe or option error: fix it, measuring on would be pointless
        except DistBeliefError as e:  # one failed method must not cost the sweep's other hour of measurements
            self.log(f"[{self.figure}] {label(method, cores)} FAILED: {e}")
            run = {"method": method, "label": label(method, cores), "cores": cores, "config": settings,
                   "series": series_of([]), "time_to_target_s": None, "reached": False, "error": str(e),
                   "time_to_target_mean3_s": None, "repeat": repeat,
                   **({} if stop_at_target else {"time_to_target_smoothed_s": None}),
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
               "repeat": repeat,
               "final_test_accuracy": r["summary"]["final_test_accuracy"],
               "best_test_accuracy": r["summary"]["best_test_accuracy"],
               "examples_per_s": r["summary"]["examples_per_s"], "wall_s": r["summary"]["wall_s"],
               "stop_reason": r["summary"]["stop_reason"], "elapsed_s": r["elapsed_s"], "run_dir": r["run_dir"],
               "staleness_mean": r["summary"].get("staleness_mean")}
        if not stop_at_target:
            run["time_to_target_smoothed_s"] = smoothed_crossing(series, self.recipe.target_accuracy)
        self.runs.append(run)
        smoothed = run.get("time_to_target_smoothed_s")
        smoothed_text = "" if stop_at_target else (" (smoothed crossing: missed)" if smoothed is None else
                                                   f" (smoothed crossing {smoothed:.1f}s)")
        self.log(f"[{self.figure}] {run['label']}: " + (f"target {self.recipe.target_accuracy:.3f} at "
                 f"{tta:.1f}s" if tta is not None else f"missed the target {self.recipe.target_accuracy:.3f}")
                 + smoothed_text
                 + f", best accuracy {run['best_test_accuracy']:.4f}, {run['examples_per_s']:,.0f} examples/s")
        self.save()
        return run

    def results(self) -> dict:
        from distbelief.bench.machine import machine_info

        rec = dataclasses.asdict(self.recipe)
        out = {"figure": self.figure, "quick": self.quick, "cores": self.cores, "machine": machine_info(),
               "recipe": rec, "target_accuracy": self.recipe.target_accuracy, "warmstart": self.warm,
               "runs": self.runs, "targets": evaluate_targets(self.figure, self.runs, self.cores)}
        if self.figure == "fig4":
            out.update(repeats=self.repeats, time_to_target_rule=SMOOTHED_RULE, statistic="median over repeats",
                       summary=method_summaries(self.runs, self.recipe.target_accuracy))
        return out

    def save(self) -> dict:
        """Write results.json now (after every run: a sweep stopped half-way keeps what it measured)."""
        res = self.results()
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / (self.results_name + ".tmp")
        tmp.write_text(json.dumps(res, indent=2) + "\n")
        os.replace(tmp, self.out / self.results_name)
        return res


def pinned_group(out: Path, cores: int, quick: bool, methods: list[str], recipe: Recipe, warm: dict,
                 log) -> list[dict]:
    """Run ``methods`` at ``cores`` cores in a child process confined to the first ``cores`` CPUs."""
    import subprocess
    import sys

    group = out / f"group-c{cores}.json"
    group.unlink(missing_ok=True)
    spec = {"out": str(out), "cores": cores, "quick": quick, "methods": methods,
            "max_seconds": recipe.max_seconds, "warm": warm, "group": str(group)}
    cpus = sorted(os.sched_getaffinity(0))[:cores] if hasattr(os, "sched_setaffinity") else None
    if cpus is None:
        log(f"[fig5] this platform cannot pin processes to CPUs: the {cores}-core runs may use more cores")
    timeout_s = len(methods) * (recipe.max_seconds + 300.0)
    try:
        proc = subprocess.run([sys.executable, "-m", "distbelief.bench.sweep", json.dumps(spec)],
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
    """Child side of :func:`pinned_group`: run the methods, write the group's runs."""
    import sys

    recipe = recipe_for(spec["quick"], spec["max_seconds"])
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    sweep = Sweep("fig5", recipe, Path(spec["out"]), spec["cores"], spec["quick"], log,
                  results_name=Path(spec["group"]).name)
    sweep.warm = spec["warm"]
    connect_ray(spec["cores"], spec["methods"], recipe)
    for m in spec["methods"]:
        sweep.measure(m, spec["cores"], stop_at_target=True)


RAY_STRATEGIES = ("downpour", "sandblaster", "sync")


def connect_ray(cores: int, methods: list[str], recipe: Recipe, address: str = "") -> None:
    """Start the local Ray instance (or join the cluster at ``address``) once for the whole sweep, only if a
    method needs it."""
    if any(recipe.methods[m]["strategy"] in RAY_STRATEGIES for m in methods):
        from distbelief.runtime.ray_runtime import connect

        connect(address=address or None, num_cpus=None if address else cores)


if __name__ == "__main__":  # a fig5 core-count group, started by pinned_group
    import sys

    _group_main(json.loads(sys.argv[1]))
