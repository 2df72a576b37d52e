"""Downpour SGD and synchronous data parallelism, simulated: replicas, shards and the bytes between them.

Each replica is a SimPy process running the client loop of downpour/replica.py:

- with n_fetch = n_push = 1 and no prefetch (the default) a step's push is followed at once by the next step's
  fetch, which reaches each shard right behind it (``Workload.chained``): the shard applies the push and answers
  with its parameters (its values, float16, or the values changed since: ``compress_fetch``);
- otherwise pushes travel asynchronously (at most one in flight) and fetches block every ``fetch_every`` steps
  (with ``overlap``, the next fetch travels while the replica computes); a shard runs one replica's calls in the
  order they were sent, so a fetch waits for that replica's earlier push to be applied.

The transport is the one the Ray runtime picks (runtime/transports): on one node the replica applies its push to
the shard's memory itself under the shard's lock (co-located updates: no call, no transfer); across nodes, and
for compressed pushes anywhere, Ray calls whose arrays travel through the object store.

Staleness is the paper's: a push's staleness at a shard is the number of updates that shard applied between the
replica's fetch of those parameters and the push (what ``summary.json``'s ``staleness_mean`` measures).
``consistency = "ssp"`` holds a replica more than ``staleness_bound`` steps ahead of the slowest; ``sync`` runs
lockstep steps in which the shards apply the mean of the first ``replicas`` gradients of ``replicas +
backup_replicas``.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import simpy

from distbelief.simulate.costs import Costs
from distbelief.simulate.engine import World
from distbelief.simulate.machines import Machines
from distbelief.simulate.workload import Workload


def compute_seconds(work: Workload, costs: Costs, threads: int = 1, machines: Machines | None = None) -> float:
    """One replica's minibatch step with ``threads`` threads: the fixed cost, the per-example cost, and forward
    plus backward (three multiply-adds per weight use) at the measured rate of each layer kind, the multiply-adds
    spread over the threads at ``thread_efficiency``; a model whose own step the calibration timed
    (``Costs.measured_step``) takes that time with one thread instead. A model-parallel replica's step is the
    slowest partition's (simulate/partition.py)."""
    p = work.profile
    if work.partitions > 1:
        return partition_seconds(work, costs, threads, machines)
    speedup = 1 + (threads - 1) * costs.thread_efficiency
    macs_s = sum(3 * macs / costs.macs_per_s[kind] for kind, macs in p.macs.items() if macs)
    fixed = costs.step_s + work.batch * costs.example_s
    measured = costs.measured_step(p.name, p.params, work.batch, fixed + work.batch * macs_s)
    if measured is not None:  # this model's own step, timed by the calibration: its multiply-adds' share
        macs_s = max(0.0, measured - fixed) / work.batch
    return fixed + work.batch * macs_s / speedup


def partition_seconds(work: Workload, costs: Costs, threads: int, machines: Machines | None) -> float:
    """A model-parallel step (simulate/partition.py): each partition with ``threads`` cores, the boundary
    messages over ``machines``' links when the cluster has nodes for the partitions, in memory otherwise."""
    from distbelief.simulate.partition import partition_step

    spread = machines is not None and machines.nodes > 1
    step = partition_step(work.profile, work.partitions, work.batch, costs,
                          Machines(nodes=work.partitions, cores_per_node=threads,
                                   bandwidth=machines.bandwidth if spread else float("inf"),
                                   latency_s=machines.latency_s if spread else 0.0), one_machine=not spread)
    return step.seconds


def jitter(rng: np.random.Generator, cv: float) -> float:
    """A lognormal factor of mean 1 and coefficient of variation ``cv`` (1 when ``cv`` is 0)."""
    if not cv:
        return 1.0
    sigma2 = math.log1p(cv * cv)
    return float(rng.lognormal(-sigma2 / 2, math.sqrt(sigma2)))


def replica_threads(work: Workload, machines: Machines, started: int, nodes: list[int]) -> int:
    """Threads per replica, as the runtime sets them: a node's cores over the replicas on it (at least 1); on
    nodes that share cores, the shared cores over all replicas."""
    if machines.shared_cores:
        return max(1, machines.shared_cores // max(1, started))
    per_node = max((nodes.count(n) for n in set(nodes)), default=1)
    return max(1, machines.cores_per_node // per_node)


DRIVER_NODE = 0  # the driver runs on the head node, node 0


class Shards:
    """The shards' state as the simulation needs it: versions, locks, busy time, staleness seen."""

    def __init__(self, env: simpy.Environment, work: Workload, nodes: list[int]):
        self.nodes = nodes
        self.lock = [simpy.Resource(env, capacity=1) for _ in nodes]
        self.version = [0] * len(nodes)
        self.busy = [0.0] * len(nodes)
        self.staleness: Counter = Counter()
        self.sizes = work.layout.sizes()


class DownpourRun:
    """One simulated Downpour (or sync) run; ``run(seconds)`` then read the counters."""

    def __init__(self, work: Workload, machines: Machines, costs: Costs, seed: int = 0,
                 representative: bool = False):
        self.work, self.machines, self.costs = work, machines, costs
        self.env = simpy.Environment()
        self.world = World(self.env, machines, costs)
        started = work.replicas + (work.backup_replicas if work.strategy == "sync" else 0)
        # a model-parallel replica's partitions each on a node of their own (where there are nodes enough)
        parts = work.partitions
        nodes, shard_nodes = machines.place(started * parts, work.shards)
        self.groups = [nodes[r * parts:(r + 1) * parts] for r in range(started)]
        self.replica_nodes = [g[0] for g in self.groups]
        self.shards = Shards(self.env, work, shard_nodes)
        self.colocated = machines.nodes == 1 and not work.object_store
        # Representative shard (large runs): the shards are alike and every replica talks to all of them, so only
        # shard 0 is simulated call by call; a replica's link still carries every shard's part.
        self.representative = representative and not self.colocated and work.shards > 1
        self.modelled = [0] if self.representative else list(range(work.shards))
        # a replica whose shards run in processes of their own on its cores steps slower
        # (Costs.separate_process_slowdown); one on cores no shard uses does not. Sync's shards always do: a
        # replica returns its gradient as call results and each shard applies them in its own process, even
        # where the replicas read the parameters from the shards' shared memory.
        # A model-parallel replica on one machine is not charged it once its messages' cost was measured
        # (Costs.partition_message_s): that comes from real model-parallel steps, partitions in Ray processes of
        # their own as here, so it holds whatever running apart costs.
        apart = not self.colocated or work.strategy == "sync"
        measured_apart = work.partitions > 1 and machines.nodes == 1 and costs.partition_message_s is not None
        shard_pools = {self.world.pool_of[n] for n in shard_nodes}
        self.step_factor = [costs.separate_process_slowdown
                            if apart and not measured_apart and self.world.pool_of[n] in shard_pools else 1.0
                            for n in self.replica_nodes]
        self.others = work.shards - len(self.modelled)  # shards whose parts only occupy the replica's links
        flat = [n for g in self.groups for n in g]
        self.threads = replica_threads(work, machines, len(flat), flat)
        self.step_s = compute_seconds(work, costs, self.threads, machines)
        self.rng = np.random.default_rng(seed)
        self.encode_s = (costs.encode_s_per_value.get(work.compress, 0.0) * work.profile.params
                         if work.compress != "none" else 0.0)
        self.decode_s = [costs.decode_s_per_value.get(work.compress, 0.0) * n if work.compress != "none" else 0.0
                         for n in self.shards.sizes]
        # A shard's work per push: decoding it (not a sparse push: stepped value by value) and the rule over the
        # values it steps.
        self.push_values = work.push_values()
        self.push_decode_s = [0.0] * len(self.decode_s) if work.sparse_pushes else self.decode_s
        self.push_bytes = work.push_bytes()
        self.steps = [0] * started
        self.clock = [0] * started  # steps since the start (``steps`` counts from the warm-up's end)
        self.examples = 0
        self.compute_s = [0.0] * started
        self.wait_s = [0.0] * started
        self.clock_wait_s = [0.0] * started
        self.pushes_since_fetch = [[0] * work.shards for _ in range(started)]
        self.measuring = False  # counters start after the warm-up
        self._clock_moved = self.env.event()

    # ------------------------------------------------------------------ driving
    def run(self, steps: int = 60, warmup_steps: int = 10) -> float:
        """Run until every replica made about ``warmup_steps`` steps, reset the counters, then run ``steps``
        more per replica (counted over all replicas); returns the simulated seconds the counters cover."""
        if self.work.strategy == "sync":
            self.env.process(self._sync_loop())
        else:
            for r in range(self.work.replicas):
                self.env.process(self._replica(r))
        n = self.work.replicas
        self.env.run(until=self._after_steps(lambda: sum(self.clock) >= warmup_steps * n))
        self._reset_counters()
        start = self.env.now
        self.env.run(until=self._after_steps(lambda: sum(self.steps) >= steps * n))
        return self.env.now - start

    def _after_steps(self, done) -> simpy.Event:
        """An event that succeeds at the first step after which ``done()`` holds."""
        reached = self.env.event()

        def watch():
            while not done():
                yield self._clock_moved
            reached.succeed()

        self.env.process(watch())
        return reached

    def _reset_counters(self) -> None:
        self.world.reset()
        self.shards.busy = [0.0] * len(self.shards.nodes)
        self.shards.staleness.clear()
        self.steps = [0] * len(self.steps)
        self.examples = 0
        self.compute_s = [0.0] * len(self.steps)
        self.wait_s = [0.0] * len(self.steps)
        self.clock_wait_s = [0.0] * len(self.steps)
        self.measuring = True

    # ------------------------------------------------------------------ shard side
    def _call(self, r: int, k: int, worker_node: int, versions: list[int], push: bool, fetch: bool):
        """One call at shard ``k``, under its lock, on ``worker_node``'s core (the shard's, or the replica's own
        under co-located updates): apply replica ``r``'s push (made from parameters of ``versions[k]``) and/or
        answer its fetch (updating ``versions[k]``). Returns the answer's bytes (0 without a fetch): the
        shard's values, or under ``compress_fetch = "delta"`` the values changed since the replica's last fetch.
        One Ray call (a push and its fetch are one on every transport): the caller pays its half of the call's
        cost on its own core first."""
        s, c, w = self.shards, self.costs, self.work
        if not self.colocated:  # (a push's encoded parts cost more to send than a plain call's arguments)
            extra = c.encoded_call_cpu_s if push and w.compress != "none" else 0.0
            yield from self.world.cpu(self.replica_nodes[r], c.call_cpu_s / 2 + extra)
        with s.lock[k].request() as req:
            yield req
            t = self.env.now
            seconds = 0.0 if self.colocated else c.call_cpu_s / 2  # the callee's half of the call
            if push and w.sparse_pushes:  # stepped value by value: the rule, gathers and the change log
                seconds += c.sparse_push_s_per_value * self.push_values[k]
            elif push:
                seconds += self.push_decode_s[k] + c.update_s(w.rule) * self.push_values[k]
            changed = 1.0
            if fetch and w.compress_fetch == "delta":
                seen = self.pushes_since_fetch[r][k] + (1 if push else 0)  # others' pushes since, and its own
                changed = 1.0 - (1.0 - w.push_density) ** max(seen, 1)
                # after sparse pushes the shard reads its log of changed positions, else it scans the range
                seconds += (c.delta_log_s_per_value * s.sizes[k] * changed if w.sparse_pushes
                            else c.delta_s_per_value * s.sizes[k])
            if fetch and w.compress_fetch == "fp16":  # the answer made float16 (a conversion: the codec's decode)
                seconds += c.decode_s_per_value.get("fp16", 0.0) * s.sizes[k]
            if fetch and self.colocated:  # the replica copies the values into its fetch buffer
                seconds += 4 * s.sizes[k] / c.copy_bytes_per_s
            yield from self.world.cpu(worker_node, seconds)
            if push:
                s.staleness[s.version[k] - versions[k]] += 1
                s.version[k] += 1
                for other in range(len(self.steps)):
                    if other != r:
                        self.pushes_since_fetch[other][k] += 1
            if fetch:
                versions[k] = s.version[k]
                self.pushes_since_fetch[r][k] = 0
            s.busy[k] += self.env.now - t
        return w.fetch_bytes(changed)[k] if fetch else 0

    # ------------------------------------------------------------------ replica side
    def _up(self, r: int, k: int, nbytes: float):
        """Replica ``r``'s part for shard ``k`` (``nbytes``) travels to it: from each of its partitions' nodes
        their share, at once; under a representative shard the other shards' parts first occupy the links."""
        snode, share = self.shards.nodes[k], nbytes / len(self.groups[r])

        def one(node):
            yield from self.world.occupy(node, "up", self.others * share)
            yield from self.world.send(node, snode, share, stream=self.work.streamed_pushes)

        yield self.env.all_of([self.env.process(one(n)) for n in self.groups[r]])

    def _down(self, r: int, k: int, nbytes: float):
        """Shard ``k``'s answer (``nbytes``) travels back to replica ``r``'s partitions and is loaded (copied into
        the model's parameters; a float16 answer converted)."""
        snode, share = self.shards.nodes[k], nbytes / len(self.groups[r])

        def one(node):
            yield from self.world.send(snode, node, share, stream=self.work.streamed_fetches)
            yield from self.world.occupy(node, "down", self.others * share)
            if self.work.compress_fetch == "fp16":  # loaded as float32: a conversion per value
                values = share / 2 * (1 + self.others)
                yield from self.world.cpu(node, values * self.costs.decode_s_per_value.get("fp16", 0.0))
            elif self.work.compress_fetch == "delta" and nbytes < 4 * self.shards.sizes[k]:
                # the changed values written at their positions (8 bytes each: a position and a value)
                values = share / 8 * (1 + self.others)
                yield from self.world.cpu(node, values * self.costs.delta_load_s_per_value)
            else:
                yield from self.world.copy(node, share * (1 + self.others))

        yield self.env.all_of([self.env.process(one(n)) for n in self.groups[r]])

    def _push_fetch(self, r: int, versions: list[int]):
        """A step's push and the fetch after it (``Workload.chained``), per shard. Co-located, the replica's
        thread visits the shards one after the other (one update and copy each). Remote, the runtime sends the
        push and the fetch as one call to every shard at once: the parts share the replica's link (TCP shares
        it fairly, so they arrive together, after all of them crossed), then each shard applies and answers."""
        node = self.replica_nodes[r]
        if self.colocated:
            for k in range(self.work.shards):
                yield from self._call(r, k, node, versions, True, True)
            return
        yield self.env.all_of([self.env.process(self._up(r, k, self.push_bytes[k])) for k in self.modelled])

        def answer(k):
            nbytes = yield from self._call(r, k, self.shards.nodes[k], versions, True, True)
            yield from self._down(r, k, nbytes)

        yield self.env.all_of([self.env.process(answer(k)) for k in self.modelled])

    def _push(self, r: int, versions: list[int], applied: list):
        """An asynchronous push to every shard; ``applied[k]`` succeeds once shard k applied it. Remote, the
        parts cross the replica's link together (as in ``_push_fetch``) before the shards apply them."""
        node = self.replica_nodes[r]

        def pushes():
            if not self.colocated:
                yield self.env.all_of([self.env.process(self._up(r, k, self.push_bytes[k]))
                                       for k in self.modelled])

            def apply(k):
                yield from self._call(r, k, node if self.colocated else self.shards.nodes[k], versions, True, False)
                applied[k].succeed()

            yield self.env.all_of([self.env.process(apply(k)) for k in self.modelled])

        return self.env.process(pushes())

    def _fetch(self, r: int, versions: list[int], after: list | None):
        """A fetch from every shard, each after this replica's earlier push to it (``after``) was applied."""
        node = self.replica_nodes[r]

        def one(k):
            if after is not None:
                yield after[k]
            if self.colocated:
                yield from self._call(r, k, node, versions, False, True)
                return
            yield from self.world.send(node, self.shards.nodes[k], 64)  # the request
            nbytes = yield from self._call(r, k, self.shards.nodes[k], versions, False, True)
            yield from self._down(r, k, nbytes)

        return self.env.all_of([self.env.process(one(k)) for k in self.modelled])

    def _compute(self, r: int):
        """A step's compute; a model-parallel replica's partitions are busy on their nodes for all of it."""
        t = self.env.now
        step = (self.step_s * self.work.slow.get(r, 1.0) * jitter(self.rng, self.costs.compute_cv)
                + self.encode_s) * self.step_factor[r]
        if len(self.groups[r]) == 1:
            yield from self.world.cpu(self.replica_nodes[r], step, compute=True)
        else:
            yield self.env.all_of([self.env.process(self.world.cpu(n, step, compute=True))
                                   for n in self.groups[r]])
        self.compute_s[r] += self.env.now - t

    def _wait(self, r: int, event):
        t = self.env.now
        yield event
        self.wait_s[r] += self.env.now - t

    def _replica(self, r: int):
        w, env = self.work, self.env
        versions = [0] * w.shards
        yield from self._wait(r, self._fetch(r, versions, None))
        step = 0
        pending_push, pending_fetch, applied = None, None, None
        while True:
            if w.consistency == "ssp":
                yield from self._hold_for_bound(r, step)
            if step > 0 and step % w.fetch_every == 0 and not w.chained:  # (chained: fetched after the push)
                if pending_fetch is None:
                    pending_fetch = self._fetch(r, versions, applied)
                yield from self._wait(r, pending_fetch)
                pending_fetch = None
            if w.overlap and (step + 1) % w.fetch_every == 0:
                pending_fetch = self._fetch(r, versions, applied)
            fetched = list(versions)
            yield from self._compute(r)
            if w.chained:
                call = env.process(self._push_fetch(r, versions))
                self._step_done(r)
                yield from self._wait(r, call)
            elif (step + 1) % w.push_every == 0:
                if pending_push is not None:
                    yield from self._wait(r, pending_push)
                applied = [env.event() for _ in range(w.shards)]
                pending_push = self._push(r, fetched, applied)
                self._step_done(r)
            else:
                self._step_done(r)
            step += 1

    def _step_done(self, r: int) -> None:
        self.steps[r] += 1
        self.clock[r] += 1
        if self.measuring:
            self.examples += self.work.batch
        moved, self._clock_moved = self._clock_moved, self.env.event()
        moved.succeed()

    def _hold_for_bound(self, r: int, step: int):
        """ssp: wait until ``step`` is at most ``staleness_bound`` ahead of the slowest replica's clock."""
        t = self.env.now
        while step - min(self._clocks()) > self.work.staleness_bound:
            yield self._clock_moved
        waited = self.env.now - t
        self.wait_s[r] += waited
        self.clock_wait_s[r] += waited

    def _clocks(self) -> list[int]:
        return self.clock

    # ------------------------------------------------------------------ sync
    def _sync_loop(self):
        """Lockstep steps (downpour/sync.py): each free replica, called by the driver, fetches, computes and sends
        its gradient parts (copies of its ranges) to the shards; the shards apply the mean of the first
        ``replicas`` computed from this step's parameters. A replica still computing when its step is applied (a
        backup's late gradient is dropped) is not called again until it answers."""
        w, env, s, c = self.work, self.env, self.shards, self.costs
        started = len(self.steps)
        busy: dict[int, simpy.Process] = {}

        def replica_step(r, arrived):
            node = self.replica_nodes[r]
            yield from self.world.cpu(node, c.call_cpu_s / 2)  # the callee's half of the driver's call
            versions = [0] * w.shards
            yield from self._wait(r, self._fetch(r, versions, None))
            yield from self._compute(r)
            if w.compress == "none":  # each shard's range copied out of the gradient, to be returned
                yield from self.world.copy(node, 4 * sum(s.sizes))
            yield env.all_of([env.process(self._up(r, k, self.push_bytes[k])) for k in self.modelled])
            arrived.append(r)
            del busy[r]

        while True:
            arrived: list[int] = []
            called: set[int] = set()
            while len(arrived) < w.replicas:
                for r in range(started):
                    if r not in busy and r not in called:
                        called.add(r)
                        yield from self.world.cpu(DRIVER_NODE, c.call_cpu_s / 2)  # the driver's half of the call
                        busy[r] = env.process(replica_step(r, arrived))
                yield env.any_of(list(busy.values()))
            yield from self.world.cpu(DRIVER_NODE, w.shards * c.call_cpu_s / 2)  # its calls to the shards
            used = arrived[:w.replicas]

            def apply(k):
                with s.lock[k].request() as req:
                    yield req
                    t = env.now
                    seconds = (c.call_cpu_s / 2 + w.replicas * (self.decode_s[k] + c.update_s("sgd") * s.sizes[k])
                               + c.update_s(w.rule) * s.sizes[k])
                    yield from self.world.cpu(s.nodes[k], seconds)
                    s.staleness[0] += w.replicas
                    s.version[k] += 1
                    s.busy[k] += env.now - t

            yield env.all_of([env.process(apply(k)) for k in range(w.shards)])
            for r in used:
                self.steps[r] += 1
                self.clock[r] += 1
            if self.measuring:
                self.examples += w.replicas * w.batch
            moved, self._clock_moved = self._clock_moved, env.event()
            moved.succeed()

    def staleness_mean(self) -> float:
        h = self.shards.staleness
        n = sum(h.values())
        return sum(k * v for k, v in h.items()) / n if n else math.nan
