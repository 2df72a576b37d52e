"""The simulated machines: cores, links and shard actors as SimPy resources, and what each kind of work costs.

A ``World`` holds, for a ``Machines`` description and a ``Costs`` calibration:

- a pool of cores per node (or one pool for all nodes, when they share a machine's cores): CPU work holds one
  core for its duration, first come first served;
- each node's link, one resource per direction (full duplex): a transfer holds the sender's uplink and the
  receiver's downlink for its bytes at the link rate times ``link_efficiency``;
- on rate-limited links, each node's object plane (Ray's object manager on that node): one object at a time, in
  or out, for its bytes and its fixed cost. Measured on the shaped cluster (benchmarks/object_plane.py), a node's
  object transfers add up to about one link's worth in and out together, where plain TCP fills both directions
  of every link at once: a node that sends while it receives gets half the rate each way;
- a replica's gloo stream to a shard on another node (runtime/streams.py) holds the two links alone, as plain TCP
  does, with its CPU per byte on both nodes: no object plane;
- each shard's actor: one call at a time (Ray runs a shard's calls in order, ``max_concurrency = 1``).

Everything busy is accounted (seconds per core pool, per shard; bytes per link direction) for the utilisation
report and the bottleneck's name. All methods that take time are SimPy generators: ``yield from world.cpu(...)``.
"""

from __future__ import annotations

import math
from collections import defaultdict

import simpy

# Ray sends smaller call arguments and replies inline, not through the object store: the limit of the instances
# distbelief starts, and the one docs/cluster.md asks of a cluster a user starts
from distbelief.runtime.ray_settings import INLINE_BYTES
from distbelief.simulate.costs import Costs
from distbelief.simulate.machines import Machines


def local_object_cpu(nbytes: float, fixed_s: float, per_byte_s: float) -> float:
    """The CPU of one call argument or reply of ``nbytes`` through one node's object store, both ends together
    (``Costs.local_object_cpu_s`` and ``local_object_cpu_s_per_byte``); 0 for one Ray sends inline."""
    return fixed_s + nbytes * per_byte_s if nbytes > INLINE_BYTES else 0.0


class World:
    def __init__(self, env: simpy.Environment, machines: Machines, costs: Costs):
        self.env, self.machines, self.costs = env, machines, costs
        n = machines.nodes
        if machines.shared_cores:
            pool = simpy.Resource(env, capacity=machines.shared_cores)
            self.pools = [pool] * n
            self.pool_of = [0] * n
            self.pool_cores = [machines.shared_cores]
        else:
            self.pools = [simpy.Resource(env, capacity=machines.cores_per_node) for _ in range(n)]
            self.pool_of = list(range(n))
            self.pool_cores = [machines.cores_per_node] * n
        self.up = [simpy.Resource(env, capacity=1) for _ in range(n)]
        self.down = [simpy.Resource(env, capacity=1) for _ in range(n)]
        self.plane = [simpy.Resource(env, capacity=1) for _ in range(n)]
        self.cpu_busy = defaultdict(float)  # pool -> core-seconds
        self.link_bytes = defaultdict(float)  # (node, "up" | "down") -> bytes
        self.rate = machines.bytes_per_s * costs.link_efficiency  # bytes/s a transfer gets on a link
        # Ray's own processes take a share of every pool: their nodes' idle load over the pool's cores
        nodes_per_pool = [self.pool_of.count(p) for p in range(len(self.pool_cores))]
        self.tax = [cores / max(0.25 * cores, cores - costs.ray_idle_cores * n)
                    for cores, n in zip(self.pool_cores, nodes_per_pool)]

    # ------------------------------------------------------------------ CPU
    def cpu(self, node: int, seconds: float, *, compute: bool = False):
        """Hold one core of ``node`` for ``seconds`` (longer by Ray's share of the cores; a replica's
        ``compute`` also by the contention of the other computations running beside it)."""
        if seconds <= 0:
            return
        pool = self.pools[node]
        with pool.request() as req:
            yield req
            p = self.pool_of[node]
            seconds *= self.tax[p]
            if compute and pool.capacity > 1:
                beside = sum(1 for r in pool.users if getattr(r, "compute", False))
                seconds *= 1 + (self.costs.contention - 1) * beside / (pool.capacity - 1)
                req.compute = True
            yield self.env.timeout(seconds)
        self.cpu_busy[p] += seconds

    # ------------------------------------------------------------------ bytes
    def copy(self, node: int, nbytes: float):
        """A copy within ``node`` (the shared-memory plane, loading fetched values)."""
        yield from self.cpu(node, nbytes / self.costs.copy_bytes_per_s)

    def send(self, src: int, dst: int, nbytes: float, *, object_store: bool = True, stream: bool = False):
        """``nbytes`` from a process on ``src`` to one on ``dst``: within a node through the object store (CPU per
        object and per byte, half at each end) or not at all (``object_store=False``: shared buffers, read in
        place); between nodes on a stream (``stream``), inline with the call when small, else through Ray's object
        store over both nodes' links."""
        c = self.costs
        if nbytes <= 0:
            return
        if stream and src != dst:
            if c.stream_cpu_s_per_byte:
                ends = [self.env.process(self.cpu(n, nbytes * c.stream_cpu_s_per_byte)) for n in (src, dst)]
                yield from self._cross(src, dst, nbytes, True)
                yield self.env.all_of(ends)
            else:
                yield from self._cross(src, dst, nbytes, True)
            if self.machines.latency_s:
                yield self.env.timeout(self.machines.latency_s)
            return
        if src == dst:
            if object_store and nbytes > INLINE_BYTES:  # put by the sender, read by the receiver: CPU at both ends
                half = local_object_cpu(nbytes, c.local_object_cpu_s, c.local_object_cpu_s_per_byte) / 2
                yield from self.cpu(src, half)
                yield from self.cpu(dst, half)
            return
        inline = nbytes <= INLINE_BYTES
        if inline or math.isinf(self.rate):
            yield from self._cross(src, dst, nbytes, inline)
            lat = self.machines.latency_s + (0.0 if inline else c.objstore_call_s)
        else:
            # both nodes' object planes, in node order (two transfers never wait for each other's), for the
            # bytes and the object's fixed cost
            first, second = sorted((src, dst))
            with self.plane[first].request() as p1:
                yield p1
                with self.plane[second].request() as p2:
                    yield p2
                    yield from self._cross(src, dst, nbytes, inline)
                    if c.link_object_s:
                        yield self.env.timeout(c.link_object_s)
            lat = self.machines.latency_s
        if lat:
            yield self.env.timeout(lat)

    def _cross(self, src: int, dst: int, nbytes: float, inline: bool):
        """The bytes on the sender's uplink and the receiver's downlink (and the object manager's CPU)."""
        c = self.costs
        with self.up[src].request() as u:
            yield u
            with self.down[dst].request() as d:
                yield d
                wire = nbytes / self.rate if not math.isinf(self.rate) else 0.0
                hold = wire if inline else max(wire, nbytes / c.objstore_bytes_per_s)
                if not inline and (c.objstore_cpu_s_per_byte or c.objstore_cpu_s):
                    at_src = c.objstore_cpu_s / 2 + nbytes * c.objstore_cpu_s_per_byte
                    movers = [self.env.process(self.cpu(src, at_src)),
                              self.env.process(self.cpu(dst, c.objstore_cpu_s / 2))]
                    yield self.env.timeout(hold)
                    yield self.env.all_of(movers)
                else:
                    yield self.env.timeout(hold)
        for key in ((src, "up"), (dst, "down")):
            self.link_bytes[key] += nbytes

    def occupy(self, node: int, way: str, nbytes: float):
        """Hold ``node``'s link one ``way`` ("up" or "down") for ``nbytes`` at the link rate: the traffic of the
        shards that a representative-shard simulation does not model one by one (simulate/downpour.py)."""
        if nbytes <= 0 or math.isinf(self.rate):
            return
        link = (self.up if way == "up" else self.down)[node]
        with link.request() as req:
            yield req
            yield self.env.timeout(nbytes / self.rate)
        self.link_bytes[(node, way)] += nbytes

    # ------------------------------------------------------------------ report
    def reset(self) -> None:
        """Forget what was busy so far (the end of a warm-up)."""
        self.cpu_busy.clear()
        self.link_bytes.clear()

    def utilisation(self, seconds: float) -> dict:
        """Busy shares over ``seconds``: per core pool (of its cores), per link direction (of its rate)."""
        cpu = [self.cpu_busy[p] / (seconds * cores) for p, cores in enumerate(self.pool_cores)]
        links = {}
        if not math.isinf(self.machines.bytes_per_s):
            for (node, way), b in sorted(self.link_bytes.items()):
                links[f"node {node} {way}"] = b / (seconds * self.machines.bytes_per_s)
        return {"cpu": cpu, "links": links}
