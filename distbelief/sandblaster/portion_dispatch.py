"""One distributed gradient evaluation: the batch's portions dispatched to the replicas (docs/paper.md).

Gradients are computed by replicas on *portions* of the batch (``PortionQueue`` decides who computes what,
including backup tasks; this module executes). A replica keeps each portion's gradient apart until it pushes;
every ``push_every_portions`` portions the dispatcher claims what it holds (each portion is claimed once,
whichever replica computed it) and forwards the pushed sum to the shards' ``accumulate`` as a reference
(``Future.as_arg``): the gradient travels replica -> shards, never through the coordinator.

A replica that fails or runs over ``remote_timeout_s`` loses what it computed or held (those portions go back to
the queue) and is replaced through the ``ReplicaPool``. A shard found dead while the pass waits raises
``ShardFailed`` for the shard recovery.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from distbelief.exceptions import DistBeliefError, RemoteTimeoutError, RoleFailedError
from distbelief.runtime.base import Future, Role, Runtime
from distbelief.sandblaster.counters import Counters
from distbelief.sandblaster.portions import PortionQueue
from distbelief.sandblaster.replica_pool import ReplicaPool, ReplicaSlot
from distbelief.sandblaster.settings import CoordinatorSettings
from distbelief.sandblaster.shard_programs import ShardFailed, ShardGroup


@dataclass
class GradientPush:
    """A replica's accumulated gradient on its way into every shard's ``accumulate``."""

    futures: list[Future]
    portion_ids: list[int]
    replica_id: int
    role: Role
    started_s: float


class PortionDispatcher:
    """Runs gradient evaluations over the replicas of ``pool``, one at a time, for the coordinator.

    ``on_poll`` is called on every turn of the portion loop (fault injection, tests).
    """

    def __init__(self, runtime: Runtime, shards: ShardGroup, pool: ReplicaPool, settings: CoordinatorSettings,
                 counters: Counters, on_poll: Callable[[], None] | None = None):
        self.runtime, self.shards, self.pool, self.settings = runtime, shards, pool, settings
        self.counters, self.on_poll = counters, on_poll
        self.timeout_s = settings.remote_timeout_s
        self.eval_id = -1
        self.batch_id = 0
        self.queue: PortionQueue | None = None
        self.pushes: list[GradientPush] = []
        self._grad_target = ""  # the gradient vector the current evaluation accumulates into

    @property
    def slots(self) -> dict[int, ReplicaSlot]:
        return self.pool.slots

    # ------------------------------------------------------------------ one gradient evaluation
    def evaluate(self, grad: str, batch_id: int) -> float:
        """Mean loss over batch ``batch_id`` at the shards' ``params``; its gradient is added into ``grad``
        (already zero).

        Returns once every portion's gradient is on the shards, each counted exactly once.
        """
        cfg, c = self.settings, self.counters
        self.eval_id += 1
        self.batch_id = batch_id
        self._grad_target = grad
        self.queue = q = PortionQueue(cfg.effective_batch, cfg.portion_size, list(self.slots),
                                      backup_tasks=cfg.backup_tasks, force_backups=cfg.force_backups)
        losses: dict[int, float] = {}
        self.pushes = pushes = []
        while not q.all_committed():
            if self.on_poll is not None:
                self.on_poll()
            for rid in self.pool.start_due():  # failed replicas whose backoff is over take portions from now on
                q.add_replica(rid)
            for rid in list(self.slots):
                if self.slots[rid].future is None:
                    self._dispatch(rid, q)
            waiting = [s.future for s in self.slots.values() if s.future is not None]
            waiting += [f for p in pushes for f in p.futures]
            if not waiting:
                next_start = self.pool.next_start_at()
                if next_start is not None:  # nothing runs until a replica's backoff is over
                    time.sleep(min(cfg.poll_s, max(0.0, next_start - time.monotonic())))
                    continue
                if not self.slots:
                    raise DistBeliefError("every replica failed and none could be restarted")
                raise AssertionError("portion queue stalled: portions left but nothing running")
            done = {id(f) for f in self.runtime.wait_any(waiting, cfg.poll_s)}
            if not done and cfg.checkpoint_dir:
                # Nothing finished for a while: a replica may be waiting on a dead shard (its fetch blocks until
                # the shard is replaced), so look.
                dead = self.shards.dead()
                if dead:
                    raise ShardFailed(dead[0], f"parameter shard {dead[0]} died during a gradient evaluation")
            for rid in list(self.slots):
                slot = self.slots.get(rid)
                if slot is not None and slot.future is not None and id(slot.future) in done:
                    self._on_replica_result(rid, q, losses, pushes)
            for push in [p for p in pushes if all(f.done() for f in p.futures)]:
                pushes.remove(push)
                self._on_push_done(push, q)
            self._check_deadlines(q, pushes)
        c.backups_issued += q.backups_issued
        c.gradient_evals += 1
        c.examples += cfg.effective_batch
        return math.fsum(losses.values())

    def _dispatch(self, rid: int, q: PortionQueue) -> None:
        """Decide what an idle replica does next — push, compute, or nothing — and send it."""
        slot = self.slots[rid]
        current = slot.eval_id == self.eval_id
        n = q.claimable(rid) if current else 0
        # Push after push_every_portions portions, and at once when nothing is left to hand out: from then on
        # the batch waits for held gradients.
        if n and (n >= self.settings.push_every_portions or q.num_pending == 0):
            include, drop = q.claim(rid)
            self._send(slot, "take", "take_gradient", self.eval_id, include, drop)
            slot.claim = include
            return
        busy = frozenset(r for r, s in self.slots.items() if s.future is not None)
        p = q.next_for(rid, busy)
        if p is None:
            return
        drop = q.release(rid) if current else []
        self._send(slot, "compute", "compute", self.eval_id, self.batch_id, self.settings.effective_batch,
                   p.portion_id, p.lo, p.hi, drop)
        slot.eval_id = self.eval_id

    def _send(self, slot: ReplicaSlot, kind: str, method: str, *args) -> None:
        slot.future = self.runtime.call(slot.role, method, *args)
        slot.kind, slot.call_eval, slot.started_s = kind, self.eval_id, time.monotonic()

    def _on_replica_result(self, rid: int, q: PortionQueue, losses: dict[int, float],
                           pushes: list[GradientPush]) -> None:
        slot, c = self.slots[rid], self.counters
        fut, kind, call_eval = slot.future, slot.kind, slot.call_eval
        slot.future = None
        if kind == "compute":
            try:
                _, pid, loss, _ = fut.result(self.timeout_s)  # four scalars
            except (RoleFailedError, RemoteTimeoutError) as e:
                self.replica_failed(rid, e, q)
                return
            c.portions_by_replica[rid] = c.portions_by_replica.get(rid, 0) + 1
            if call_eval != self.eval_id:  # a backup still running when the last evaluation finished
                c.portions_duplicated += 1
                return
            if q.result(pid, rid):
                losses[pid] = loss  # every copy has the same loss; the first one is recorded
            else:
                c.portions_duplicated += 1
            return
        # "take": the pushed gradient is ready (in Ray's object store); pass it on without looking at it.
        claim, slot.claim = slot.claim, []
        try:
            ref = fut.as_arg()
        except (RoleFailedError, RemoteTimeoutError) as e:  # the in-process runtime reports a failed take here
            c.portions_requeued += len(q.lost(claim))
            self.replica_failed(rid, e, q)
            return
        futs = [self.runtime.call(s, "accumulate", self._grad_target, ref, 0) for s in self.shards.roles]
        pushes.append(GradientPush(futs, claim, rid, slot.role, time.monotonic()))

    def _on_push_done(self, push: GradientPush, q: PortionQueue) -> None:
        errors = []
        for f in push.futures:
            try:
                f.result(self.timeout_s)
            except (RoleFailedError, RemoteTimeoutError) as e:
                errors.append(e)
        if not errors:
            q.committed(push.portion_ids)
            self.counters.portions_done += len(push.portion_ids)
            return
        dead = self.shards.dead()
        if dead:
            raise ShardFailed(dead[0], f"parameter shard {dead[0]} died while adding a gradient push: {errors[0]}")
        if len(errors) < len(push.futures):
            raise RoleFailedError(f"a parameter shard failed while adding a gradient push ({errors[0]}); the "
                                  f"batch gradient is inconsistent and Sandblaster cannot continue")
        # Every shard refused it: the push never existed (its replica died while producing it).
        self.counters.portions_requeued += len(q.lost(push.portion_ids))
        slot = self.slots.get(push.replica_id)
        if slot is not None and slot.role is push.role:
            self.replica_failed(push.replica_id, errors[0], q)

    def _check_deadlines(self, q: PortionQueue, pushes: list[GradientPush]) -> None:
        now = time.monotonic()
        for rid in list(self.slots):
            slot = self.slots[rid]
            if slot.future is not None and now - slot.started_s > self.timeout_s:
                self.replica_failed(rid, RemoteTimeoutError(
                    f"replica {rid} did not answer {slot.kind} within {self.timeout_s:.0f}s (remote_timeout_s)"), q)
        for push in pushes:
            if now - push.started_s > self.timeout_s:
                raise RemoteTimeoutError(f"parameter shards did not add a gradient push within "
                                         f"{self.timeout_s:.0f}s (remote_timeout_s)")

    # ------------------------------------------------------------------ replica failures
    def replica_failed(self, rid: int, err: Exception, q: PortionQueue | None) -> None:
        """Forget what the replica computed or held, then replace it (or go on without it). ``q`` is None when
        the evaluation was abandoned (a shard failure)."""
        slot, c = self.slots[rid], self.counters
        c.replica_failures += 1
        if q is not None and slot.future is not None and slot.kind == "take" and slot.call_eval == self.eval_id:
            c.portions_requeued += len(q.lost(slot.claim))  # its push never left it
        slot.future = None
        if q is not None:
            c.portions_requeued += len(q.replica_failed(rid))
        if self.pool.replace(rid, err) and q is not None:
            q.add_replica(rid)

    # ------------------------------------------------------------------ abandoning an evaluation
    def discard_in_flight(self) -> None:
        """Drop the evaluation in progress after a shard failure: let whatever it still has in flight finish (its
        results are discarded), so that nothing of it reaches a shard after the rollback."""
        for rid in list(self.slots):
            slot = self.slots[rid]
            if slot.future is not None:
                try:
                    slot.future.result(self.timeout_s)
                    slot.future = None
                except (RoleFailedError, RemoteTimeoutError) as e:
                    self.replica_failed(rid, e, None)
            slot.claim = []
        for push in self.pushes:
            for f in push.futures:
                try:
                    f.result(self.timeout_s)
                except (RoleFailedError, RemoteTimeoutError):
                    pass
        self.pushes = []
        self.queue = None

    def settle_pushes(self) -> None:
        """Drop the evaluation in progress on an interrupt: wait for the gradient pushes in flight (nothing may
        reach a shard afterwards). Portions still being computed are left to finish (their results are stale)."""
        deadline = time.monotonic() + self.timeout_s
        # Pushes in flight write the shards; takes are the pushes' sources (never forwarded now, but a later
        # step must not find one outstanding). Computes only read the shards.
        takes = [s.future for s in self.slots.values() if s.future is not None and s.kind == "take"]
        pending = takes + [f for p in self.pushes for f in p.futures]
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RemoteTimeoutError(f"gradient pushes still in flight after {self.timeout_s:.0f}s "
                                         f"(remote_timeout_s); the shards' state is unknown, resume from the last "
                                         f"iteration checkpoint on disk")
            self.runtime.wait_any(pending, min(left, self.settings.poll_s))
            pending = [f for f in pending if not f.done()]
        for slot in self.slots.values():
            if slot.kind == "take":
                slot.future, slot.claim = None, []
        self.pushes, self.queue = [], None
