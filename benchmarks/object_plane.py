"""What Ray's object store, and gloo between the same actors, can move over the shaped links of this machine with
no training at all: the ceilings a Downpour run's link utilization is measured against (issue 27's target:
uncompressed Downpour at >= 80 % of the shaped rate).

    sudo .venv/bin/python benchmarks/object_plane.py --out benchmarks/results/object-plane-DATE [--bandwidths 1gbit]

Per bandwidth: ``netcluster.up`` 4 nodes as benchmarks/shaped_links.py makes them (replica nodes 0-1, one CPU each;
shard nodes 2-3), then, with actors holding 4.6 MB float32 ranges (the Fig. 4 model's range per shard) and 15 s per
pattern, one call at a time per caller:

- ``one pair, fetch``: a caller on node 0 fetches from a shard on node 2, nothing else moving;
- ``downpour pattern``: a caller on each of nodes 0 and 1 sends each of the two shard nodes 4.6 MB and gets 4.6 MB
  back in one call per shard (a Downpour step's push and fetch, without the gradient);
- ``downpour, prefetch``: the same bytes as two calls per shard, the next step's fetch sent before this step's push
  (so that the push and the fetch could cross at once, as ``--overlap`` does);
- ``gloo, ...`` (the stream transport's channel, runtime/streams.py): the same callers and holders exchange the
  same bytes over a two-rank gloo group per pair instead of Ray calls: ``push then fetch`` (one after the other,
  as the fused loop), ``push and fetch at once`` (both directions posted together, one exchange in flight per
  pair), ``at once, 4 chunks each`` (each message as 4 transfers posted together) and ``at once, 2 in flight``
  (the next exchange posted before this one completes); ``--gloo-only`` runs only these (and raw TCP);
- ``raw TCP, same pairs``: the eight streams of that pattern in plain TCP at once, no Ray (rates over the time
  from the first stream's start to the last one's end, the streams' setup included: a lower bound);

and the kernel's counters on every node's link give each link's rate each way (TCP payload; see
``netcluster.LinkCounters``), /proc/stat the machine's busy CPU meanwhile (cores busy, CPU seconds per byte moved). The driver runs on node 0, as Ray requires; the counters are read in the root network
namespace (``nsenter`` into this script's own namespaces). Writes results.json into --out and prints one line per
pattern. Linux and root only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from distbelief.simulate.calibrate import busy_seconds  # the machine's busy CPU so far (/proc/stat)

ROOT = Path(__file__).resolve().parent.parent
VALUES = int(4.6e6 / 4)
SECONDS = 15.0


def counters(outer_pid: int, name: str) -> dict[int, list[int]]:
    """Every node's link counters (to the node, from it), read in the namespaces of process ``outer_pid``."""
    code = ("import json; from distbelief.runtime import netcluster as nc; print(json.dumps({i: [c.to_node_payload, "
            f"c.from_node_payload] for i, c in nc.link_counters({name!r}).items()}}))")
    r = subprocess.run(["nsenter", "-t", str(outer_pid), "-m", "-n", sys.executable, "-c", code], cwd=ROOT,
                       capture_output=True, text=True, check=True, timeout=60)
    return {int(k): v for k, v in json.loads(r.stdout).items()}


def inner(address: str, outer_pid: int, name: str, rate_bps: float, gloo_only: bool = False) -> list[dict]:
    """(In node 0's namespace) the patterns; returns one record each."""
    import numpy as np
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=address, logging_level="ERROR")
    node_of = {n["NodeManagerAddress"].rsplit(".", 1)[1]: n["NodeID"] for n in ray.nodes() if n["Alive"]}

    def gloo_pair(host: str, port: int, prefix: str, rank: int, is_master: bool):
        """A two-rank gloo process group (torch.distributed) between a caller and a holder: ``host`` runs the
        rendezvous store."""
        import datetime

        import torch.distributed as dist
        timeout = datetime.timedelta(seconds=120)
        store = dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                                                       timeout=timeout))
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=ray.util.get_node_ip_address())]
        return store, dist.ProcessGroupGloo(store, rank, 2, opts)

    def gloo_steps(pg, send, recv, iters: int, duplex: bool, first_send: bool, depth: int = 1, chunks: int = 1):
        """``iters`` exchanges on ``pg``: ``send`` one way and ``recv`` the other, one after the other (the sender
        of a push first) or both at once, with up to ``depth`` exchanges in flight, each message as ``chunks``
        transfers posted together."""
        import datetime
        t = datetime.timedelta(seconds=120)
        peer = 1 - pg.rank()
        sends, recvs = send.chunk(chunks), recv.chunk(chunks)

        def out(tag):
            return [pg.send([c], peer, tag) for c in sends]

        def into(tag):
            return [pg.recv([c], peer, tag) for c in recvs]

        if not duplex:
            for _ in range(iters):
                for w in (out(0) + into(1) if first_send else into(0) + out(1)):
                    w.wait(t)
            return
        pending = []
        for _ in range(iters):
            pending.append(out(0) + into(1) if first_send else into(0) + out(1))
            if len(pending) >= depth:
                for w in pending.pop(0):
                    w.wait(t)
        for ws in pending:
            for w in ws:
                w.wait(t)

    @ray.remote(num_cpus=0, max_concurrency=8)
    class Holder:
        def __init__(self):
            self.values = np.ones(VALUES, np.float32)
            self.pairs = {}

        def gloo_open(self, host, port, prefix):
            self.pairs[prefix] = gloo_pair(host, port, prefix, 1, False)

        def gloo_serve(self, prefix, iters, duplex, depth, chunks):
            import torch
            g = torch.empty(VALUES)
            gloo_steps(self.pairs[prefix][1], torch.from_numpy(self.values), g, iters, duplex, False, depth, chunks)
            return iters

        def fetch(self):
            return self.values

        def push(self, g):
            self.values += g
            return 0

        def push_fetch(self, g):
            self.values += g
            return self.values

    @ray.remote(num_cpus=0, max_concurrency=4)
    class Caller:
        def __init__(self, holders):
            self.holders, self.g = holders, np.full(VALUES, 1e-3, np.float32)

        def gloo_open(self, index):
            """One gloo pair with each holder (this caller runs the rendezvous store)."""
            import socket
            with socket.socket() as sock:
                sock.bind(("", 0))
                port = sock.getsockname()[1]
            host = ray.util.get_node_ip_address()
            self.pairs = []
            for k, h in enumerate(self.holders):
                prefix = f"c{index}-h{k}"
                opened = h.gloo_open.remote(host, port, prefix)
                self.pairs.append((prefix, gloo_pair(host, port, prefix, 0, k == 0)))
                ray.get(opened, timeout=120)
            return True

        def gloo_run(self, iters: int, duplex: bool, depth: int = 1, chunks: int = 1):
            """``iters`` steps, each sending every holder 4.6 MB and receiving 4.6 MB back (both holders at once)."""
            import threading

            import torch
            t0 = time.monotonic()
            serving = [h.gloo_serve.remote(prefix, iters, duplex, depth, chunks) for h, (prefix, _) in zip(self.holders, self.pairs)]
            threads = [threading.Thread(target=gloo_steps, args=(pair[1], torch.from_numpy(self.g),
                                                                 torch.empty(VALUES), iters, duplex, True, depth, chunks))
                       for _, pair in self.pairs]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            ray.get(serving, timeout=120)
            return iters, time.monotonic() - t0

        def run(self, mode: str, seconds: float):
            t0, steps = time.monotonic(), 0
            while time.monotonic() - t0 < seconds:
                if mode == "fetch":
                    calls = [h.fetch.remote() for h in self.holders]
                elif mode == "push+fetch":
                    calls = [h.push_fetch.remote(self.g) for h in self.holders]
                else:  # "prefetch": the next step's fetch sent first, then this step's push: both in flight
                    calls = [c for h in self.holders for c in (h.fetch.remote(), h.push.remote(self.g))]
                ray.get(calls, timeout=120)
                steps += 1
            return steps, time.monotonic() - t0

    def on(last_octet: str, cls, *args):
        return cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_of[last_octet], soft=False)
                           ).remote(*args)

    holders = [on("12", Holder), on("13", Holder)]
    records = []
    ray_patterns = (("one pair, fetch", ["10"], holders[:1], "fetch"),
                    ("downpour pattern", ["10", "11"], holders, "push+fetch"),
                    ("downpour, prefetch", ["10", "11"], holders, "prefetch"))
    for label, caller_nodes, use, mode in ray_patterns[:0 if gloo_only else None]:
        callers = [on(n, Caller, use) for n in caller_nodes]
        ray.get([c.run.remote(mode, 1.0) for c in callers], timeout=120)  # warm
        before, cpu0 = counters(outer_pid, name), busy_seconds()
        done = ray.get([c.run.remote(mode, SECONDS) for c in callers], timeout=SECONDS + 120)
        after, cpu1 = counters(outer_pid, name), busy_seconds()
        seconds = max(d[1] for d in done)
        moved = sum(after[i][0] - before[i][0] for i in after)  # every byte enters one node
        links = {i: [(after[i][j] - before[i][j]) * 8 / seconds / rate_bps for j in (0, 1)] for i in after}
        records.append({"pattern": label, "calls_per_caller": [d[0] for d in done], "seconds": seconds,
                        "links_to_from": links, "busiest_link": max(max(v) for v in links.values()),
                        "total_gbit_per_s": moved * 8 / seconds / 1e9,
                        # the machine's busy CPU over the pattern (two counter reads included), and per byte moved
                        "busy_cores": (cpu1 - cpu0) / seconds, "cpu_s_per_byte": (cpu1 - cpu0) / moved})
        for c in callers:
            ray.kill(c)
    # gloo (torch.distributed's TCP transport) between the same actors: the bytes leave Ray's object store
    for label, duplex, iters, depth, chunks in (("gloo, push then fetch", False, 100, 1, 1),
                                                ("gloo, push and fetch at once", True, 160, 1, 1),
                                                ("gloo, at once, 4 chunks each", True, 160, 1, 4),
                                                ("gloo, at once, 2 in flight", True, 200, 2, 1)):
        holders = [on("12", Holder), on("13", Holder)]
        callers = [on(n, Caller, holders) for n in ("10", "11")]
        ray.get([c.gloo_open.remote(i) for i, c in enumerate(callers)], timeout=240)
        ray.get([c.gloo_run.remote(5, duplex, depth, chunks) for c in callers], timeout=240)  # warm
        before, cpu0 = counters(outer_pid, name), busy_seconds()
        done = ray.get([c.gloo_run.remote(iters, duplex, depth, chunks) for c in callers], timeout=600)
        after, cpu1 = counters(outer_pid, name), busy_seconds()
        seconds = max(d[1] for d in done)
        moved = sum(after[i][0] - before[i][0] for i in after)
        links = {i: [(after[i][j] - before[i][j]) * 8 / seconds / rate_bps for j in (0, 1)] for i in after}
        records.append({"pattern": label, "calls_per_caller": [d[0] for d in done], "seconds": seconds,
                        "links_to_from": links, "busiest_link": max(max(v) for v in links.values()),
                        "total_gbit_per_s": moved * 8 / seconds / 1e9,
                        "busy_cores": (cpu1 - cpu0) / seconds, "cpu_s_per_byte": (cpu1 - cpu0) / moved})
        for a in callers + holders:
            ray.kill(a)
    return records


def raw_tcp(netcluster, c) -> dict:
    """The Downpour pattern's eight streams in plain TCP at once (each replica node to each shard node and back,
    100 MB each, ``netcluster.measure_tcp``): what the links carry without Ray."""
    import threading

    pairs = [(a, b) for a in (0, 1) for b in (2, 3)] + [(b, a) for a in (0, 1) for b in (2, 3)]
    got: dict = {}

    def one(i: int, a: int, b: int) -> None:
        got[(a, b)] = netcluster.measure_tcp(c.name, a, b, megabytes=100, port=5310 + i)

    threads = [threading.Thread(target=one, args=(i, a, b)) for i, (a, b) in enumerate(pairs)]
    cpu0, t0 = busy_seconds(), time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu1, seconds = busy_seconds(), time.monotonic() - t0  # from the first start to the last end (setup included)
    if len(got) != len(pairs):
        raise SystemExit("a raw TCP stream failed")
    per_link = {i: [sum(g["bytes"] for (a, b), g in got.items() if b == i) * 8 / seconds / c.bandwidth_bps,
                    sum(g["bytes"] for (a, b), g in got.items() if a == i) * 8 / seconds / c.bandwidth_bps]
                for i in range(4)}
    moved = sum(g["bytes"] for g in got.values())
    return {"pattern": "raw TCP, same pairs", "streams_gbit_per_s": {f"{a}->{b}": g["gbit_per_s"]
                                                                     for (a, b), g in got.items()},
            "links_to_from": per_link, "busiest_link": max(max(v) for v in per_link.values()),
            "total_gbit_per_s": moved * 8 / seconds / 1e9, "seconds": seconds,
            "busy_cores": (cpu1 - cpu0) / seconds, "cpu_s_per_byte": (cpu1 - cpu0) / moved,
            "calls_per_caller": []}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--bandwidths", nargs="+", default=["1gbit"])
    p.add_argument("--gloo-only", action="store_true", help="only the gloo patterns (and raw TCP)")
    p.add_argument("--inner", nargs=4, metavar=("ADDRESS", "OUTER_PID", "NAME", "RATE_BPS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inner:
        address, pid, name, rate = args.inner
        print(json.dumps(inner(address, int(pid), name, float(rate), args.gloo_only)))
        return 0
    from distbelief.runtime import netcluster

    netcluster.require_root_linux()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = {"date": dt.date.today().isoformat(), "command": " ".join(sys.argv), "cpus": os.cpu_count(),
               "values_per_range": VALUES, "seconds": SECONDS, "runs": []}
    for bw in args.bandwidths:
        c = netcluster.up(nodes=4, bandwidth=bw, cpus_per_node=1, shard_nodes=2)
        try:
            cmd = ["ip", "netns", "exec", c.nodes[0].netns, sys.executable, __file__, "--out", str(out), "--inner",
                   c.address, str(os.getpid()), c.name, str(c.bandwidth_bps)] + ["--gloo-only"] * args.gloo_only
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                               env={**os.environ, "RAY_AUTH_MODE": "token"})
            if r.returncode != 0:
                raise SystemExit(f"the probe failed:\n{r.stderr[-3000:]}")
            records = json.loads(r.stdout.strip().splitlines()[-1])
            records.append(raw_tcp(netcluster, c))
            for rec in records:
                rec["bandwidth"] = bw
                results["runs"].append(rec)
                print(f"[{bw}] {rec['pattern']:17s} busiest link {rec['busiest_link']:.0%}, all links together "
                      f"{rec['total_gbit_per_s']:.2f} Gbit/s, {rec['busy_cores']:.2f} cores busy, "
                      f"{rec['cpu_s_per_byte'] * 1e9:.2f} ns of CPU a byte, calls per caller {rec['calls_per_caller']}",
                      flush=True)
            (out / "results.json").write_text(json.dumps(results, indent=1))
        finally:
            netcluster.down(c.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
