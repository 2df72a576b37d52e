"""The Sandblaster coordinator: batch L-BFGS whose vectors never leave the parameter shards (docs/paper.md).

The coordinator holds scalars only: the loss, the Gram matrix of the L-BFGS basis (O(m^2) floats), step
sizes, and the portion bookkeeping. Every vector — the parameters, the accepted point ``x``, the gradients, the
direction ``d``, the history ring ``s0..s{m}``, ``y0..y{m}`` — lives sliced on the ``ParameterShard``s, which
run short programs of vector operations on their own slice and answer with partial scalars that the coordinator
sums.

This module drives the L-BFGS iterations (direction, line search, history) and owns their scalars; its parts:

* ``shard_programs``: the vector programs on the shards, and ``ShardFailed``;
* ``portion_dispatch``: one distributed gradient evaluation, the batch's portions over the replicas (pushes,
  backup tasks, a failed replica's portions computed again);
* ``replica_pool``: the replicas' slots, and a failed replica's replacement (now, after its backoff, or never);
* ``shard_recovery``: iteration checkpoints, and a dead shard's restart, rollback and redone iteration;
* ``counters``: what is reported in metrics and the summary, and saved with every checkpoint;
* ``settings``: ``CoordinatorSettings``.

Plain Python: the runtime is the only thing it talks to, and it never imports an engine.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable

from distbelief.ps.shard import PARAMS
from distbelief.runtime.base import Role, Runtime
from distbelief.sandblaster.counters import Counters
from distbelief.sandblaster.lbfgs import Gram, directional_derivative, two_loop_coefficients
from distbelief.sandblaster.portion_dispatch import PortionDispatcher
from distbelief.sandblaster.portions import PortionQueue
from distbelief.sandblaster.replica_pool import DeferredRestart, ReplicaPool, ReplicaSlot
from distbelief.sandblaster.settings import CoordinatorSettings
from distbelief.sandblaster.shard_programs import ShardGroup
from distbelief.sandblaster.shard_recovery import ShardRecovery

__all__ = ["Coordinator", "CoordinatorSettings", "DeferredRestart", "StepResult"]

X, D, GRADS = "x", "d", ("g0", "g1")


def _encode_float(v: float) -> float | str:
    """Strict JSON has no NaN/Inf (the loss is NaN before the first evaluation): those become strings."""
    return v if math.isfinite(v) else str(v)


@dataclass
class StepResult:
    """What one L-BFGS iteration did."""

    accepted: bool
    loss: float  # f at the (new) point, on this iteration's batch
    step: float  # t, the accepted step length (0 when rejected)
    evals: int  # trial points evaluated by the line search
    stopped: str = ""  # non-empty when the optimisation cannot continue (converged, line search failed)


class Coordinator:
    """Runs Sandblaster L-BFGS through a Runtime. Not thread-safe: one driver thread calls ``step``.

    Args:
        runtime: places and calls roles.
        shards: the parameter shards (their ``params`` vector is the model; it is the starting point).
        replicas: replica id -> placed SandblasterReplica role.
        settings: see CoordinatorSettings.
        restart: called with ``(replica_id, error)`` when a replica fails; returns a replacement role, a
            ``DeferredRestart`` (the replacement starts later; the other replicas go on meanwhile), or None to go
            on without it. Default: go on without it.
        log: progress messages.
        on_poll: called on every turn of the portion loop (fault injection, tests).
        shard_replaced: called with ``(shard_id, new_role)`` after a dead shard was restarted (the coordinator
            itself updates ``shards`` in place and its replicas' clients; the caller updates its own clients).
        persist: called with ``(tag, state)`` once every shard has written iteration checkpoint ``tag``; ``state``
            (``export_state()``, JSON-able) is what, with those vector checkpoints, continues the run elsewhere
            (the trainer writes it next to them, see ``sandblaster.state``).
    """

    # What a rollback to an iteration checkpoint restores (the counters are never rolled back).
    _SCALARS = ("pairs", "_free", "gram", "g", "g_next", "f", "batch_id", "_need_eval", "iterations", "_started")

    def __init__(self, runtime: Runtime, shards: list[Role], replicas: dict[int, Role],
                 settings: CoordinatorSettings,
                 restart: Callable[[int, Exception], Role | DeferredRestart | None] | None = None,
                 log: Callable[[str], None] | None = None,
                 on_poll: Callable[["Coordinator"], None] | None = None,
                 shard_replaced: Callable[[int, Role], None] | None = None,
                 persist: Callable[[int, dict], None] | None = None):
        self.runtime, self.shards, self.settings = runtime, shards, settings
        self.log = log or (lambda msg: None)
        self.counters = Counters(portions_by_replica={rid: 0 for rid in replicas})
        self._shards = ShardGroup(runtime, shards, settings.remote_timeout_s)
        pool = ReplicaPool(runtime, replicas, restart, self.log, settings.remote_timeout_s)
        self.portions = PortionDispatcher(runtime, self._shards, pool, settings, self.counters,
                                          on_poll=(lambda: on_poll(self)) if on_poll is not None else None)
        self.recovery = ShardRecovery(runtime, self._shards, self.portions, settings, self.counters,
                                      capture=self._capture, restore=self._restore_scalars, log=self.log,
                                      shard_replaced=shard_replaced, persist=persist)
        m = settings.lbfgs.history
        # m + 1 slots: the new pair is written into a free slot, so a pair that fails the curvature test never
        # overwrites the oldest live pair.
        self._free = [(f"s{i}", f"y{i}") for i in range(m + 1)]
        self.pairs: list[tuple[str, str]] = []  # live pairs, oldest first
        self.gram = Gram()
        self.g, self.g_next = GRADS
        self.f = math.nan
        self.batch_id = 0
        self._need_eval = True
        self.iterations = 0
        self._started = False

    @property
    def slots(self) -> dict[int, ReplicaSlot]:
        """The live replicas, by id."""
        return self.portions.slots

    @property
    def queue(self) -> PortionQueue | None:
        """The portion queue of the current (or last) gradient evaluation."""
        return self.portions.queue

    # ------------------------------------------------------------------ shard programs
    def _program(self, ops: list[tuple]) -> list:
        """Run ``ops`` on every shard's slice in one round trip; partial scalars are summed over the shards."""
        return self._shards.program(ops)

    def _dots(self, pairs: list[tuple[str, str]], ops: list[tuple] | None = None) -> None:
        """Run ``ops`` then the inner products ``pairs`` (one round trip) and record them in the Gram matrix."""
        ops = list(ops or []) + [("dots", pairs)]
        values = self._program(ops)[-1]
        for (a, b), v in zip(pairs, values):
            self.gram.set(a, b, v)

    def _evaluate(self, grad: str) -> float:
        """Mean loss over the batch at the shards' ``params``; its gradient is added into ``grad`` (already zero)."""
        return self.portions.evaluate(grad, self.batch_id)

    # ------------------------------------------------------------------ L-BFGS
    def start(self) -> None:
        """Remember the shards' current parameters as the starting point ``x``."""
        self.recovery.checkpointed = False
        self._program([("copy", PARAMS, X)])
        self._started = True

    def evaluate_gradient(self, into: str) -> float:
        """Mean loss at the shards' current ``params`` on the current batch; its gradient is left in the shard
        vector ``into`` (zeroed first). One pass of the portion queue; used by ``step`` and by tests."""
        self.recovery.checkpointed = False
        self._program([("zero", into)])
        return self._evaluate(into)

    def _basis(self) -> list[str]:
        return [name for pair in self.pairs for name in pair]

    def _evaluate_at_x(self) -> None:
        """f and g at the accepted point on this iteration's batch, and g's Gram entries."""
        self.f = self.evaluate_gradient(self.g)
        self.gram.forget(self.g)
        self._dots([(self.g, b) for b in self._basis() + [self.g]])
        self._need_eval = False

    def step(self) -> StepResult:
        """One L-BFGS iteration: direction by the two-loop recursion, then a backtracking Armijo line search.

        With ``checkpoint_dir``, every shard first saves all its vectors (a consistent point) unless nothing
        changed since the last checkpoint; if a shard dies during the iteration it is restarted from that
        checkpoint, every shard and the coordinator roll back to it, and the iteration is done again — the result
        is the same as without the failure.
        """
        goal = self.iterations + 1
        while True:
            result = self.recovery.run(self._checkpoint_then_step)
            if result.accepted and not result.stopped and self.iterations < goal:
                continue  # that was an earlier iteration, redone after a rollback: now do this one
            return result

    def _checkpoint_then_step(self) -> StepResult:
        self.recovery.checkpoint_if_needed()
        return self._step()

    def _step(self) -> StepResult:
        self.recovery.checkpointed = False
        if not self._started:
            self.start()
        lb = self.settings.lbfgs
        if self._need_eval:
            self._evaluate_at_x()
        gg = self.gram(self.g, self.g)
        if not math.isfinite(self.f) or not math.isfinite(gg):
            return StepResult(False, self.f, 0.0, 0, stopped="loss or gradient is not finite")
        if lb.grad_tol and math.sqrt(gg) <= lb.grad_tol:
            return StepResult(False, self.f, 0.0, 0, stopped="converged (gradient norm below grad_tol)")
        coeffs = two_loop_coefficients(self.pairs, self.g, self.gram)
        gd = directional_derivative(coeffs, self.g, self.gram)
        if not gd < 0:  # not a descent direction (numerical trouble): fall back to steepest descent
            self._clear_history()
            coeffs, gd = {self.g: -1.0}, -gg
        # Without curvature information the first step is normalised, so that ||t d|| <= 1.
        t = 1.0 if self.pairs else min(1.0, 1.0 / math.sqrt(gg))
        ops: list[tuple] = [("lincomb", D, [(c, name) for name, c in coeffs.items()])]
        for k in range(1, lb.max_evals + 1):
            ops += [("lincomb", PARAMS, [(1.0, X), (t, D)]), ("zero", self.g_next)]
            self._program(ops)
            ops = []
            f_t = self._evaluate(self.g_next)
            self.counters.line_search_evals += 1
            if math.isfinite(f_t) and f_t <= self.f + lb.c1 * t * gd:
                self._accept(t, f_t)
                return StepResult(True, f_t, t, k)
            t *= lb.backtrack
        # No sufficient decrease: stay at x. With history, retry along -g next time; without, we are done.
        self._program([("copy", X, PARAMS)])
        if self.pairs:
            self._clear_history()
            self.log("line search failed; history cleared, next iteration takes a steepest-descent step")
            return StepResult(False, self.f, 0.0, lb.max_evals)
        return StepResult(False, self.f, 0.0, lb.max_evals,
                          stopped="line search failed along the steepest descent (converged to precision)")

    def _accept(self, t: float, f_t: float) -> None:
        lb = self.settings.lbfgs
        s, y = self._free.pop(0)
        self.gram.forget(s)
        self.gram.forget(y)
        self.gram.forget(self.g_next)
        ops = [
            ("lincomb", s, [(t, D)]),  # s = x_new - x
            ("lincomb", y, [(1.0, self.g_next), (-1.0, self.g)]),  # y = g_new - g (same batch)
            ("copy", PARAMS, X),
        ]
        basis = self._basis()
        new = [s, y]
        full = self.settings.full_batch
        if full:
            new.append(self.g_next)  # it is also the next iteration's gradient
        pairs = []
        for i, a in enumerate(new):
            pairs += [(a, b) for b in basis] + [(a, b) for b in new[: i + 1]]
        self._dots(pairs, ops)
        if self.gram(s, y) > lb.curvature_eps:
            self.pairs.append((s, y))
            if len(self.pairs) > lb.history:
                self._release(self.pairs.pop(0))
        else:
            self._release((s, y))
        self.gram.forget(self.g)
        self.g, self.g_next = self.g_next, self.g
        self.f = f_t
        self.iterations += 1
        if not full:
            self.batch_id += 1
            self._need_eval = True

    def _release(self, pair: tuple[str, str]) -> None:
        self.gram.forget(pair[0])
        self.gram.forget(pair[1])
        self._free.append(pair)

    def _clear_history(self) -> None:
        for pair in self.pairs:
            self._release(pair)
        self.pairs = []

    # ------------------------------------------------------------------ checkpoints and persistence
    def checkpoint(self) -> int | None:
        """Write an iteration checkpoint now, unless nothing changed since the last one. The trainer calls this
        after every step, so that a finished iteration is on disk before it is evaluated (a driver killed later
        loses nothing it reported). Returns the tag of the last checkpoint (None without ``checkpoint_dir``).

        If a shard dies while checkpointing, everything rolls back to the previous checkpoint (the iteration just
        done is then done again by the next ``step``).
        """
        if not self.settings.checkpoint_dir:
            return None
        self.recovery.run(self.recovery.checkpoint_if_needed)
        return self.recovery.ckpt.tag

    @property
    def last_checkpoint(self) -> tuple[int, dict] | None:
        """``(tag, export_state() at that checkpoint)`` of the last iteration checkpoint, or None."""
        ck = self.recovery.ckpt
        return None if ck is None else (ck.tag, ck.state)

    def _capture(self) -> tuple[dict, dict]:
        """Our scalars now: a deep copy (for a rollback) and ``export_state()`` (for a resume)."""
        return {name: copy.deepcopy(getattr(self, name)) for name in self._SCALARS}, self.export_state()

    def _restore_scalars(self, scalars: dict) -> None:
        for name, value in scalars.items():
            setattr(self, name, copy.deepcopy(value))

    def export_state(self) -> dict:
        """Our scalars and counters as JSON-able values. With the shards' vectors of the same moment they are the
        whole optimizer: ``restore_state`` continues from them exactly (the same steps as without the break)."""
        return {
            "pairs": [list(p) for p in self.pairs],  # live (s, y) ring slots, oldest first
            "free": [list(p) for p in self._free],  # the other slots, in the order they will be used
            "gram": [[a, b, _encode_float(v)] for a, b, v in self.gram.entries()],
            "g": self.g, "g_next": self.g_next, "f": _encode_float(self.f), "batch_id": self.batch_id,
            "need_eval": self._need_eval, "iterations": self.iterations, "started": self._started,
            **self.counters.export(),  # counters, portions_by_replica, shard_recovery_s
        }

    def restore_state(self, state: dict, next_tag: int) -> None:
        """Continue from ``state`` (``export_state()`` of an earlier run) whose vectors the shards already hold —
        possibly resliced over a different number of shards. Iteration checkpoints continue at ``next_tag``
        (above every tag on disk); until the first is written there is nothing to roll back to."""
        ring = {(f"s{i}", f"y{i}") for i in range(self.settings.lbfgs.history + 1)}
        pairs = [tuple(p) for p in state["pairs"]]
        free = [tuple(p) for p in state["free"]]
        if set(pairs) | set(free) != ring or len(pairs) + len(free) != len(ring):
            raise ValueError(f"the saved L-BFGS ring {sorted(set(pairs) | set(free))} does not match history = "
                             f"{self.settings.lbfgs.history} ({len(ring)} slots)")
        self.pairs, self._free = pairs, free
        self.gram = Gram.from_entries((a, b, float(v)) for a, b, v in state["gram"])
        self.g, self.g_next, self.f = state["g"], state["g_next"], float(state["f"])
        self.batch_id, self._need_eval = int(state["batch_id"]), bool(state["need_eval"])
        self.iterations, self._started = int(state["iterations"]), bool(state["started"])
        self.counters.restore(state)
        self.recovery.reset(next_tag)

    def abandon_iteration(self) -> bool:
        """Give up the iteration in progress (Ctrl-C, SIGTERM). Waits for the gradient pushes in flight (nothing
        may reach a shard afterwards), then puts every shard and our scalars back at the last iteration
        checkpoint: the shards' ``params`` are then an accepted point, the one the checkpoint on disk describes.
        Without checkpoints ``params`` go back to the accepted point ``x``. Portions still being computed are left
        to finish (their results are stale). Returns True if a partial iteration was dropped.
        """
        self.portions.settle_pushes()
        if self.recovery.checkpointed:
            return False
        if self.recovery.ckpt is not None:
            self.recovery.rollback()
        elif self._started:
            self._program([("copy", X, PARAMS)])
        return True

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict:
        c = self.counters
        return {
            "iterations": self.iterations,
            "gradient_evals": c.gradient_evals,
            "line_search_evals": c.line_search_evals,
            "portions_done": c.portions_done,
            "portions_duplicated": c.portions_duplicated,
            "backup_tasks_issued": c.backups_issued,
            "portions_requeued": c.portions_requeued,
            "replica_failures": c.replica_failures,
            "examples": c.examples,
            "loss": self.f,
            "history_pairs": len(self.pairs),
            "shard_restarts": c.shard_restarts,
            "iterations_redone": c.iterations_redone,
        }
