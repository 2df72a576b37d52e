"""Command line: ``distbelief train | bench | plot | cluster | simulate | plan``."""

from __future__ import annotations

import argparse
import re
import signal
import sys
from dataclasses import fields
from pathlib import Path

from distbelief.config import (APPLIES_TO, COMPRESSION, DURABILITY_MODES, FETCH_COMPRESSION, FIELD_HELP, LOCAL_STRATEGIES, OPTIMIZERS, SECTIONS,
                               RunConfig, config_from, ignored_by_strategy, load_toml, saved_run_values, section_of)
from distbelief import stopping
from distbelief.exceptions import ClusterUnreachableError, ConfigError, DistBeliefError

CHOICES = {
    "task": ("mnist1d", "speech", "shapes", "ctr"),
    "strategy": ("sgd", "sync", "downpour", "sandblaster", "hogwild", "ddp"),
    "optimizer": OPTIMIZERS,
    "runtime": ("ray", "inprocess"),
    "durability": DURABILITY_MODES,
    "evaluation": ("auto", "paused", "concurrent"),
    "compress": COMPRESSION,
    "compress_fetch": FETCH_COMPRESSION,
}


FORMER_FLAGS = {"optimizer": ("--server-optimizer",)}  # still accepted: older scripts and docs use them

SECTION_TITLES = {
    "task": "task and model",
    "run": "run (strategy, replicas, shards, partitions, batch, update rule and rate)",
    "stop": "when to stop",
    "downpour": "Downpour",
    "sandblaster": "Sandblaster L-BFGS",
    "eval": "evaluation",
    "durability": "shard durability",
    "cluster": "cluster",
}


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (Downpour SGD by default)",
        description="Train a shipped task/model with Downpour SGD, Sandblaster L-BFGS, synchronous data "
        "parallelism or single-process SGD. Settings come from --config (TOML) and are overridden by options.",
    )
    p.add_argument("--config", help="TOML file with settings: the option names with underscores, at the top "
                                    "level or in their section ([task], [run], ... as the groups below say)")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue a stopped or killed run from its checkpoints (its config.toml is the base; "
                        "options override it, e.g. --max-seconds or --shards to reshard)")
    add_run_flags(p)


def add_run_flags(p) -> None:
    """One option per RunConfig setting, in one help group per TOML section (train's, also simulate's)."""
    defaults = RunConfig()
    # One help group per TOML section, in the sections' order (config.SECTIONS).
    groups = {sec: p.add_argument_group(title, f"TOML section [{sec}]")
              for sec, title in SECTION_TITLES.items()}
    order = {name: i for i, name in enumerate(n for names in SECTIONS.values() for n in names)}
    for f in sorted(fields(RunConfig), key=lambda f: order[f.name]):
        g = groups[section_of(f.name)]
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)  # None: the help text says what the default is
        help_text = FIELD_HELP.get(f.name, "") + ("" if default is None else f" [default: {default!r}]")
        if f.type in (bool, "bool"):
            on = getattr(defaults, f.name)
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                           help=FIELD_HELP.get(f.name, "") + f" [default: {'on' if on else 'off'}, "
                           f"--{'no-' if on else ''}{f.name.replace('_', '-')} to turn it {'off' if on else 'on'}]")
        else:
            # Values are parsed and validated by RunConfig so that errors name the setting consistently.
            g.add_argument(flag, *FORMER_FLAGS.get(f.name, ()), dest=f.name, default=None, metavar=f.name.upper(),
                           help=help_text, choices=CHOICES.get(f.name))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distbelief",
        description="DistBelief for PyTorch: Downpour SGD on a sharded parameter server, on Ray.",
    )
    from distbelief import __version__

    parser.add_argument("--version", action="version", version=f"distbelief {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    p = sub.add_parser("bench", help="rerun the paper's Figures 3-5, or the throughput of the defaults, on this "
                       "machine (results.json + PNGs)",
                       description="fig3: model-parallel speedup vs partitions (fully vs locally connected); fig4: "
                       "accuracy vs time per method from one warmstart; fig5: time to a target accuracy vs cores; "
                       "throughput: examples/s of Downpour vs single-process SGD (1 and 2 threads) and Hogwild with "
                       "the default settings, back to back, median of --repeats. Writes results.json (configs, "
                       "measurements, machine) and, for the figures, PNGs into --out.")
    p.add_argument("figure", choices=("fig3", "fig4", "fig5", "throughput"))
    p.add_argument("--out", required=True, help="directory for results.json, the figures and the runs")
    p.add_argument("--cores", type=int, default=None,
                   help="fig3/fig4/fig5: cores to use (default: all of this machine's); fig5 sweeps 1, 2, 4, ... up "
                        "to it. A command refuses the options it does not read")
    p.add_argument("--quick", action="store_true", help="a reduced sweep on tiny sizes (minutes; mechanics only)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="fig4/fig5/throughput: budget per run (default: fig4/fig5 the recipe's, throughput 40)")
    p.add_argument("--methods", nargs="+", default=None,
                   help="fig4/fig5: only these methods (sgd-1 sgd-all adagrad-all downpour-sgd downpour-adagrad "
                        "sandblaster ddp hogwild); throughput: these (sgd-1 sgd-2 hogwild downpour ddp; default all "
                        "but ddp)")
    p.add_argument("--steps", type=int, default=None, help="fig3: timed steps per point")
    p.add_argument("--models", nargs="+", default=None,
                   help="throughput: paper (42M-parameter speech model), fig4 (speech-tiny, 8192 Zipf classes) "
                        "and/or ctr (dlrm-small on the ctr task: sgd-1, sgd-2 with Adagrad and sparse gradients, "
                        "downpour) (default: paper and fig4; --quick runs one tiny model instead)")
    p.add_argument("--address", default=None,
                   help="throughput, fig4: run the Ray strategies (downpour, sync, sandblaster) on the Ray cluster at "
                        "this address (token authentication as for train); the local baselines run on this "
                        "machine. fig3 and fig5 pin this machine's cores and refuse it")
    p.add_argument("--repeats", type=int, default=None,
                   help="throughput: rounds of every method, interleaved; the median is reported (default 3). "
                        "fig4: runs of every method, in interleaved rounds from the one warmstart; the targets "
                        "compare medians, the table gives min-max (default 1)")
    p = sub.add_parser("plot", help="overlay the accuracy-vs-time curves of run directories")
    p.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    p.add_argument("--out", required=True, help="PNG file to write")
    _add_cluster(sub)
    from distbelief.simulate.commands import add_plan, add_simulate

    add_simulate(sub, add_run_flags)
    add_plan(sub)
    return parser


def _add_cluster(sub) -> None:
    """``cluster up | down | status``: a shaped Ray cluster on this machine (runtime/netcluster.py)."""
    from distbelief.runtime.netcluster import DEFAULT_NAME, DEFAULT_SUBNET

    p = sub.add_parser("cluster", help="a shaped multi-node Ray cluster on this machine (Linux, root): nodes in "
                       "network namespaces on a bridge, every link limited with tc",
                       description="Bring up N Ray nodes, each in its own network namespace, joined by a bridge "
                       "whose links are shaped with tc (rate and one-way delay), so that a `distbelief train "
                       "--address` run moves its bytes over real, limited links. docs/cluster.md, \"A shaped "
                       "cluster on one machine\".")
    ops = p.add_subparsers(dest="cluster_command", required=True)
    u = ops.add_parser("up", help="bring a cluster up; prints its address (for train --address) on stdout")
    u.add_argument("--nodes", type=int, required=True, help="Ray nodes (node 0 is the head)")
    u.add_argument("--bandwidth", default="1gbit", help="rate of every link, each way (tc units: 1gbit, 100mbit, "
                                                        "500kbit) [default: 1gbit]")
    u.add_argument("--delay", default="0", help="one-way delay added between two nodes (1ms, 500us, 0; needs the "
                                                 "kernel's netem qdisc) [default: 0]")
    u.add_argument("--cpus-per-node", type=int, default=1, help="logical CPUs each node offers Ray [default: 1]")
    u.add_argument("--shard-nodes", type=int, default=0,
                   help="the last K nodes are dedicated parameter-shard nodes (the distbelief_shard resource, no "
                        "CPUs): shards and replicas on different nodes [default: 0]")
    u.add_argument("--object-store-mb", type=int, default=512, help="each node's Ray object store [default: 512]")
    u.add_argument("--subnet", default=DEFAULT_SUBNET, help=f"private /24 of the nodes [default: {DEFAULT_SUBNET}]")
    u.add_argument("--timeout-s", type=float, default=180.0, help="for all nodes to join [default: 180]")
    d = ops.add_parser("down", help="stop the cluster's Ray processes, remove its namespaces and links (also "
                       "what a crash left)")
    for op in (u, d):
        op.add_argument("--name", default=DEFAULT_NAME,
                        help=f"cluster name, prefix of its namespaces and links [default: {DEFAULT_NAME}]")
    st = ops.add_parser("status", help="clusters up (or left by a crash), their nodes and link counters")
    st.add_argument("--name", default=None, help="only this cluster [default: all]")
    st.add_argument("--json", action="store_true", help="print the status as JSON")


# every name an error may start with that the user typed as a flag: the settings, and the options of train and bench
_SETTINGS = frozenset(f.name for f in fields(RunConfig)) | {"resume", "config", "cores", "methods", "models",
                                                            "repeats", "steps"}


def as_flags(err: ConfigError) -> str:
    """A configuration error in the words of someone who typed flags: the setting it names becomes its flag
    (``partitions:`` -> ``--partitions:``), and so do the settings its text names (``use partitions = 1`` ->
    ``use --partitions 1``; ``(remote_timeout_s)`` -> ``(--remote-timeout-s)``). Errors about a TOML file keep
    the file's words."""
    text = str(err)
    if ".toml" in text:
        return text
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731

    def setting_eq(m: re.Match) -> str:
        return f"{flag(m[1])} {m[2].strip(chr(34))}" if m[1] in _SETTINGS else m[0]

    head, sep, rest = text.partition(": ")
    if sep and head in _SETTINGS:
        text = f"{flag(head)}: {rest}"
    text = re.sub(r"(?<![\w.-])([a-z_]+) = (\"[^\"]*\"|[^\s,;)]+)", setting_eq, text)
    return re.sub(r"(?<![\w.-])([a-z]+_[a-z_]+)\b",
                  lambda m: flag(m[1]) if m[1] in _SETTINGS else m[0], text)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    if args.resume:
        if args.config:
            raise ConfigError("resume", "use either --resume RUN_DIR or --config FILE, not both")
        run_cfg = Path(args.resume) / "config.toml"
        if not run_cfg.is_file():
            raise ConfigError("resume", f"{args.resume} is not a run directory (no config.toml)")
        values = saved_run_values(load_toml(run_cfg))
        values["out"] = str(args.resume)
    else:
        values = load_toml(args.config) if args.config else {}
    for f in fields(RunConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    cfg = config_from(values)
    if not args.resume:  # a resumed run's config.toml holds every setting, used or not
        for name in ignored_by_strategy(values, cfg.strategy):
            instead = " (sandblaster's batch is --lbfgs-batch)" if (name, cfg.strategy) == ("batch_size",
                                                                                          "sandblaster") else ""
            print(f"distbelief: warning: --{name.replace('_', '-')} has no effect with --strategy {cfg.strategy} "
                  f"(it is read by: {', '.join(APPLIES_TO[name])}){instead}", file=sys.stderr)
        if "staleness_bound" in values and cfg.strategy == "downpour" and cfg.consistency != "ssp":
            print("distbelief: warning: --staleness-bound has no effect without --consistency ssp", file=sys.stderr)
    if not cfg.out:
        from distbelief.metrics import default_run_dir

        cfg.out = str(default_run_dir())
    return cfg.validate()


# The options of each bench command beyond --out and --quick; one given to a command that does not read it is
# refused (not silently ignored).
BENCH_OPTIONS = {
    "fig3": ("cores", "steps"),
    "fig4": ("cores", "max_seconds", "methods", "address", "repeats"),
    "fig5": ("cores", "max_seconds", "methods"),
    "throughput": ("max_seconds", "methods", "models", "address", "repeats"),
}


def _refuse_unread_bench_options(args: argparse.Namespace) -> None:
    """ConfigError naming the first option given that ``bench FIGURE`` does not read, and the commands that do."""
    for name in sorted({n for names in BENCH_OPTIONS.values() for n in names}):
        if getattr(args, name) is None or name in BENCH_OPTIONS[args.figure]:
            continue
        if name == "address" and args.figure in ("fig3", "fig5"):
            raise ConfigError("address", f"bench {args.figure} pins this machine's cores; --address is for "
                                         f"throughput and fig4")
        readers = [f for f, names in BENCH_OPTIONS.items() if name in names]
        raise ConfigError(name, f"is not an option of bench {args.figure} (it would be ignored); it is read by "
                                f"bench {', '.join(readers)}")


def _bench(args: argparse.Namespace) -> int:
    import os

    _refuse_unread_bench_options(args)
    if args.figure == "throughput":
        return _bench_throughput(args)
    cores = args.cores if args.cores is not None else (os.cpu_count() or 1)
    have = os.cpu_count() or 1
    if not 1 <= cores <= have:
        raise ConfigError("cores", f"must be in [1, {have}] on this machine (it has {have} cores), got {cores}")
    if args.steps is not None and args.steps < 1:
        raise ConfigError("steps", f"must be >= 1, got {args.steps}")
    out = Path(args.out)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.figure == "fig3":
        from distbelief.bench.fig3 import run_fig3

        run_fig3(out, cores, args.quick, args.steps, log=log)
    else:
        from distbelief.bench import accuracy

        run = accuracy.run_fig4 if args.figure == "fig4" else accuracy.run_fig5
        extra = {"address": args.address} if args.address else {}
        if args.repeats is not None:
            extra["repeats"] = args.repeats
        run(out, cores, args.quick, args.methods, log=log, max_seconds=args.max_seconds, **extra)
    print(f"wrote {out / 'results.json'}")
    return 0


def _bench_throughput(args: argparse.Namespace) -> int:
    """``bench throughput``: runs on the whole machine (its targets are ratios measured on it), prints the
    Markdown table for benchmarks/RESULTS.md on stdout and the progress on stderr."""
    from distbelief.bench.throughput import run_throughput

    out = Path(args.out)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    res = run_throughput(out, args.quick, args.models, args.methods, args.repeats, args.max_seconds, log=log,
                         address=args.address or "")
    print(res["table_markdown"])
    print(f"wrote {out / 'results.json'}")
    return 0


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _cluster(args: argparse.Namespace) -> int:
    """``cluster up | down | status``. Bad values are refused naming their flag before anything is made; ``up``
    removes what it made when it fails or is interrupted (Ctrl-C, SIGTERM)."""
    import json

    from distbelief.runtime import netcluster

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        if args.cluster_command == "up":
            settings = (args.name, args.nodes, args.bandwidth, args.delay, args.cpus_per_node, args.shard_nodes,
                        args.subnet, args.object_store_mb)
            planned = netcluster.plan(*settings)  # every flag checked before anything is made
            if not args.timeout_s > 0:
                raise ConfigError("timeout_s", f"must be > 0, got {args.timeout_s}")
            netcluster.require_root_linux()
            netcluster.check_qdiscs(planned)  # e.g. --delay on a kernel without netem
            saved = signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM cleans up as Ctrl-C does
            try:
                c = netcluster.up(*settings, timeout_s=args.timeout_s, log=log)
            finally:
                signal.signal(signal.SIGTERM, saved)
            log(f"cluster {c.name} up: {len(c.nodes)} nodes; run a job on its head node:\n"
                f"  {c.driver_prefix()} distbelief train --address {c.address} ...\n"
                f"stop it with: distbelief cluster down --name {c.name}")
            print(c.address)
            return 0
        if args.cluster_command == "down":
            removed = netcluster.down(args.name, log=log)
            if not removed:
                log(f"cluster {args.name}: nothing to remove")
            return 0
        netcluster.require_root_linux()
        clusters = netcluster.status(args.name)
        if args.json:
            print(json.dumps(clusters, indent=1))
            return 0
        for c in clusters:
            _print_cluster(c)
        if not clusters:
            print("no shaped cluster on this machine")
        return 0
    except ConfigError as e:  # the setting's name as the flag that gave it
        raise ConfigError("--" + e.field.replace("_", "-"), str(e).split(": ", 1)[1]) from None


def _print_cluster(c: dict) -> None:
    if "address" not in c:
        print(f"{c['name']}: not up; left behind: {', '.join(c['leftovers'])} (distbelief cluster down --name "
              f"{c['name']})")
        return
    print(f"{c['name']}: {'up' if c['up'] else 'NOT whole (distbelief cluster down --name ' + c['name'] + ')'} at "
          f"{c['address']}, {c['bandwidth']} per link, {c['delay']}; driver: {c['driver_prefix']} "
          f"distbelief train --address {c['address']}")
    for n in c["nodes"]:
        moved = (f", to node {n['to_node_bytes'] / 1e6:.1f} MB, from node {n['from_node_bytes'] / 1e6:.1f} MB"
                 if "to_node_bytes" in n else "")
        extra = f" {n['resources']}" if n["resources"] else ""
        print(f"  node {n['index']} {n['ip']} ({n['netns']}): {n['cpus']} CPUs{extra}, ray start pid {n['pid']} "
              f"{'alive' if n['alive'] else 'DEAD'}{moved}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            cfg = config_from_args(args)
            from distbelief.api import train_task

            # SIGTERM is handled like Ctrl-C: stop cleanly with a final checkpoint.
            signal.signal(signal.SIGTERM, _raise_interrupt)
            result = train_task(cfg, resume=bool(args.resume))
            s = result.summary
            if "final_test_auc" in s:  # task ctr: the metric is the AUC, next to the best reachable
                planted = f" (planted {s['planted_auc']:.4f})" if "planted_auc" in s else ""
                print(f"final test AUC {s['final_test_auc']:.4f}, best {s['best_test_auc']:.4f}{planted}; run "
                      f"directory {result.run_dir}")
            else:
                print(f"final test accuracy {s['final_test_accuracy']:.4f}; run directory {result.run_dir}")
            if result.summary.get("stop_reason") == stopping.INTERRUPTED:
                if result.summary.get("strategy") not in LOCAL_STRATEGIES:  # those keep no checkpoints
                    print(f"interrupted; continue with: distbelief train --resume {result.run_dir}", file=sys.stderr)
                return 130
            return 0
        if args.command == "bench":
            return _bench(args)
        if args.command == "cluster":
            return _cluster(args)
        if args.command in ("simulate", "plan"):
            from distbelief.simulate import commands

            return commands.main(args)
        if args.command == "plot":
            from distbelief.metrics import plot_runs

            for r in args.runs:
                if not (Path(r) / "metrics.jsonl").is_file():
                    raise ConfigError("runs", f"{r} is not a run directory (no metrics.jsonl)")
            out = plot_runs(args.runs, args.out)
            print(f"wrote {out}")
            return 0
    except ConfigError as e:
        print(f"distbelief: error: {as_flags(e)}", file=sys.stderr)
        return 2
    except ClusterUnreachableError as e:
        print(f"distbelief: error: {e}", file=sys.stderr)
        return 3
    except DistBeliefError as e:
        print(f"distbelief: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("distbelief: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
