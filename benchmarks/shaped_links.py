"""Downpour over real, shaped links: compressed against uncompressed pushes and fetches on a 4-node cluster of
network namespaces on this machine (docs/compression.md; distbelief/runtime/netcluster.py).

    sudo .venv/bin/python benchmarks/shaped_links.py --out benchmarks/results/shaped-DATE \
        [--bandwidths 1gbit 10gbit] [--configs none topk-delta ...] [--paper]

Per bandwidth: ``netcluster.up`` 4 nodes (nodes 0-1: one CPU each, the replicas; nodes 2-3: dedicated shard nodes),
every link shaped to the rate with ``--delay`` one way. Each configuration is one ``distbelief train --address``
run of the Fig. 4 recipe (speech-tiny, 2.3M parameters, Downpour + Adagrad, 2 replicas x 2 shards, the recipe's
warmstart as init_params, target 13%, its 240 s budget), its driver on the head node as Ray requires. Around
each run the kernel's counters on every node's link are read: what crossed each link each way, against what the
summary says the shards read and served, and the busiest link's utilization. ``--paper`` adds the paper's 42M
model (speech-paper) at the first bandwidth: examples/s for a fixed budget, no target.

Writes results.json into --out and prints one line per run. Linux and root only (the namespaces and tc).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from distbelief.bench.recipes import recipe_for
from distbelief.runtime import netcluster

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

# name -> the compression settings of a run (everything else is the recipe's Downpour + Adagrad)
CONFIGS = {
    "none": {},
    "none-overlap": {"overlap": True},
    "topk-delta": {"compress": "topk", "compress_ratio": 0.01, "compress_fetch": "delta"},
    "topk-fp16": {"compress": "topk", "compress_ratio": 0.01, "compress_fetch": "fp16"},
    "topk": {"compress": "topk", "compress_ratio": 0.01},
    "qsgd-fp16": {"compress": "qsgd", "compress_bits": 4, "compress_fetch": "fp16"},
    "powersgd-fp16": {"compress": "powersgd", "compress_rank": 4, "compress_fetch": "fp16"},
    "fp16-fp16": {"compress": "fp16", "compress_fetch": "fp16"},
}


def flags(settings: dict) -> list[str]:
    out = []
    for k, v in settings.items():
        if v is None:  # the default
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else f"--no-{k.replace('_', '-')}")
        else:
            out += [flag, str(v)]
    return out


def warmstart(out: Path, recipe) -> Path:
    """The recipe's single-process SGD warmstart (on this machine, not the cluster), once."""
    run = out / "warmstart"
    if not (run / "params.safetensors").exists():
        cmd = [PY, "-m", "distbelief.cli", "train", *flags({**recipe.common, **recipe.warmstart}),
               "--runtime", "inprocess", "--max-seconds", "0", "--out", str(run)]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return run


def run_on_cluster(c: netcluster.Cluster, name: str, settings: dict, run_dir: Path, timeout_s: float) -> dict:
    """One ``distbelief train --address`` run with its driver on the head node; the summary and the links' bytes."""
    before, t0 = netcluster.link_counters(c.name), time.monotonic()
    cmd = ["ip", "netns", "exec", c.nodes[0].netns, PY, "-m", "distbelief.cli", "train", *flags(settings),
           "--address", c.address, "--out", str(run_dir)]
    with open(run_dir.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                       env={**os.environ, "RAY_AUTH_MODE": "token"})
    after, elapsed = netcluster.link_counters(c.name), time.monotonic() - t0
    s = json.loads((run_dir / "summary.json").read_text())
    links = {i: after[i] - before[i] for i in after}
    shard_nodes = [n.index for n in c.nodes if netcluster.SHARD_RESOURCE in n.resources]
    into_shards = sum(links[i].to_node_payload for i in shard_nodes)
    out_of_shards = sum(links[i].from_node_payload for i in shard_nodes)
    busiest = max(max(v.to_node_payload, v.from_node_payload) for v in links.values())
    rec = {
        "config": name, "settings": settings, "wall_s": s["wall_s"], "elapsed_s": round(elapsed, 1),
        "time_to_target_s": s.get("time_to_target_s"), "best_test_accuracy": s["best_test_accuracy"],
        "examples": s["examples"], "examples_per_s": s["examples_per_s"], "stop_reason": s["stop_reason"],
        "pushed_bytes_summary": sum(s.get("bytes_pushed_per_shard") or []),
        "fetched_bytes_summary": sum(s.get("bytes_fetched_per_shard") or []),
        "into_shard_nodes_bytes": into_shards, "out_of_shard_nodes_bytes": out_of_shards,
        "links": {i: {"to_node": v.to_node_payload, "from_node": v.from_node_payload} for i, v in links.items()},
        # the busiest link direction's bytes over the run's training time, against the shaped rate
        "busiest_link_utilization": busiest * 8 / (c.bandwidth_bps * s["wall_s"]) if s["wall_s"] else None,
        "replica_transports": s.get("replica_transports"), "compress": s.get("compress"),
        "compress_fetch": s.get("compress_fetch"), "updates": s["updates"],
    }
    # The driver sends each shard its initial values at the start (4 bytes a parameter), inside the window too.
    rec["initial_bytes"] = 4 * s["num_parameters"]
    if rec["pushed_bytes_summary"]:
        rec["pushed_agreement"] = into_shards / rec["pushed_bytes_summary"]
        rec["fetched_agreement"] = out_of_shards / rec["fetched_bytes_summary"]
    return rec


def report(out: Path) -> str:
    """A Markdown table of a results.json this script wrote. Beside each run's rate, time to target and busiest
    link: what crossed the shard nodes' links against the shards' own counters (summary), and the placement check
    (each replica node sends, per step of its replica, what one push weighs: its ranges go only to the shards
    that own them, each once; node 0 also hosts the driver, which sends nothing big)."""
    res = json.loads((out / "results.json").read_text())
    where = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    lines = [f"_From `{where}` ({res['date']}; {res['cpus']} cores; 4 nodes: replicas on nodes 0-1, shards on "
             f"nodes 2-3, the driver on node 0; delay {res['delay']}): one run each._", "",
             "| link | model | push / fetch | replicas' transport | examples/s | s to 13% | busiest link | into / out "
             "of shard nodes ÷ shards' counters | into shard nodes ÷ (counters + initial values) | node 0 / node 1 "
             "out per step ÷ one push |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        kind = "fig4" if r["model"] == "speech-tiny" else "paper"
        s = json.loads((out / f"{r['bandwidth']}-{kind}-{r['config']}" / "summary.json").read_text())
        steps = s["steps_per_replica"]
        push = sum(s["bytes_pushed_per_shard"]) / max(1, sum(steps))  # one push, all shards, as they read it
        links = {int(k): v for k, v in r["links"].items()}
        out_ratio = " / ".join(f"{links[i]['from_node'] / max(1, steps[i]) / push:.3f}" for i in (0, 1))
        ttt = r["time_to_target_s"]
        pushed = r.get("pushed_bytes_summary") or 0
        initial = r.get("initial_bytes", 4 * s["num_parameters"])  # (records before it was kept: the same)
        with_initial = f"{r['into_shard_nodes_bytes'] / (pushed + initial):.3f}" if pushed else "n/a"
        overlap = ", `--overlap`" if r.get("settings", {}).get("overlap") else ""
        transports = ", ".join(sorted(r.get("replica_transports") or {})) or "?"
        lines.append(f"| {r['bandwidth']} | {r['model']} | {r.get('compress') or 'none'} / "
                     f"{r.get('compress_fetch') or 'none'}{overlap} | {transports} | {r['examples_per_s']:,.0f} | "
                     f"{'not reached' if ttt is None else f'{ttt:.0f}'} | {r['busiest_link_utilization']:.0%} | "
                     f"{r.get('pushed_agreement', float('nan')):.3f} / {r.get('fetched_agreement', float('nan')):.3f}"
                     f" | {with_initial} | {out_ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--bandwidths", nargs="+", default=["1gbit", "10gbit"])
    p.add_argument("--delay", default="0", help="one-way delay per link (needs netem in the kernel) [default: 0]")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--configs-fast", nargs="+", default=["none", "topk-delta"], choices=list(CONFIGS),
                   help="the configurations run at the bandwidths after the first")
    p.add_argument("--max-seconds", type=float, default=None, help="budget per run [default: the recipe's]")
    p.add_argument("--paper", action="store_true", help="also the 42M paper model at the first bandwidth")
    p.add_argument("--paper-seconds", type=float, default=90.0)
    p.add_argument("--quick", action="store_true", help="the quick recipe (mechanics only)")
    p.add_argument("--report", action="store_true", help="only print the table of --out's results.json")
    args = p.parse_args(argv)
    if args.report:
        print(report(Path(args.out).resolve()))
        return 0
    netcluster.require_root_linux()
    recipe = recipe_for(args.quick, args.max_seconds)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    warm = warmstart(out, recipe)
    method = dict(recipe.methods["downpour-adagrad"])
    base = {**recipe.common, **method, "replicas": 2, "shards": 2, "target_accuracy": recipe.target_accuracy,
            "max_seconds": recipe.max_seconds, "init_params": str(warm)}
    results = {"date": dt.date.today().isoformat(), "command": " ".join(sys.argv), "machine": platform.node(),
               "cpus": os.cpu_count(), "recipe": recipe.label, "delay": args.delay, "runs": []}
    for i, bw in enumerate(args.bandwidths):
        c = netcluster.up(nodes=4, bandwidth=bw, delay=args.delay, cpus_per_node=1, shard_nodes=2)
        try:
            tcp = netcluster.measure_tcp(c.name, src=0, dst=2, megabytes=100 if bw.endswith("gbit") else 20)
            results.setdefault("tcp", {})[bw] = tcp
            print(f"[{bw}] raw TCP node 0 -> 2: {tcp['gbit_per_s']:.3f} Gbit/s ({tcp['utilization']:.0%})",
                  flush=True)
            names = args.configs if i == 0 else [n for n in args.configs_fast if n in CONFIGS]
            for name in names:
                run_dir = out / f"{bw}-fig4-{name}"
                rec = run_on_cluster(c, name, {**base, **CONFIGS[name]}, run_dir, recipe.max_seconds * 3 + 300)
                rec.update(bandwidth=bw, model="speech-tiny")
                results["runs"].append(rec)
                print(f"[{bw}] fig4 {name:14s} 13% at {rec['time_to_target_s']}s, {rec['examples_per_s']:,.0f} "
                      f"ex/s, busiest link {rec['busiest_link_utilization']:.0%}, pushed agreement "
                      f"{rec.get('pushed_agreement', float('nan')):.3f}", flush=True)
                (out / "results.json").write_text(json.dumps(results, indent=1))
            if args.paper and i == 0:
                paper = {**base, "model": "speech-paper", "num_classes": 8192, "init_params": "",
                         "max_seconds": args.paper_seconds, "target_accuracy": 0.0, "eval_every_seconds": 30.0,
                         "batch_size": None, "lr": None, "eval_samples": 1000, "train_eval_samples": 0}
                for name in ("none", "topk-delta"):
                    run_dir = out / f"{bw}-paper-{name}"
                    rec = run_on_cluster(c, name, {**paper, **CONFIGS[name]}, run_dir, args.paper_seconds * 4 + 600)
                    rec.update(bandwidth=bw, model="speech-paper")
                    results["runs"].append(rec)
                    print(f"[{bw}] paper {name:14s} {rec['examples_per_s']:,.1f} ex/s, busiest link "
                          f"{rec['busiest_link_utilization']:.0%}", flush=True)
                    (out / "results.json").write_text(json.dumps(results, indent=1))
        finally:
            netcluster.down(c.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
