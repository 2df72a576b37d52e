"""``distbelief simulate`` and ``distbelief plan``: their options, and what they print and write."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from distbelief.config import RunConfig, config_from, load_toml
from distbelief.exceptions import ConfigError
from distbelief.simulate.costs import load_costs
from distbelief.simulate.machines import Machines, format_bandwidth, parse_bandwidth

MACHINE_FLAGS = ("nodes", "cores_per_node", "bandwidth", "latency_ms", "shared_cores", "shard_nodes")


def _add_machines(p, *, plan: bool = False) -> None:
    g = p.add_argument_group("machines (the simulated cluster)")
    g.add_argument("--nodes", type=int, default=None if plan else 1, required=plan, help="machines in the cluster"
                   + ("" if plan else " [default: 1]"))
    g.add_argument("--cores-per-node", type=int, default=None, required=plan,
                   help="cores of each machine" + ("" if plan else " [default: this machine's]"))
    g.add_argument("--bandwidth", default="1gbit" if plan else "inf",
                   help="each node's link rate, each direction: 1gbit, 100mbit, 10gbit, ... or inf [default: "
                        + ("1gbit" if plan else "inf") + "]")
    g.add_argument("--latency-ms", type=float, default=0.0, help="one-way link latency [default: 0]")
    if not plan:
        g.add_argument("--shared-cores", type=int, default=0,
                       help="all nodes share this many cores (the shaped cluster of `distbelief cluster up` on one "
                            "machine) [default: 0, every node its own]")
        g.add_argument("--shard-nodes", type=int, default=0,
                       help="put the shards on the last K nodes, the replicas on the others (cluster up "
                            "--shard-nodes) [default: 0, spread]")
    g.add_argument("--costs", default=None, metavar="FILE",
                   help="the costs to simulate with, written by `simulate --calibrate --costs FILE` [default: the "
                        "calibration shipped with distbelief, measured on the benchmark machine]")


def add_simulate(sub, add_run_flags) -> None:
    p = sub.add_parser(
        "simulate", help="predict a run's throughput and bottleneck with a discrete-event model (no training)",
        description="Simulate a Downpour, sync or Sandblaster run (the same settings as `train`) on a cluster you "
        "describe: examples/s, a replica's step split into compute and waiting, staleness, how busy every shard, "
        "core and link is, and the bottleneck. --calibrate measures this machine's costs; --validate compares "
        "predictions with real runs.")
    p.add_argument("--config", help="TOML file with run settings, as for train")
    p.add_argument("--json", metavar="FILE", help="also write the prediction as JSON")
    p.add_argument("--plot", metavar="PNG", help="also plot the step breakdown and the utilisation")
    p.add_argument("--steps", type=int, default=60, help="simulated steps per replica (after a warm-up) "
                   "[default: 60]")
    p.add_argument("--stragglers", default="", metavar="R:F,...",
                   help="replicas that compute F times slower, e.g. 0:2.5 (replica 0 at 2.5x the step time)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine's costs with distbelief's own code paths and write them to --costs "
                        "(default: ./costs.json); nothing is simulated")
    p.add_argument("--links", action="store_true",
                   help="with --calibrate: also measure what a shaped link delivers (Linux, root: a 2-node "
                        "`cluster up`)")
    p.add_argument("--validate", action="store_true",
                   help="predict a fixed set of real configurations and compare with their measurements: mean "
                        "and max error of examples/s and staleness, and the ranking (Kendall tau)")
    p.add_argument("--measured", metavar="DIR", action="append", default=None,
                   help="with --validate: read measurements from this directory (repeatable; a validate run's "
                        "measured.json or a shaped-links benchmark's results.json)")
    p.add_argument("--repeats", type=int, default=1,
                   help="with --validate --run: run every configuration this many times, in rounds, and compare "
                        "with the median [default: 1]")
    p.add_argument("--paper-scale", metavar="DIR",
                   help="the paper at its scale: Fig. 3 (speed-up vs machines per replica, the 42M speech and 1.7B "
                        "image models) and throughput vs replicas up to 2,000 (shards needed), JSON and PNG into "
                        "DIR (a few minutes); nothing else is simulated")
    p.add_argument("--run", action="store_true",
                   help="with --validate: run the one-node configurations now (a few minutes) and save them in "
                        "--out (the run directories and measured.json)")
    _add_machines(p)
    add_run_flags(p)


def add_plan(sub) -> None:
    p = sub.add_parser(
        "plan", help="suggest replicas, shards, partitions, n_fetch/n_push and compression for a cluster",
        description="Search the settings of a Downpour run of MODEL on the cluster you describe with the "
        "simulator and print the best few, with why (the bottleneck each one meets).")
    p.add_argument("--model", required=True, help="a shipped model (speech-paper, speech-tiny, mlp, ...)")
    p.add_argument("--task", default=None, help="its task [default: the model's: speech for speech-*, mnist1d "
                                               "otherwise]")
    p.add_argument("--num-classes", type=int, default=None, help="output classes [default: the task's]")
    p.add_argument("--batch-size", type=int, default=None, help="minibatch per replica [default: the model's]")
    p.add_argument("--top", type=int, default=5, help="how many settings to print [default: 5]")
    p.add_argument("--json", metavar="FILE", help="also write every setting tried, as JSON")
    _add_machines(p, plan=True)


def machines_from(args) -> Machines:
    import os

    cores = args.cores_per_node if args.cores_per_node is not None else (os.cpu_count() or 1)
    for name in ("nodes", "cores_per_node"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(name, f"must be >= 1, got {v}")
    if args.latency_ms < 0:
        raise ConfigError("latency_ms", f"must be >= 0, got {args.latency_ms}")
    shared = getattr(args, "shared_cores", 0)
    if shared < 0:
        raise ConfigError("shared_cores", f"must be >= 0, got {shared}")
    return Machines(nodes=args.nodes, cores_per_node=cores, bandwidth=parse_bandwidth(args.bandwidth),
                    latency_s=args.latency_ms / 1e3, shared_cores=shared,
                    shard_nodes=getattr(args, "shard_nodes", 0))


def parse_stragglers(text: str, replicas: int) -> dict[int, float]:
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        try:
            r, f = item.split(":")
            r, f = int(r), float(f)
        except ValueError:
            raise ConfigError("stragglers", f"expected REPLICA:FACTOR[,...] such as 0:2.5, got {item!r}") from None
        if not 0 <= r < replicas:
            raise ConfigError("stragglers", f"replica {r} does not exist (replicas 0..{replicas - 1})")
        if not f >= 1:
            raise ConfigError("stragglers", f"a straggler's factor is >= 1 (times slower), got {f}")
        out[r] = f
    return out


def run_config_from(args) -> RunConfig:
    values = load_toml(args.config) if args.config else {}
    for f in fields(RunConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    return config_from(values).normalized()


# Options of simulate and plan that are not run settings: an error about one names it as the flag typed.
OWN_FLAGS = {"repeats", "paper_scale", "nodes", "cores_per_node", "bandwidth", "latency_ms", "shared_cores",
             "shard_nodes", "costs",
             "stragglers", "steps", "top", "measured", "validate", "model", "task", "num_classes", "batch_size",
             "out"}


def main(args: argparse.Namespace) -> int:
    try:
        if args.command == "plan":
            return _plan(args)
        if args.calibrate:
            return _calibrate(args)
        if args.validate:
            from distbelief.simulate.validate import validate_command

            return validate_command(args)
        if args.paper_scale:
            return _paper_scale(args)
        return _simulate(args)
    except ConfigError as e:
        if e.field in OWN_FLAGS:
            raise ConfigError("--" + e.field.replace("_", "-"), str(e).split(": ", 1)[1]) from None
        raise


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _calibrate(args) -> int:
    from distbelief.simulate.calibrate import calibrate

    path = Path(args.costs or "costs.json")
    costs = calibrate(path, links=args.links, log=_log)
    print(f"wrote {path} ({costs.machine}, {costs.date})")
    return 0


def _paper_scale(args) -> int:
    from distbelief.simulate import paper

    out = Path(args.paper_scale)
    costs = load_costs(args.costs)
    fig3 = paper.paper_scale(out, costs)
    for m in fig3["models"]:
        best = max(m["rows"], key=lambda r: r["speedup"])
        print(f"fig. 3, {m['key']} ({m['params'] / 1e6:,.0f}M parameters): best {best['speedup']:.2f}x at "
              f"{best['P']} machines; paper: {'; '.join(p['says'] for p in m['paper'])}")
    sweep = paper.replicas_sweep(costs, log=_log)
    (out / "replicas-paper-scale.json").write_text(json.dumps(sweep, indent=1) + "\n")
    paper.plot_replicas(sweep, out / "replicas-paper-scale.png")
    for strategy, rows in sweep["strategies"].items():
        for r in rows:
            print(f"{strategy:11s} {r['replicas']:>5} replicas: {r['fed_examples_per_s']:>10,.0f} examples/s with "
                  f"{r['shards_to_feed']} shards ({r['fed_bottleneck']})")
    print(f"wrote {out}")
    return 0


def _simulate(args) -> int:
    from distbelief.simulate.predict import simulate
    from distbelief.simulate.workload import Workload

    if args.steps < 1:
        raise ConfigError("steps", f"must be >= 1, got {args.steps}")
    cfg = run_config_from(args)
    machines = machines_from(args)
    costs = load_costs(args.costs)
    work = Workload.from_config(cfg, slow=parse_stragglers(args.stragglers, cfg.replicas))
    pred = simulate(work, machines, costs, steps=args.steps)
    print(report(work, machines, costs, pred))
    if args.json:
        out = {"settings": describe_work(work), "machines": machines.describe(), "costs": costs.machine,
               "prediction": pred.to_json()}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        from distbelief.simulate.plots import plot_prediction

        plot_prediction(pred, f"{describe_work(work)} on {machines.describe()}", args.plot)
        print(f"wrote {args.plot}")
    return 0


def describe_work(work) -> str:
    extra = ""
    if work.compress != "none" or work.compress_fetch != "none":
        extra = f", compress {work.compress}/{work.compress_fetch}"
    if work.partitions > 1:
        extra += f", {work.partitions} partitions"
    cadence = "" if work.fetch_every == work.push_every == 1 else f", n_fetch {work.fetch_every} n_push " \
                                                                   f"{work.push_every}"
    return (f"{work.strategy} {work.profile.name} ({work.profile.params / 1e6:.2f}M parameters), {work.replicas} "
            f"replicas x {work.shards} shards, batch {work.batch}{cadence}{extra}")


def report(work, machines, costs, pred) -> str:
    lines = [f"simulated: {describe_work(work)}",
             f"on: {machines.describe()}; costs: {costs.machine or 'uncalibrated'} {costs.date}".rstrip(),
             f"  examples/s        {pred.examples_per_s:,.0f}",
             f"  replica step      {pred.step_s * 1e3:.1f} ms: compute {pred.compute_s * 1e3:.1f} ms, waiting "
             f"{pred.wait_s * 1e3:.1f} ms"]
    if pred.staleness_histogram:
        lines.append(f"  staleness         mean {pred.staleness_mean:.2f}, max {max(pred.staleness_histogram)}")
    lines.append("  shards busy       " + ", ".join(f"{b:.0%}" for b in pred.shard_busy))
    lines.append("  cores busy        " + ", ".join(f"{b:.0%}" for b in pred.cpu_busy))
    if pred.link_busy:
        top = sorted(pred.link_busy.items(), key=lambda kv: -kv[1])[:4]
        lines.append("  busiest links     " + ", ".join(f"{k} {v:.0%}" for k, v in top)
                     + f" of {format_bandwidth(machines.bandwidth)}")
    lines.append(f"  bottleneck        {pred.bottleneck}: {pred.why}")
    return "\n".join(lines)


def _plan(args) -> int:
    from distbelief.simulate.plan import plan, plan_report

    machines = machines_from(args)
    costs = load_costs(args.costs)
    if args.top < 1:
        raise ConfigError("top", f"must be >= 1, got {args.top}")
    result = plan(args.model, machines, costs, task=args.task, num_classes=args.num_classes,
                  batch_size=args.batch_size, log=_log)
    print(plan_report(result, machines, args.top))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0
