"""Sandblaster L-BFGS, simulated: portions over replicas with backup tasks, and the vector programs on the shards.

One L-BFGS iteration here is what the coordinator does per accepted step (sandblaster/coordinator.py):

1. a distributed gradient evaluation: every replica fetches the parameters when the batch starts; the batch's
   ``lbfgs_batch / portion_size`` portions go to whichever replica is free (the coordinator's call per portion);
   a replica sends its accumulated gradient to the shards every ``push_every_portions`` portions and at the end;
   once the queue is empty, idle replicas take copies of portions still outstanding (backup tasks) and the first
   copy to finish counts;
2. the coordinator's vector programs on the shards: the two-loop recursion's dot products and updates over the
   ``history`` pairs and the line search's step, ``2 * history + 6`` rounds in which every shard runs one short
   program over its slice (a call and a pass over its values at the cost of an SGD update per value).

The line search is taken to accept its first step (one gradient evaluation per iteration), L-BFGS's usual case
once its history is full.
"""

from __future__ import annotations

import math

import simpy

from distbelief.simulate.costs import Costs
from distbelief.simulate.downpour import compute_seconds, replica_threads
from distbelief.simulate.engine import World
from distbelief.simulate.machines import Machines
from distbelief.simulate.outcome import Prediction, bottleneck
from distbelief.simulate.workload import Workload


class SandblasterRun:
    def __init__(self, work: Workload, machines: Machines, costs: Costs, representative: bool = False):
        self.work, self.machines, self.costs = work, machines, costs
        self.env = simpy.Environment()
        self.world = World(self.env, machines, costs)
        self.replica_nodes, self.shard_nodes = machines.place(work.replicas, work.shards)
        self.sizes = work.layout.sizes()
        # representative shard (large runs, as in simulate/downpour.py): shard 0 stands for all
        self.modelled = [0] if representative and work.shards > 1 else list(range(work.shards))
        self.others = work.shards - len(self.modelled)
        self.shard_lock = [simpy.Resource(self.env, capacity=1) for _ in self.sizes]
        self.shard_busy = [0.0] * len(self.sizes)
        portion = min(work.portion_size, work.lbfgs_batch)
        self.portions = math.ceil(work.lbfgs_batch / portion)
        from dataclasses import replace

        threads = replica_threads(work, machines, work.replicas, self.replica_nodes)
        self.portion_s = compute_seconds(replace(work, batch=portion), costs, threads, machines)
        # Sandblaster's shards always run in processes of their own: a replica on their cores computes
        # ``separate_process_slowdown`` times slower, as Downpour's does (simulate/downpour.py); one on cores no
        # shard uses does not. (A one-node 2x2 run's replicas computed 89 % of the time at 150 ms a 500-example
        # portion, 116 ms alone: 1.29 times, the calibration's 1.2-1.4.)
        shard_pools = {self.world.pool_of[n] for n in self.shard_nodes}
        self.step_factor = [costs.separate_process_slowdown if self.world.pool_of[n] in shard_pools else 1.0
                            for n in self.replica_nodes]
        self.compute_s = [0.0] * work.replicas
        self.wait_s = [0.0] * work.replicas
        self.computed = [0] * work.replicas  # portion copies computed (backups included)
        self.backups = 0
        self.iterations = 0
        self.active: dict[int, simpy.Process] = {}  # each replica's process in the current evaluation

    # ------------------------------------------------------------------ shard side
    def _shard_work(self, k: int, seconds: float):
        with self.shard_lock[k].request() as req:
            yield req
            t = self.env.now
            yield from self.world.cpu(self.shard_nodes[k], seconds)
            self.shard_busy[k] += self.env.now - t

    def _to_shards(self, r: int):
        """A replica's accumulated gradient, each shard's range to its shard (``accumulate``: one add a value)."""
        node, c = self.replica_nodes[r], self.costs

        def one(k):
            yield from self.world.occupy(node, "up", self.others * 4 * self.sizes[k])
            yield from self.world.send(node, self.shard_nodes[k], 4 * self.sizes[k])
            yield from self._shard_work(k, c.call_s + c.update_s("sgd") * self.sizes[k])

        return self.env.all_of([self.env.process(one(k)) for k in self.modelled])

    def _fetch(self, r: int):
        node, c = self.replica_nodes[r], self.costs

        def one(k):
            yield from self._shard_work(k, c.call_s)
            yield from self.world.send(self.shard_nodes[k], node, 4 * self.sizes[k])
            yield from self.world.occupy(node, "down", self.others * 4 * self.sizes[k])
            yield from self.world.copy(node, 4 * self.sizes[k] * (1 + self.others))

        return self.env.all_of([self.env.process(one(k)) for k in self.modelled])

    def _programs(self):
        """The coordinator's vector programs: ``2 * history + 6`` rounds over all shards."""
        c = self.costs
        for _ in range(2 * self.work.history + 6):
            yield self.env.all_of([self.env.process(self._shard_work(k, c.call_s + c.update_s("sgd") * self.sizes[k]))
                                   for k in self.modelled])

    # ------------------------------------------------------------------ one gradient evaluation
    def _evaluation(self):
        """One distributed gradient evaluation. It ends once every portion was computed once and what the
        replicas hold was pushed; a replica still computing a copy that another finished first is not waited
        for (its result is dropped), but it takes no new portion until it is done."""
        w, env = self.work, self.env
        queue = list(range(self.portions))
        done: set[int] = set()
        running: dict[int, int] = {}  # portion -> copies being computed
        held = [0] * w.replicas
        pushes: list = []
        finished = env.event()

        def replica(r, previous):
            if previous is not None and previous.is_alive:
                yield previous  # still computing a dropped copy from the last evaluation
            t = env.now
            yield self._fetch(r)
            self.wait_s[r] += env.now - t
            while not finished.triggered:
                if queue:
                    p = queue.pop(0)
                elif w.backup_tasks:
                    outstanding = [p for p, n in running.items() if n == 1 and p not in done]
                    if not outstanding:
                        return
                    p = outstanding[0]
                    self.backups += 1
                else:
                    return
                running[p] = running.get(p, 0) + 1
                t = env.now
                yield env.timeout(self.costs.call_s)  # the coordinator hands the portion over
                yield from self.world.cpu(self.replica_nodes[r], self.portion_s * w.slow.get(r, 1.0)
                                          * self.step_factor[r], compute=True)
                self.compute_s[r] += env.now - t
                self.computed[r] += 1
                running[p] -= 1
                if finished.triggered or p in done:
                    continue  # another copy finished first: this one is dropped
                done.add(p)
                held[r] += 1
                if len(done) == self.portions:
                    finished.succeed()
                elif held[r] == w.push_every_portions:
                    pushes.append(self._to_shards(r))
                    held[r] = 0

        for r in range(w.replicas):
            self.active[r] = env.process(replica(r, self.active.get(r)))
        yield finished
        for r in range(w.replicas):
            if held[r]:
                pushes.append(self._to_shards(r))
        yield env.all_of(pushes)

    def _iterations(self, warmup: int, measured: int, marks: list):
        for i in range(warmup + measured):
            if i == warmup:
                self._reset()
                marks.append(self.env.now)
            yield from self._evaluation()
            yield from self._programs()
            self.iterations += 1
        marks.append(self.env.now)

    def _reset(self) -> None:
        self.world.reset()
        self.shard_busy = [0.0] * len(self.sizes)
        self.compute_s = [0.0] * self.work.replicas
        self.wait_s = [0.0] * self.work.replicas
        self.computed = [0] * self.work.replicas
        self.backups = 0
        self.iterations = 0

    def run(self, iterations: int, warmup: int = 1) -> float:
        marks: list[float] = []
        self.env.process(self._iterations(warmup, iterations, marks))
        self.env.run()
        return marks[1] - marks[0]

    def prediction(self, seconds: float) -> Prediction:
        util = self.world.utilisation(seconds)
        shard_busy = [b / seconds for b in self.shard_busy]
        copies = sum(self.computed)
        compute = sum(self.compute_s) / max(1, copies)
        wait = sum(self.wait_s) / max(1, copies)
        name, why = bottleneck(shard_busy, util["cpu"], util["links"], compute, wait, [],
                               seconds * self.work.replicas)
        if name == "round trips":
            busy = sum(self.compute_s) / (seconds * self.work.replicas)
            name, why = "coordinator and shard programs", (f"replicas compute {busy:.0%} of the time; the rest "
                                                          f"is fetches, pushes and the shards' vector programs")
        return Prediction(
            examples_per_s=self.iterations * self.work.lbfgs_batch / seconds, steps_per_s=copies / seconds,
            step_s=compute + wait, compute_s=compute, wait_s=wait, staleness_mean=0.0, staleness_histogram={},
            shard_busy=shard_busy, cpu_busy=util["cpu"], link_busy=util["links"], bottleneck=name, why=why,
            simulated_s=seconds,
            details={"iterations": self.iterations, "portions_per_batch": self.portions,
                     "backup_copies": self.backups, "portion_compute_s": self.portion_s,
                     "replica_nodes": self.replica_nodes, "shard_nodes": self.shard_nodes})
