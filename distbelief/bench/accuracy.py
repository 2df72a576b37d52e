"""Figure drivers of the time-to-accuracy sweeps: the paper's Fig. 4 (accuracy vs wall-clock time per method) and
Fig. 5 (time to a fixed test accuracy vs cores used per method), on this machine, against the baselines a user would
otherwise pick. The recipes are in :mod:`.recipes`, the runs in :mod:`.sweep`, the target maths in :mod:`.targets`.

Protocol (as in the paper, §5): one single-process SGD warmstart is run first and saved; every method then starts
from that same checkpoint (``init_params``) with a fresh optimizer state. Each method's clock is its trainer's
training clock: it starts when the method's workers are up (process start-up is excluded for every method alike)
and single-process SGD pauses it while it evaluates (the distributed methods evaluate in the driver while their
workers keep training, so evaluation costs them CPU time and never costs SGD any). Fig. 5's time to target is the
training time of the first evaluation at or above the target accuracy (its runs stop there); Fig. 4's targets use
the smoothed crossing, the median over ``--repeats`` runs (:mod:`.targets` says why).
"""

from __future__ import annotations

from pathlib import Path

from distbelief.bench.recipes import Recipe, recipe_for
from distbelief.bench.sweep import Sweep, connect_ray, pinned_group
from distbelief.bench.targets import report_targets, spread_text
from distbelief.exceptions import ConfigError

FIG5_METHODS = ("sgd-all", "adagrad-all", "downpour-sgd", "downpour-adagrad", "sandblaster", "ddp", "hogwild")


def run_fig4(out: Path, cores: int, quick: bool, methods: list[str] | None = None, log=print,
             max_seconds: float | None = None, address: str = "", repeats: int = 1) -> dict:
    """Every method from one warmstart, each for the whole budget (full curves), ``repeats`` times in interleaved
    rounds (every method once per round, so a drift of the machine hits all alike); write results.json, fig4.png.
    With ``address`` the Ray methods run on that cluster, the others on this machine."""
    from distbelief.bench.plots import plot_fig4

    if repeats < 1:
        raise ConfigError("repeats", f"must be >= 1, got {repeats}")
    recipe = recipe_for(quick, max_seconds)
    methods = _methods(recipe, methods, ("sgd-1",) + tuple(m for m in recipe.methods if m != "sgd-1"))
    sweep = Sweep("fig4", recipe, out, cores, quick, log, address=address, repeats=repeats)
    connect_ray(cores, methods, recipe, address)
    sweep.warmstart()
    for k in range(1, repeats + 1):
        for m in methods:
            sweep.measure(m, 1 if m == "sgd-1" else cores, stop_at_target=False, repeat=k)
    res = sweep.save()
    plot_fig4(res, out / "fig4.png")
    for m in res["summary"]:
        log(f"[fig4] {m['label']}: smoothed crossing {spread_text(m['smoothed'], unit=' s')} over {m['runs']} run(s)")
    report_targets(res, log)
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

    recipe = recipe_for(quick, max_seconds)
    methods = _methods(recipe, methods, FIG5_METHODS)
    sweep = Sweep("fig5", recipe, out, cores, quick, log)
    sweep.warmstart()
    for c in fig5_core_counts(cores):
        sweep.runs.extend(pinned_group(out, c, quick, methods, recipe, sweep.warm, log))
        sweep.save()
    res = sweep.save()
    plot_fig5(res, out / "fig5.png")
    report_targets(res, log)
    log(f"[fig5] wrote {out / 'results.json'} and {out / 'fig5.png'}")
    return res


def _methods(recipe: Recipe, chosen: list[str] | None, default: tuple[str, ...]) -> list[str]:
    if not chosen:
        return list(default)
    unknown = [m for m in chosen if m not in recipe.methods]
    if unknown:
        raise ConfigError("methods", f"unknown method(s) {', '.join(unknown)}; choose from "
                                     f"{', '.join(recipe.methods)}")
    return list(chosen)
