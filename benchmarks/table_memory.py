"""Tables larger than one process: per-shard memory of row-sharded embedding tables on a (fake) multi-node cluster
(docs/tables.md, "Tables larger than one process").

    .venv/bin/python benchmarks/table_memory.py [--rows 10000000] [--dim 16] [--shards 4] [--cap-mib 768] ...

Not a test (tests/integration/test_tables_cluster.py is the same run at 2.5M rows, through ``run_on_cluster``).
Starts a ``--nodes``-node ``ray.cluster_utils.Cluster`` on this machine, trains a model of ``--tables`` EmbeddingBags holding ``--rows``
rows of ``--dim`` floats in all with Downpour over ``--shards`` shards (one per node), then asks each shard
process what it holds (its rows and their server-rule state) and what it measures (USS, RSS; and its base, the
same process before the shard allocated anything): ParameterShard.memory(); the model, data and verdicts are
distbelief/testing/table_memory.py's.

Prints one row per shard: rows, bytes held, base, measured USS and RSS, the ratio (USS - base) / held, and the
verdict of USS <= --slack x held + base; then whether the tables (all shards' rows + state, plus one base) exceed
--cap-mib, the memory granted to one shard process, while every shard stays under it. Writes the whole report
as JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import ray

from distbelief import train
from distbelief.ps.memory import process_memory
from distbelief.runtime.local_cluster import fake_cluster
from distbelief.runtime.ray_runtime import SYSTEM_CONFIG, RayRuntime
from distbelief.testing import Faults
from distbelief.testing.table_memory import MiB, WideTables, accuracy, bce, check, planted_data


def run_on_cluster(rows: int, dim: int, tables: int = 4, shards: int = 4, nodes: int = 4, node_cpus: float = 1,
                   replicas: int = 1, optimizer: str = "adagrad", lr: float = 0.1, steps: int = 300,
                   batch_size: int = 256, num_samples: int = 40_000, durability: str = "off", seed: int = 0,
                   object_store_mib: int = 0, eval_every_seconds: float = 3600.0,
                   log: Callable[[str], None] | None = None, **settings: Any) -> dict:
    """Train ``WideTables(rows, dim, tables)`` with Downpour, ``shards`` shards and ``replicas`` replicas on a fresh
    ``nodes``-node fake cluster (``node_cpus`` CPUs each); returns the run's summary, each shard's node and
    ``memory()`` report, the replicas' and the driver's memory, and timings. Ray and the cluster are shut down
    before it returns, even on failure. ``object_store_mib``: each node's object store (0: room for twice the
    tables' rows, at least 512 MiB). ``eval_every_seconds``: evaluations during the run (each reads every row
    into the driver; the replicas' memory is read at those, so none is reported without one before the end)."""
    say = log or (lambda _msg: None)
    rows_bytes = rows * dim * 4
    store = object_store_mib * MiB or max(512 * MiB, 2 * rows_bytes)
    t0 = time.perf_counter()
    data = planted_data(rows, tables, num_samples, seed)
    test = planted_data(rows, tables, max(2000, num_samples // 10), seed + 1)
    ray.shutdown()
    # (fake_cluster: the nodes and the driver agree on token authentication)
    cluster = fake_cluster(num_cpus=node_cpus, object_store_memory=store, include_dashboard=False,
                           _system_config=SYSTEM_CONFIG)
    out: dict = {}
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=node_cpus, object_store_memory=store)
        cluster.wait_for_nodes()
        t_cluster = time.perf_counter()
        say(f"{nodes}-node cluster up in {t_cluster - t0:.1f}s")
        runtime = RayRuntime(address=cluster.address, remote_timeout_s=120)
        seen: dict = {}

        def probe(trainer, _record) -> None:
            """At each evaluation: keep the driver object, and each running replica's memory (read from here: a
            fake cluster's nodes are this machine); replicas are gone by the final evaluation."""
            seen["trainer"] = trainer
            mems = seen.setdefault("replicas", [None] * len(trainer.replicas))
            for i, st in enumerate(trainer.replicas.values()):
                try:
                    m = process_memory(ray.get(st.role.handle.pid.remote(), timeout=10))
                except Exception:  # noqa: BLE001 - stopped already
                    m = None
                if m is not None and i < len(mems) and (mems[i] is None or m["uss"] >= mems[i]["uss"]):
                    mems[i] = m
        try:
            res = train(partial(WideTables, rows, dim, tables), data, test, runtime=runtime, loss_fn=bce,
                        metric_fn=accuracy, strategy="downpour", replicas=replicas, shards=shards,
                        optimizer=optimizer, lr=lr, max_steps=steps, max_seconds=0, batch_size=batch_size,
                        durability=durability, seed=seed, quiet=settings.pop("quiet", True), eval_every_seconds=eval_every_seconds,
                        hooks=Faults(on_evaluation=probe), **settings)
            t_train = time.perf_counter()
            trainer = seen["trainer"]
            out["shards"] = [{**runtime.call(s, "memory").result(60), "node": runtime.node_of(s)}
                             for s in trainer.shards]
            out["replicas"] = seen.get("replicas", [])  # None: no evaluation saw it running
            out["driver"] = {**(process_memory() or {}),
                             "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
            out["nodes"] = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        finally:
            runtime.shutdown()
        s = res.summary
        out["summary"] = {k: s.get(k) for k in (
            "steps_per_replica", "updates_per_shard", "rejected_pushes", "table_rows", "table_parameters",
            "rows_pushed", "rows_fetched", "best_test_accuracy", "final_test_accuracy", "wall_s",
            "examples_per_s", "num_parameters", "replica_restarts", "shard_restarts", "updates_lost", "events")}
        out["summary"]["test_loss"] = res.metrics[-1].get("test_loss") if res.metrics else None
        positives = float(test.tensors[1].mean())
        out["majority_accuracy"] = max(positives, 1 - positives)  # what a model that learnt nothing scores
        out["seconds"] = {"cluster": round(t_cluster - t0, 1), "train": round(t_train - t_cluster, 1)}
    finally:
        ray.shutdown()
        cluster.shutdown()
    out["seconds"]["total"] = round(time.perf_counter() - t0, 1)
    out["config"] = {"rows": rows, "dim": dim, "tables": tables, "shards": shards, "nodes": nodes,
                     "node_cpus": node_cpus, "replicas": replicas, "optimizer": optimizer, "lr": lr, "steps": steps,
                     "batch_size": batch_size, "num_samples": num_samples, "durability": durability, "seed": seed,
                     "object_store_bytes": store}
    return out




def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000, help="rows of all tables together")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--tables", type=int, default=4)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=0, help="fake cluster nodes (default: one per shard)")
    ap.add_argument("--node-cpus", type=float, default=1.0)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--optimizer", default="adagrad")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--num-samples", type=int, default=40_000)
    ap.add_argument("--durability", default="off")
    ap.add_argument("--checkpoint-every-seconds", type=float, default=None,
                    help="durability snapshot/log: snapshot cadence (default: the run's)")
    ap.add_argument("--eval-every-seconds", type=float, default=3600.0,
                    help="evaluations during the run (the replicas' memory is read at them)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slack", type=float, default=1.15)
    ap.add_argument("--cap-mib", type=float, default=768.0, help="memory granted to one shard process")
    ap.add_argument("--out", default=f"benchmarks/results/table-memory-{time.strftime('%Y-%m-%d')}.json")
    args = ap.parse_args()

    extra = {}
    if args.checkpoint_every_seconds is not None:
        extra["checkpoint_every_seconds"] = args.checkpoint_every_seconds
    t0 = time.time()
    report = run_on_cluster(args.rows, args.dim, args.tables, shards=args.shards, nodes=args.nodes or args.shards,
                            node_cpus=args.node_cpus, replicas=args.replicas, optimizer=args.optimizer, lr=args.lr,
                            steps=args.steps, batch_size=args.batch_size, num_samples=args.num_samples,
                            durability=args.durability, seed=args.seed, eval_every_seconds=args.eval_every_seconds,
                            log=lambda m: print(m, flush=True), **extra)
    verdicts = check(report, slack=args.slack, metric="uss")
    rss = {sh["shard_id"]: (sh["process"]["rss"], sh["base"]["rss"]) for sh in report["shards"]}
    cap = args.cap_mib * MiB
    total = sum(v["held_bytes"] for v in verdicts)
    fits_one = total + min(v["base_bytes"] for v in verdicts) <= cap
    all_under = all(v["measured_bytes"] <= cap for v in verdicts)
    nodes = len({v["node"] for v in verdicts})

    s = report["summary"]
    print(f"\n{args.rows:,} rows x {args.dim} ({args.tables} tables), {args.optimizer}, {args.shards} shards on "
          f"{nodes} nodes, durability {args.durability}; {s['steps_per_replica']} steps, updates per shard "
          f"{s['updates_per_shard']}, best test accuracy {s['best_test_accuracy']:.4f} (majority "
          f"{report['majority_accuracy']:.4f}); {report['seconds']}")
    print("| shard | rows | held MiB (rows + state) | base USS MiB | USS MiB | (USS - base) / held | "
          f"USS <= {args.slack:g} x held + base | base RSS MiB | RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for v in verdicts:
        r, rb = rss[v["shard"]]
        print(f"| {v['shard']} | {v['table_rows']:,} | {v['held_bytes'] / MiB:,.1f} | {v['base_bytes'] / MiB:,.1f} | "
              f"{v['measured_bytes'] / MiB:,.1f} | {v['ratio']:.3f} | {'yes' if v['ok'] else 'NO'} | "
              f"{rb / MiB:,.1f} | {r / MiB:,.1f} |")
    snap = [sh["snapshot_bytes"] for sh in report["shards"]]
    if any(snap):
        print(f"snapshot buffers per shard (MiB): {[round(b / MiB, 1) for b in snap]}")
    print(f"all tables: {total / MiB:,.1f} MiB of rows + state; one shard process's cap {args.cap_mib:g} MiB: "
          f"{'they would fit in one' if fits_one else 'they exceed it'}; every shard under the cap: "
          f"{'yes' if all_under else 'NO'}")
    for i, m in enumerate(report.get("replicas") or []):
        if m:
            print(f"replica {i}: USS {m['uss'] / MiB:,.1f} MiB, RSS {m['rss'] / MiB:,.1f} MiB (at its last evaluation)")
    d = report["driver"]
    print(f"driver: USS {d.get('uss', 0) / MiB:,.1f} MiB now, peak RSS {d['peak_rss'] / MiB:,.1f} MiB")

    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)), "machine": {
        "cores": os.cpu_count(), "python": platform.python_version()}, "args": vars(args), "verdicts": verdicts,
        "tables_bytes": total, "cap_bytes": cap, "tables_exceed_cap": not fits_one, "all_shards_under_cap": all_under,
        **report}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
