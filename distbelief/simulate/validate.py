"""``distbelief simulate --validate``: predictions against real runs.

A measurement is a record: the run's settings (RunConfig values), the machines it ran on, and what its summary
measured (examples/s, mean staleness). Records come from

- ``--run``: the configurations of ``ONE_NODE`` run now, one after the other, on this machine, and, as root on
  Linux, those of ``SHAPED`` on a 4-node shaped cluster (``distbelief cluster up``: two replica nodes of one CPU,
  two shard nodes, every link shaped; all nodes on this machine's cores) at each of their link rates; every run
  trains from scratch for ``RUN_SECONDS`` with the evaluation every 30 s (their run directories and
  ``measured.json`` go in ``--out``);
- ``--measured DIR``: a directory holding such a ``measured.json``, or a ``results.json`` of
  ``benchmarks/shaped_links.py`` (runs on the 4-node shaped cluster of ``distbelief cluster up``: two replica
  nodes, two shard nodes, every link shaped, all nodes on this machine's cores).

This machine's speed moves by a quarter within half an hour (a virtual machine's neighbours), and its memory's
speed moves apart from its cores' (by up to 1.8 times between two calibrations half an hour apart), so each run
made here also times its model's step and a shard's push just before and just after it (``step_probe``), and
the prediction for it scales the calibration's CPU costs by those times over the calibration's
(``Costs.scaled``: the work that streams through memory by the push's, the rest by the step's); the report gives
the errors without that scaling too.

Each record is simulated with the same settings on the same machines; the report gives both numbers per run,
the mean and max relative error of examples/s, the error of the mean staleness (in updates), and Kendall's tau
between the predicted and measured rankings by examples/s.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from distbelief.config import config_from
from distbelief.exceptions import ConfigError
from distbelief.simulate.costs import Costs, load_costs
from distbelief.simulate.machines import Machines, parse_bandwidth
from distbelief.simulate.predict import simulate
from distbelief.simulate.workload import Workload

# The Fig. 4 model (speech-tiny with the paper's 8192 Zipf classes: 2.3M parameters), as the shaped benchmark runs
# it; each one-node configuration trains it for ``ONE_NODE_SECONDS`` from scratch.
FIG4_TASK = {"task": "speech", "model": "speech-tiny", "num_classes": 8192, "class_prior": 1.0,
             "num_samples": 300000, "batch_size": 128, "eval_every_seconds": 30.0, "eval_samples": 3000,
             "train_eval_samples": 1000, "seed": 0}
RUN_SECONDS = 25.0
ONE_NODE = {
    "1node-downpour-1x1": {"replicas": 1, "shards": 1},
    "1node-downpour-2x2": {},
    "1node-downpour-4x2": {"replicas": 4},
    "1node-downpour-2x2-n4": {"fetch_every": 4, "push_every": 4},
    "1node-downpour-2x2-topk-delta": {"compress": "topk", "compress_fetch": "delta"},
    "1node-sync-2x2": {"strategy": "sync"},
    # one replica over two partitions (the paper's Fig. 3 on one machine), two such replicas, and Sandblaster
    "1node-downpour-1x2-p2": {"replicas": 1, "partitions": 2},
    "1node-downpour-2x2-p2": {"partitions": 2},
    "1node-sandblaster-2x2": {"strategy": "sandblaster"},
}
PAPER = {"model": "speech-paper", "num_classes": 8192, "batch_size": None, "eval_samples": 1000,
         "train_eval_samples": 0}
SHAPED = {  # name -> (link rate, settings over FIG4_TASK)
    "shaped-1gbit-fig4-none": ("1gbit", {}),
    "shaped-1gbit-fig4-topk-delta": ("1gbit", {"compress": "topk", "compress_fetch": "delta"}),
    "shaped-1gbit-fig4-topk-fp16": ("1gbit", {"compress": "topk", "compress_fetch": "fp16"}),
    "shaped-1gbit-fig4-powersgd-fp16": ("1gbit", {"compress": "powersgd", "compress_fetch": "fp16"}),
    "shaped-1gbit-paper-none": ("1gbit", PAPER),
    "shaped-1gbit-paper-topk-delta": ("1gbit", {**PAPER, "compress": "topk", "compress_fetch": "delta"}),
    # one replica over two partitions on the two replica nodes: the paper's Fig. 3 over a real link
    "shaped-1gbit-fig4-1x2-p2": ("1gbit", {"replicas": 1, "partitions": 2}),
    "shaped-10gbit-fig4-none": ("10gbit", {}),
    "shaped-10gbit-fig4-topk-delta": ("10gbit", {"compress": "topk", "compress_fetch": "delta"}),
}


# ---------------------------------------------------------------------- records
_PROBES: dict = {}
MEMORY_PROBE_VALUES = 2**20  # the calibration's shard size (calibrate.py ``Effort.shard_values``)


def step_probe(settings: dict[str, Any], seconds: float = 0.6) -> tuple[float, float]:
    """How fast this machine is now, for a run of ``settings``: the median seconds of one step of the model it
    trains, at its minibatch, with one torch thread, and of an Adagrad shard's push of ``MEMORY_PROBE_VALUES``
    values right after each step (the calibration's ``update_s_per_value`` measurement: its work streams through
    memory, whose speed here moves apart from the cores'). About ``seconds`` of steps, at least 3. ``compare``
    holds them against the calibration's timings of the same two things."""
    import numpy as np
    import torch

    from distbelief.simulate.calibrate import _shard, _step_source

    cfg = config_from({k: v for k, v in settings.items() if v is not None}).normalized()
    key = (cfg.model, cfg.task, cfg.num_classes, cfg.batch_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if key not in _PROBES:
            source, x, y = _step_source(*key)
            source.gradient(x, y)  # (the first step allocates)
            _PROBES[key] = (source, x, y)
        source, x, y = _PROBES[key]
        if "shard" not in _PROBES:
            n = MEMORY_PROBE_VALUES
            _PROBES["shard"] = (_shard(n, "adagrad"),
                                np.random.default_rng(0).standard_normal(n, dtype=np.float32) * np.float32(1e-3))
        shard, g = _PROBES["shard"]
        steps, pushes = [], []
        while len(steps) < 3 or sum(steps) < seconds:
            t = time.perf_counter()
            source.gradient(x, y)
            t1 = time.perf_counter()
            shard.push(0, g, 0, shard.version, 32)
            steps.append(t1 - t)
            pushes.append(time.perf_counter() - t1)
        return statistics.median(steps), statistics.median(pushes)
    finally:
        torch.set_num_threads(threads)


def probed(settings: dict[str, Any], run: Callable[[], dict]) -> tuple[dict, dict[str, float]]:
    """``run()``'s summary, and ``step_probe`` just before and just after it (the means): ``{"step_probe_s",
    "memory_probe_s"}``."""
    before = step_probe(settings)
    summary = run()
    after = step_probe(settings)
    return summary, {"step_probe_s": (before[0] + after[0]) / 2, "memory_probe_s": (before[1] + after[1]) / 2}


def shaped_records(results: dict[str, Any], directory: Path) -> list[dict]:
    """The runs of a shaped-links benchmark (``results.json``) as measurement records."""
    out = []
    for run in results.get("runs", []):
        name = f"shaped-{run['bandwidth']}-{run['model']}-{run['config']}"
        summary = directory / f"{run['bandwidth']}-{'fig4' if run['model'] == 'speech-tiny' else 'paper'}-" \
                              f"{run['config']}" / "summary.json"
        staleness = json.loads(summary.read_text()).get("staleness_mean") if summary.is_file() else None
        settings = {k: v for k, v in run["settings"].items() if k != "init_params"}
        out.append({"name": name, "settings": settings,
                    "machines": {"nodes": 4, "cores_per_node": 1, "shared_cores": int(results.get("cpus", 2)),
                                 "shard_nodes": 2, "bandwidth": parse_bandwidth(run["bandwidth"])},
                    "examples_per_s": run["examples_per_s"], "staleness_mean": staleness,
                    "source": str(directory / "results.json")})
    return out


def read_records(directory: str | Path) -> list[dict]:
    d = Path(directory)
    if (d / "measured.json").is_file():
        return json.loads((d / "measured.json").read_text())["records"]
    if (d / "results.json").is_file():
        results = json.loads((d / "results.json").read_text())
        if "runs" in results and results["runs"] and "bandwidth" in results["runs"][0]:
            return shaped_records(results, d)
    raise ConfigError("measured", f"{directory} holds neither a measured.json (simulate --validate --run) nor a "
                                  f"shaped-links results.json")


def run_one_node(out: Path, log: Callable[[str], None], seconds: float = RUN_SECONDS, tag: str = "") -> list[dict]:
    """Train every ``ONE_NODE`` configuration for ``seconds`` on this machine; their records (run directories
    named with ``tag``)."""
    from distbelief.api import train_task

    records = []
    cores = os.cpu_count() or 1
    for name, extra in ONE_NODE.items():
        values = {**FIG4_TASK, **extra, "max_seconds": seconds, "out": str(out / "runs" / (name + tag))}
        cfg = config_from(values).validate()
        log(f"validate: running {name} for {seconds:g} s")
        t = time.monotonic()
        s, probe = probed({**FIG4_TASK, **extra}, lambda: train_task(cfg).summary)
        log(f"validate: {name}: {s['examples_per_s']:,.0f} examples/s, staleness {s.get('staleness_mean')} "
            f"({time.monotonic() - t:.0f} s with start-up; a step {probe['step_probe_s'] * 1e3:.1f} ms, a push "
            f"{probe['memory_probe_s'] * 1e3:.2f} ms)")
        records.append({"name": name, "settings": {**FIG4_TASK, **extra},
                        "machines": {"nodes": 1, "cores_per_node": cores},
                        "examples_per_s": s["examples_per_s"], "staleness_mean": s.get("staleness_mean"),
                        **probe, "source": _keep_summary(out, name + tag)})
    return records


def median_records(rounds: list[list[dict]]) -> list[dict]:
    """One record per configuration from several rounds of them: the median examples/s and staleness, every
    round's values kept (``examples_per_s_runs``) so the spread between runs is on record."""
    out = []
    for recs in zip(*rounds, strict=True):
        rates = [r["examples_per_s"] for r in recs]
        stale = [r["staleness_mean"] for r in recs if r["staleness_mean"] is not None]
        # the machine's speed at the run whose rate is the median (an even count: the mean of the middle two's)
        order = sorted(range(len(recs)), key=lambda i: rates[i])
        middle = [recs[i] for i in order[(len(recs) - 1) // 2: len(recs) // 2 + 1]]
        probes = {}
        for key in ("step_probe_s", "memory_probe_s"):
            at = [r.get(key) for r in middle]
            probes[key] = statistics.fmean(at) if None not in at else None
            probes[key + "_runs"] = [r.get(key) for r in recs]
        out.append({**recs[0], "examples_per_s": statistics.median(rates), "examples_per_s_runs": rates,
                    "staleness_mean": statistics.median(stale) if stale else None, **probes,
                    "source": [r["source"] for r in recs]})
    return out


def _keep_summary(out: Path, name: str) -> str:
    """Copy run ``name``'s summary to ``out/summaries/`` (the run directory, checkpoints and all, stays under
    ``out/runs/``) and return the copy's path."""
    keep = out / "summaries" / f"{name}.json"
    keep.parent.mkdir(parents=True, exist_ok=True)
    keep.write_text((out / "runs" / name / "summary.json").read_text())
    return str(keep)


def run_shaped(out: Path, log: Callable[[str], None], seconds: float = RUN_SECONDS, tag: str = "") -> list[dict]:
    """Train every ``SHAPED`` configuration for ``seconds`` on a 4-node shaped cluster of this machine, one
    cluster per link rate, the driver on node 0 (``distbelief train --address`` in its namespace); their
    records. Linux and root only; the clusters are down again when this returns."""
    from distbelief.runtime import netcluster

    netcluster.require_root_linux()
    records = []
    for bandwidth in dict.fromkeys(bw for bw, _ in SHAPED.values()):
        c = netcluster.up(nodes=4, bandwidth=bandwidth, cpus_per_node=1, shard_nodes=2, log=log)
        try:
            for name, (bw, extra) in SHAPED.items():
                if bw != bandwidth:
                    continue
                settings = {k: v for k, v in {**FIG4_TASK, **extra}.items() if v is not None}
                run_dir = out / "runs" / (name + tag)
                flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
                cmd = ["ip", "netns", "exec", c.nodes[0].netns, sys.executable, "-m", "distbelief.cli", "train",
                       *flags, f"--max-seconds={seconds}", "--address", c.address, "--out", str(run_dir)]
                log(f"validate: running {name} for {seconds:g} s")
                t = time.monotonic()

                def train(cmd=cmd, name=name, run_dir=run_dir):
                    with open(out / "runs" / f"{name}{tag}.log", "w") as f:
                        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT,
                                       timeout=20 * seconds + 300, env={**os.environ, "RAY_AUTH_MODE": "token"})
                    return json.loads((run_dir / "summary.json").read_text())

                s, probe = probed(settings, train)
                log(f"validate: {name}: {s['examples_per_s']:,.0f} examples/s, staleness {s.get('staleness_mean')} "
                    f"({time.monotonic() - t:.0f} s with start-up; a step {probe['step_probe_s'] * 1e3:.1f} ms, a "
                    f"push {probe['memory_probe_s'] * 1e3:.2f} ms)")
                records.append({"name": name, "settings": settings,
                                "machines": {"nodes": 4, "cores_per_node": 1, "shared_cores": os.cpu_count() or 1,
                                             "shard_nodes": 2, "bandwidth": parse_bandwidth(bandwidth)},
                                "examples_per_s": s["examples_per_s"], "staleness_mean": s.get("staleness_mean"),
                                **probe, "source": _keep_summary(out, name + tag)})
        finally:
            netcluster.down(c.name, log=log)
    return records


# ---------------------------------------------------------------------- comparing
def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a between two score lists: (concordant - discordant pairs) / all pairs (1: same order)."""
    n = len(a)
    if n < 2:
        raise ValueError("Kendall's tau needs at least 2 items")
    s = 0
    for i in range(n):
        for j in range(i + 1, n):
            s += (1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0)
    return s / (n * (n - 1) / 2)


def round_as_prediction(runs: list[list[float]], rounds: int) -> dict:
    """The targets' three numbers for one round taken as the prediction of another (``runs``: examples/s per
    configuration, one per round): what the measurement itself scores when repeated minutes later, with the error
    a prediction's (predicted over measured, minus 1). Of every ordered pair of rounds, the one with the lowest
    max error: the best the measurement does against itself."""
    orders = [(i, j) for i in range(rounds) for j in range(rounds) if i != j]
    errors = {(i, j): [abs(x[i] / x[j] - 1) for x in runs] for i, j in orders}
    (i, j), errs = min(errors.items(), key=lambda kv: max(kv[1]))
    return {"mean_error": sum(errs) / len(errs), "max_error": max(errs),
            "kendall_tau": kendall_tau([x[i] for x in runs], [x[j] for x in runs]),
            "prediction_round": i + 1, "measured_round": j + 1}


def rounds_agreement(records: list[dict], predicted: list[float] | None = None) -> dict | None:
    """How far the measurement agrees with itself, for records measured in several rounds (``median_records``:
    ``examples_per_s_runs``, as many rounds each): Kendall's tau between every two rounds' rankings (the lowest),
    the pairs of configurations that some two rounds order differently, and each configuration's spread between
    its rounds (largest over smallest, minus 1), and a round's scores as the prediction of another
    (``round_as_prediction``). With ``predicted`` (examples/s per record), also how many of
    the pairs that every round orders alike the prediction orders that way too. None with fewer than two rounds
    or records."""
    runs = [r.get("examples_per_s_runs") or [] for r in records]
    rounds = min(map(len, runs), default=0)
    if rounds < 2 or len(records) < 2:
        return None
    taus = [kendall_tau([x[i] for x in runs], [x[j] for x in runs])
            for i in range(rounds) for j in range(i + 1, rounds)]
    swapped, alike = [], []
    for a in range(len(records)):
        for b in range(a + 1, len(records)):
            signs = {math.copysign(1, runs[a][i] - runs[b][i]) for i in range(rounds)}
            (swapped if len(signs) > 1 else alike).append((a, b))
    spread = [max(x[:rounds]) / min(x[:rounds]) - 1 for x in runs]
    out = {"rounds": rounds, "kendall_tau_between_rounds": min(taus), "pairs": len(swapped) + len(alike),
           "pairs_swapped": [[records[a]["name"], records[b]["name"]] for a, b in swapped],
           "spread": {r["name"]: s for r, s in zip(records, spread)}, "spread_max": max(spread),
           "spread_median": statistics.median(spread), "round_as_prediction": round_as_prediction(runs, rounds)}
    if predicted is not None:
        measured = [r["examples_per_s"] for r in records]
        otherwise = [(a, b) for a, b in alike if (measured[a] - measured[b]) * (predicted[a] - predicted[b]) <= 0]
        out["pairs_alike"] = len(alike)
        out["pairs_alike_predicted_so"] = len(alike) - len(otherwise)
        out["pairs_alike_predicted_otherwise"] = [[records[a]["name"], records[b]["name"]] for a, b in otherwise]
    return out


def speed_factor(rec: dict, costs: Costs) -> tuple[float, float]:
    """How much slower this machine was at the time of the record's run than the calibration says: its step
    (``step_probe_s`` against the calibration's step of the same model) and its memory (``memory_probe_s``
    against the calibration's Adagrad push of as many values). ``(1, 1)`` for a record without probes; the memory
    factor is the step's for a record without that probe. The probe times the whole model's step in one
    process, so a model-parallel run's is held against the whole model's step too, not its partitions'."""
    from dataclasses import replace

    from distbelief.simulate.downpour import compute_seconds

    probe, memory = rec.get("step_probe_s"), rec.get("memory_probe_s")
    if not probe:
        return 1.0, 1.0
    step = probe / compute_seconds(replace(Workload.from_config(config_from(rec["settings"])), partitions=1), costs)
    if not memory:
        return step, step
    return step, memory / (costs.update_s("adagrad") * MEMORY_PROBE_VALUES)


def predict_record(rec: dict, costs: Costs, steps: int = 60, speed: bool = True) -> dict:
    """The simulator's prediction for a record: with ``costs`` scaled by the machine's speed at the time of the
    run (``speed_factor``), or as calibrated (``speed=False``)."""
    cfg = config_from(rec["settings"])
    work = Workload.from_config(cfg)
    m = Machines(**rec["machines"])
    factor, memory = speed_factor(rec, costs) if speed else (1.0, 1.0)
    scaled = costs.scaled(factor, memory) if (factor, memory) != (1.0, 1.0) else costs
    p = simulate(work, m, scaled, steps=steps)
    return {"examples_per_s": p.examples_per_s, "staleness_mean": p.staleness_mean, "bottleneck": p.bottleneck,
            "speed": factor, "memory_speed": memory}


def compare(records: list[dict], costs: Costs, steps: int = 60, speed: bool = True) -> dict:
    """Every record predicted (``predict_record``), and the errors."""
    rows = []
    for rec in records:
        pred = predict_record(rec, costs, steps, speed)
        err = pred["examples_per_s"] / rec["examples_per_s"] - 1
        ms, ps = rec.get("staleness_mean"), pred["staleness_mean"]
        rows.append({"name": rec["name"], "measured_examples_per_s": rec["examples_per_s"],
                     "predicted_examples_per_s": pred["examples_per_s"], "error": err,
                     "measured_staleness": ms, "predicted_staleness": ps,
                     "staleness_error": (ps - ms) if ms is not None and not math.isnan(ps) else None,
                     "bottleneck": pred["bottleneck"], "speed": pred["speed"], "memory_speed": pred["memory_speed"],
                     "source": rec.get("source", "")})
    errs = [abs(r["error"]) for r in rows]
    st = [abs(r["staleness_error"]) for r in rows if r["staleness_error"] is not None]
    tau = (kendall_tau([r["measured_examples_per_s"] for r in rows], [r["predicted_examples_per_s"] for r in rows])
           if len(rows) >= 2 else math.nan)
    return {"rows": rows, "mean_error": sum(errs) / len(errs), "max_error": max(errs),
            "staleness_mean_abs_error": sum(st) / len(st) if st else None,
            "staleness_max_abs_error": max(st) if st else None, "kendall_tau": tau, "configurations": len(rows),
            "measurement": rounds_agreement(records, [r["predicted_examples_per_s"] for r in rows]),
            "speed_scaled": speed, "costs": {"machine": costs.machine, "date": costs.date}}


def format_comparison(c: dict) -> str:
    lines = [f"{'configuration':44s} {'measured':>10} {'predicted':>10} {'error':>7}   {'staleness meas/pred':>20}"
             f"  {'speed':>5} {'mem':>5}  bottleneck (predicted)"]
    for r in c["rows"]:
        ms = "-" if r["measured_staleness"] is None else f"{r['measured_staleness']:.2f}"
        ps = "-" if r["predicted_staleness"] is None or math.isnan(r["predicted_staleness"]) else \
            f"{r['predicted_staleness']:.2f}"
        lines.append(f"{r['name']:44s} {r['measured_examples_per_s']:>10,.0f} {r['predicted_examples_per_s']:>10,.0f} "
                     f"{r['error']:>+7.1%}   {ms + ' / ' + ps:>20}  {r.get('speed', 1.0):>5.2f} {r.get('memory_speed', 1.0):>5.2f}  {r['bottleneck']}")
    lines.append(f"examples/s: mean error {c['mean_error']:.1%}, max {c['max_error']:.1%} over {c['configurations']} "
                 f"configurations; Kendall tau {c['kendall_tau']:.3f}")
    if any(r.get("speed", 1.0) != 1.0 for r in c["rows"]):
        lines.append("speed, mem: the run's step and a shard's push, timed just before and after it, over the "
                     "calibration's (the CPU costs scaled by them: the shards', copies' and transfers' work per value "
                     "or byte by mem, the rest by speed)")
    if c["staleness_mean_abs_error"] is not None:
        lines.append(f"staleness: mean error {c['staleness_mean_abs_error']:.2f} updates, max "
                     f"{c['staleness_max_abs_error']:.2f}")
    m = c.get("measurement")
    if m:
        worst = max(m["spread"], key=m["spread"].get)
        swapped = "; ".join(" / ".join(p) for p in m["pairs_swapped"]) or "none"
        lowest = " (the lowest of any two)" if m["rounds"] > 2 else ""
        lines.append(f"the measurement against itself ({m['rounds']} rounds; the medians are compared above): "
                     f"Kendall tau {m['kendall_tau_between_rounds']:.3f} between its rounds{lowest}, "
                     f"{len(m['pairs_swapped'])} of {m['pairs']} pairs ordered differently by them ({swapped}); a "
                     f"configuration's rounds differ by {m['spread_median']:.1%} (median), "
                     f"{m['spread_max']:.1%} at most ({worst})")
        r = m.get("round_as_prediction")
        if r:
            lines.append(f"round {r['prediction_round']} taken as the prediction of round "
                         f"{r['measured_round']} (what repeating the measurement minutes later scores on the "
                         f"targets' terms; the best of every two rounds): mean error {r['mean_error']:.1%}, max "
                         f"{r['max_error']:.1%}, Kendall tau {r['kendall_tau']:.3f}")
        if "pairs_alike" in m:
            otherwise = "; ".join(" / ".join(p) for p in m["pairs_alike_predicted_otherwise"])
            lines.append(f"of the {m['pairs_alike']} pairs every round orders alike, the prediction orders "
                         f"{m['pairs_alike_predicted_so']} the same way" + (f" (not: {otherwise})" if otherwise else ""))
    return "\n".join(lines)


def validate_command(args) -> int:
    if args.repeats < 1:
        raise ConfigError("repeats", f"must be >= 1, got {args.repeats}")
    def log(msg: str) -> None:
        print(msg, flush=True, file=sys.stderr)

    costs = load_costs(args.costs)
    records: list[dict] = []
    if args.run:
        if not args.out:
            raise ConfigError("out", "simulate --validate --run writes its runs and measured.json there: give "
                                     "--out DIR")
        out = Path(args.out)
        (out / "runs").mkdir(parents=True, exist_ok=True)
        shaped = os.geteuid() == 0 and sys.platform.startswith("linux")
        if not shaped:
            log("validate: not root on Linux: the shaped-cluster configurations are not run (read recorded ones "
                "with --measured)")
        rounds = []
        for i in range(args.repeats):  # in rounds: a slow stretch of the machine falls on every configuration
            tag = f"-r{i + 1}" if args.repeats > 1 else ""
            ran = run_one_node(out, log, tag=tag)
            if shaped:
                ran += run_shaped(out, log, tag=tag)
            rounds.append(ran)
        ran = median_records(rounds)
        (out / "measured.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "repeats": args.repeats,
                                                       "records": ran}, indent=1) + "\n")
        records += ran
    for d in args.measured or []:
        records += read_records(d)
    if len(records) < 2:
        raise ConfigError("validate", "needs measurements: --run (the one-node configurations, now) and/or "
                                      "--measured DIR (a measured.json or a shaped-links results.json)")
    c = compare(records, costs)
    raw = compare(records, costs, speed=False)
    c["unscaled"] = {k: raw[k] for k in ("mean_error", "max_error", "kendall_tau")}
    print(format_comparison(c))
    if any(r["speed"] != 1.0 for r in c["rows"]):
        print(f"with the calibration as it is (no speed probes): mean error {raw['mean_error']:.1%}, max "
              f"{raw['max_error']:.1%}; Kendall tau {raw['kendall_tau']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(c, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0

