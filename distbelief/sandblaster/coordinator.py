"""The Sandblaster coordinator: batch L-BFGS whose vectors never leave the parameter shards (PAPER.md §3).

The coordinator holds scalars only: the loss, the Gram matrix of the L-BFGS basis (O(m^2) floats), step
sizes, and the portion bookkeeping. Every vector — the parameters, the accepted point ``x``, the gradients, the
direction ``d``, the history ring ``s0..s{m}``, ``y0..y{m}`` — lives sliced on the ``ParameterShard``s, which
run short *programs* of vector operations on their own slice (``execute``: ``lincomb``, ``dots``, ``copy``,
``zero``, ...) and answer with partial scalars that the coordinator sums.

Gradients are computed by replicas on *portions* of the batch (``PortionQueue``). A replica keeps each
portion's gradient apart until it pushes; every ``push_every_portions`` portions the coordinator claims what it
holds (each portion is claimed once, whichever replica computed it) and forwards the pushed sum to the shards'
``accumulate`` as a reference (``Future.as_arg``): the gradient travels replica -> shards, never through the
coordinator.

Plain Python: the runtime is the only thing it talks to, and it never imports an engine.
"""

from __future__ import annotations

import copy
import math
import time
from functools import partial
from dataclasses import dataclass, field
from typing import Callable

from distbelief.exceptions import DistBeliefError, RemoteTimeoutError, RoleFailedError
from distbelief.ps.shard import PARAMS, ParameterShard
from distbelief.runtime.base import Future, Role, Runtime
from distbelief.sandblaster.lbfgs import Gram, LBFGSSettings, directional_derivative, two_loop_coefficients
from distbelief.sandblaster.portions import PortionQueue

X, D, GRADS = "x", "d", ("g0", "g1")


def _encode_float(v: float) -> float | str:
    """Strict JSON has no NaN/Inf (the loss is NaN before the first evaluation): those become strings."""
    return v if math.isfinite(v) else str(v)


@dataclass(frozen=True)
class CoordinatorSettings:
    """How the coordinator runs (see docs/sandblaster.md).

    Attributes:
        num_examples: size of the training set every replica holds.
        batch_size: examples per gradient evaluation (>= num_examples means full batch).
        portion_size: examples per portion.
        push_every_portions: a replica pushes the gradients it holds after this many portions (and at once
            when nothing is left to hand out).
        backup_tasks: near the end of a batch, give running portions to idle replicas too.
        force_backups: testing only: every portion is computed by two replicas.
        lbfgs: the L-BFGS and line-search constants.
        seed: seeds the batch order (full batch ignores it).
        remote_timeout_s: the longest any call may take; a replica over it is treated as dead.
        poll_s: how long one wait for results may block before the loop looks at timeouts and hooks.
        checkpoint_dir: where every shard saves all its vectors at each iteration boundary (before an iteration
            unless nothing changed since the last checkpoint; ``checkpoint()`` after one); a shard that dies is
            restarted from there and the iteration is redone. Empty: no checkpoints (a dead shard ends the run).
        max_shard_restarts: how often one shard may be restarted in a run.
    """

    num_examples: int
    batch_size: int
    portion_size: int
    push_every_portions: int = 4
    backup_tasks: bool = True
    force_backups: bool = False
    lbfgs: LBFGSSettings = field(default_factory=LBFGSSettings)
    seed: int = 0
    remote_timeout_s: float = 120.0
    poll_s: float = 0.5
    checkpoint_dir: str = ""
    max_shard_restarts: int = 3

    @property
    def effective_batch(self) -> int:
        return min(self.batch_size, self.num_examples)

    @property
    def full_batch(self) -> bool:
        return self.batch_size >= self.num_examples


@dataclass(frozen=True)
class DeferredRestart:
    """What a ``restart`` callback returns to have a failed replica started again later (its backoff), without
    holding up the coordinator: ``start()`` is called once ``time.monotonic()`` reaches ``at``."""

    at: float
    start: Callable[[], Role]


@dataclass
class _Slot:
    """The coordinator's view of one replica."""

    role: Role
    future: Future | None = None
    kind: str = ""  # "compute" or "take"
    call_eval: int = -1  # the evaluation the outstanding call belongs to
    started_s: float = 0.0
    eval_id: int = -1  # the evaluation whose parameters (and held portions) the replica has
    claim: list[int] = field(default_factory=list)  # portions carried by the outstanding take


@dataclass
class _Push:
    """A replica's accumulated gradient on its way into every shard's ``accumulate``."""

    futures: list[Future]
    portion_ids: list[int]
    replica_id: int
    role: Role
    started_s: float


@dataclass(frozen=True)
class _Checkpoint:
    """The last iteration checkpoint every shard acknowledged, and our scalars at that point."""

    tag: int
    scalars: dict  # deep copies of Coordinator._SCALARS, for an in-run rollback
    state: dict  # export_state() at that point: JSON-able, for a resume in another process


class _ShardFailed(RoleFailedError):
    """Parameter shard ``shard_id`` died during an iteration (internal: triggers a rollback)."""

    def __init__(self, shard_id: int, msg: str):
        super().__init__(msg)
        self.shard_id = shard_id


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

    def __init__(self, runtime: Runtime, shards: list[Role], replicas: dict[int, Role],
                 settings: CoordinatorSettings,
                 restart: Callable[[int, Exception], Role | DeferredRestart | None] | None = None,
                 log: Callable[[str], None] | None = None,
                 on_poll: Callable[["Coordinator"], None] | None = None,
                 shard_replaced: Callable[[int, Role], None] | None = None,
                 persist: Callable[[int, dict], None] | None = None):
        if not replicas:
            raise ValueError("the coordinator needs at least one replica")
        self.runtime, self.shards, self.settings = runtime, shards, settings
        self.slots = {rid: _Slot(role) for rid, role in replicas.items()}
        self.restart = restart
        self._deferred: dict[int, DeferredRestart] = {}  # failed replicas waiting out their backoff
        self.log = log or (lambda msg: None)
        self.on_poll = on_poll
        self.shard_replaced = shard_replaced
        self.persist = persist
        self.timeout_s = settings.remote_timeout_s
        m = settings.lbfgs.history
        # m + 1 slots: the new pair is written into a free slot, so a pair that fails the curvature test never
        # overwrites the oldest live pair.
        self._free = [(f"s{i}", f"y{i}") for i in range(m + 1)]
        self.pairs: list[tuple[str, str]] = []  # live pairs, oldest first
        self.gram = Gram()
        self.g, self.g_next = GRADS
        self._grad_target = self.g  # the gradient vector the current evaluation accumulates into
        self.f = math.nan
        self.batch_id = 0
        self._need_eval = True
        self.eval_id = -1
        self.queue: PortionQueue | None = None
        # counters (reported in metrics and summary)
        self.iterations = 0
        self.gradient_evals = 0
        self.line_search_evals = 0
        self.portions_done = 0
        self.portions_duplicated = 0
        self.backups_issued = 0
        self.portions_requeued = 0
        self.replica_failures = 0
        self.examples = 0
        self.portions_by_replica: dict[int, int] = {rid: 0 for rid in replicas}
        self._started = False
        # shard failures: the last iteration checkpoint every shard acknowledged, and our scalars at that point
        self.shard_restarts = 0
        self.iterations_redone = 0
        self.shard_recovery_s: list[float] = []
        self._restarts_by_shard: dict[int, int] = {}
        # One attribute, assigned in one statement: a Ctrl-C can never leave the tag and the scalars disagreeing.
        self._ckpt: _Checkpoint | None = None
        self._next_tag = 0
        self._checkpointed = False  # nothing changed on the shards or here since self._ckpt was taken
        self._pushes: list[_Push] = []

    # ------------------------------------------------------------------ shard programs
    def _program(self, ops: list[tuple]) -> list:
        """Run ``ops`` on every shard's slice in one round trip; partial scalars are summed over the shards."""
        futs = [self.runtime.call(s, "execute", ops) for s in self.shards]
        per_shard = []
        for k, f in enumerate(futs):
            try:
                per_shard.append(f.result(self.timeout_s))
            except RoleFailedError as e:
                raise _ShardFailed(k, f"parameter shard {k} failed during an L-BFGS vector program: {e}") from e
        out = []
        for i in range(len(ops)):
            vals = [r[i] for r in per_shard]
            if vals[0] is None:
                out.append(None)
            elif isinstance(vals[0], (list, tuple)):
                out.append([math.fsum(col) for col in zip(*vals)])
            else:
                out.append(math.fsum(vals))
        return out

    def _dots(self, pairs: list[tuple[str, str]], ops: list[tuple] | None = None) -> None:
        """Run ``ops`` then the inner products ``pairs`` (one round trip) and record them in the Gram matrix."""
        ops = list(ops or []) + [("dots", pairs)]
        values = self._program(ops)[-1]
        for (a, b), v in zip(pairs, values):
            self.gram.set(a, b, v)

    # ------------------------------------------------------------------ L-BFGS
    def start(self) -> None:
        """Remember the shards' current parameters as the starting point ``x``."""
        self._checkpointed = False
        self._program([("copy", PARAMS, X)])
        self._started = True

    def evaluate_gradient(self, into: str) -> float:
        """Mean loss at the shards' current ``params`` on the current batch; its gradient is left in the shard
        vector ``into`` (zeroed first). One pass of the portion queue; used by ``step`` and by tests."""
        self._checkpointed = False
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
            result = self._recovering(self._checkpoint_then_step)
            if result.accepted and not result.stopped and self.iterations < goal:
                continue  # that was an earlier iteration, redone after a rollback: now do this one
            return result

    def checkpoint(self) -> int | None:
        """Write an iteration checkpoint now, unless nothing changed since the last one. The trainer calls this
        after every step, so that a finished iteration is on disk before it is evaluated (a driver killed later
        loses nothing it reported). Returns the tag of the last checkpoint (None without ``checkpoint_dir``).

        If a shard dies while checkpointing, everything rolls back to the previous checkpoint (the iteration just
        done is then done again by the next ``step``).
        """
        if not self.settings.checkpoint_dir:
            return None
        self._recovering(self._checkpoint_if_needed)
        return self._ckpt.tag

    @property
    def last_checkpoint(self) -> tuple[int, dict] | None:
        """``(tag, export_state() at that checkpoint)`` of the last iteration checkpoint, or None."""
        ck = self._ckpt
        return None if ck is None else (ck.tag, ck.state)

    def _checkpoint_if_needed(self) -> None:
        if self.settings.checkpoint_dir and not self._checkpointed:
            self._save_checkpoint()

    def _checkpoint_then_step(self) -> StepResult:
        self._checkpoint_if_needed()
        return self._step()

    def _recovering(self, fn: Callable[[], object]):
        """``fn()``; if a shard dies meanwhile, restart it, roll back to the last checkpoint and call ``fn`` again."""
        failed: _ShardFailed | None = None
        while True:
            try:
                if failed is not None:
                    self._recover(failed)
                    failed = None
                return fn()
            except _ShardFailed as e:
                if not self.settings.checkpoint_dir or self._ckpt is None:
                    raise RoleFailedError(f"{e}. Sandblaster keeps its history on the shards and cannot continue "
                                          f"without iteration checkpoints (checkpoint_dir; a run writes them "
                                          f"unless --durability is off)") from e
                n = self._restarts_by_shard.get(e.shard_id, 0)
                if n >= self.settings.max_shard_restarts:
                    raise RoleFailedError(f"{e}; shard {e.shard_id} was already restarted {n} times "
                                          f"(max_shard_restarts)") from e
                failed = e

    # ------------------------------------------------------------------ shard failures
    _SCALARS = ("pairs", "_free", "gram", "g", "g_next", "f", "batch_id", "_need_eval", "iterations", "_started")

    _COUNTERS = ("gradient_evals", "line_search_evals", "portions_done", "portions_duplicated", "backups_issued",
                 "portions_requeued", "replica_failures", "examples", "shard_restarts", "iterations_redone")

    def _save_checkpoint(self) -> None:
        """Every shard saves all its vectors as checkpoint ``tag``; once all have, remember our scalars (and hand
        them to ``persist``). A tag is reused only when its save failed, so no state ever names a rewritten one."""
        tag = self._next_tag
        futs = [self.runtime.call(s, "checkpoint_vectors", self.settings.checkpoint_dir, tag) for s in self.shards]
        for k, f in enumerate(futs):
            try:
                f.result(self.timeout_s)
            except RoleFailedError as e:
                raise _ShardFailed(k, f"parameter shard {k} failed while checkpointing: {e}") from e
        scalars = {name: copy.deepcopy(getattr(self, name)) for name in self._SCALARS}
        self._ckpt = _Checkpoint(tag, scalars, self.export_state())
        self._next_tag = tag + 1
        self._checkpointed = True
        if self.persist is not None:
            self.persist(tag, self._ckpt.state)

    def export_state(self) -> dict:
        """Our scalars and counters as JSON-able values. With the shards' vectors of the same moment they are the
        whole optimizer: ``restore_state`` continues from them exactly (the same steps as without the break)."""
        return {
            "pairs": [list(p) for p in self.pairs],  # live (s, y) ring slots, oldest first
            "free": [list(p) for p in self._free],  # the other slots, in the order they will be used
            "gram": [[a, b, _encode_float(v)] for a, b, v in self.gram.entries()],
            "g": self.g, "g_next": self.g_next, "f": _encode_float(self.f), "batch_id": self.batch_id,
            "need_eval": self._need_eval, "iterations": self.iterations, "started": self._started,
            "counters": {name: getattr(self, name) for name in self._COUNTERS},
            "portions_by_replica": {str(rid): n for rid, n in sorted(self.portions_by_replica.items())},
            "shard_recovery_s": list(self.shard_recovery_s),
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
        for name in self._COUNTERS:
            setattr(self, name, int(state["counters"][name]))
        for rid, n in state["portions_by_replica"].items():
            self.portions_by_replica[int(rid)] = int(n)
        self.shard_recovery_s = [float(x) for x in state["shard_recovery_s"]]
        self._grad_target = self.g
        self._ckpt, self._next_tag, self._checkpointed = None, next_tag, False

    def abandon_iteration(self) -> bool:
        """Give up the iteration in progress (Ctrl-C, SIGTERM). Waits for the gradient pushes in flight (nothing
        may reach a shard afterwards), then puts every shard and our scalars back at the last iteration
        checkpoint: the shards' ``params`` are then an accepted point, the one the checkpoint on disk describes.
        Without checkpoints ``params`` go back to the accepted point ``x``. Portions still being computed are left
        to finish (their results are stale). Returns True if a partial iteration was dropped.
        """
        deadline = time.monotonic() + self.timeout_s
        # Pushes in flight write the shards; takes are the pushes' sources (never forwarded now, but a later
        # step must not find one outstanding). Computes only read the shards.
        takes = [s.future for s in self.slots.values() if s.future is not None and s.kind == "take"]
        pending = takes + [f for p in self._pushes for f in p.futures]
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
        self._pushes, self.queue = [], None
        if self._checkpointed:
            return False
        if self._ckpt is not None:
            self._rollback()
        elif self._started:
            self._program([("copy", X, PARAMS)])
        return True

    def _rollback(self) -> None:
        """Every shard's vectors and our scalars back to the last iteration checkpoint."""
        ck = self._ckpt
        futs = [self.runtime.call(s, "load_vectors", self.settings.checkpoint_dir, ck.tag) for s in self.shards]
        for k, f in enumerate(futs):
            try:
                f.result(self.timeout_s)
            except RoleFailedError as e:
                raise _ShardFailed(k, f"parameter shard {k} failed while rolling back: {e}") from e
        for name, value in ck.scalars.items():
            setattr(self, name, copy.deepcopy(value))
        self._checkpointed = True

    def _dead_shards(self) -> list[int]:
        futs = [self.runtime.call(s, "stats") for s in self.shards]
        dead = []
        for k, f in enumerate(futs):
            try:
                f.result(self.timeout_s)
            except RoleFailedError:
                dead.append(k)
        return dead

    def _recover(self, err: _ShardFailed) -> None:
        """Restart the dead shard(s) from the last iteration checkpoint, drop the partial iteration, and roll every
        shard and our own scalars back to that checkpoint."""
        t0 = time.monotonic()
        root, tag = self.settings.checkpoint_dir, self._ckpt.tag
        dead = sorted({err.shard_id, *self._dead_shards()})
        self.log(f"parameter shard(s) {dead} died ({err}); restarting from iteration checkpoint {tag} and redoing "
                 f"the iteration")
        for k in dead:
            try:
                self.runtime.kill(self.shards[k])
            except Exception:  # noqa: BLE001 - already gone
                pass
            role = self.runtime.create_shard(k, partial(ParameterShard.from_vectors, root, k, tag))
            try:
                self.runtime.call(role, "stats").result(max(self.timeout_s, 180.0))
            except RoleFailedError as e:
                raise RoleFailedError(f"parameter shard {k} could not be restarted from checkpoint {tag}: {e}") from e
            self.shards[k] = role  # in place: whoever shares this list (the trainer) sees the new shard
            self._restarts_by_shard[k] = self._restarts_by_shard.get(k, 0) + 1
            self.shard_restarts += 1
            handed = [(rid, self.runtime.call(slot.role, "replace_shard", k, role.handle))
                      for rid, slot in self.slots.items()]
            for rid, f in handed:
                try:
                    f.result(self.timeout_s)
                except (RoleFailedError, RemoteTimeoutError) as e:  # it will fail its next call and be replaced
                    self.log(f"replica {rid} could not take the restarted shard {k}: {e}")
            if self.shard_replaced is not None:
                self.shard_replaced(k, role)
        # Let whatever the partial iteration still has in flight finish (its results are discarded): nothing of
        # it may reach a shard after the rollback.
        for rid in list(self.slots):
            slot = self.slots[rid]
            if slot.future is not None:
                try:
                    slot.future.result(self.timeout_s)
                    slot.future = None
                except (RoleFailedError, RemoteTimeoutError) as e:
                    self._replica_failed(rid, e, None)
            slot.claim = []
        for push in self._pushes:
            for f in push.futures:
                try:
                    f.result(self.timeout_s)
                except (RoleFailedError, RemoteTimeoutError):
                    pass
        self._pushes = []
        self.queue = None
        self._rollback()
        self.iterations_redone += 1
        self.shard_recovery_s.append(time.monotonic() - t0)
        self.log(f"shard(s) {dead} restored from iteration checkpoint {tag} in {self.shard_recovery_s[-1]:.2f}s")

    def _step(self) -> StepResult:
        self._checkpointed = False
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
            self.line_search_evals += 1
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

    # ------------------------------------------------------------------ one gradient evaluation
    def _evaluate(self, grad: str) -> float:
        """Mean loss over the batch at the shards' ``params``; its gradient is added into ``grad`` (already zero).

        Returns once every portion's gradient is on the shards, each counted exactly once.
        """
        cfg = self.settings
        self.eval_id += 1
        self._grad_target = grad
        self.queue = q = PortionQueue(cfg.effective_batch, cfg.portion_size, list(self.slots),
                                      backup_tasks=cfg.backup_tasks, force_backups=cfg.force_backups)
        losses: dict[int, float] = {}
        self._pushes = pushes = []
        while not q.all_committed():
            if self.on_poll is not None:
                self.on_poll(self)
            self._start_deferred(q)
            for rid in list(self.slots):
                if self.slots[rid].future is None:
                    self._dispatch(rid, q)
            waiting = [s.future for s in self.slots.values() if s.future is not None]
            waiting += [f for p in pushes for f in p.futures]
            if not waiting:
                if self._deferred:  # nothing runs until a replica's backoff is over
                    time.sleep(min(cfg.poll_s, max(0.0, min(d.at for d in self._deferred.values())
                                                   - time.monotonic())))
                    continue
                if not self.slots:
                    raise DistBeliefError("every replica failed and none could be restarted")
                raise AssertionError("portion queue stalled: portions left but nothing running")
            done = {id(f) for f in self.runtime.wait_any(waiting, cfg.poll_s)}
            if not done and cfg.checkpoint_dir:
                # Nothing finished for a while: a replica may be waiting on a dead shard (its fetch blocks until
                # the shard is replaced), so look.
                dead = self._dead_shards()
                if dead:
                    raise _ShardFailed(dead[0], f"parameter shard {dead[0]} died during a gradient evaluation")
            for rid in list(self.slots):
                slot = self.slots.get(rid)
                if slot is not None and slot.future is not None and id(slot.future) in done:
                    self._on_replica_result(rid, q, losses, pushes)
            for push in [p for p in pushes if all(f.done() for f in p.futures)]:
                pushes.remove(push)
                self._on_push_done(push, q)
            self._check_deadlines(q, pushes)
        self.backups_issued += q.backups_issued
        self.gradient_evals += 1
        self.examples += cfg.effective_batch
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

    def _send(self, slot: _Slot, kind: str, method: str, *args) -> None:
        slot.future = self.runtime.call(slot.role, method, *args)
        slot.kind, slot.call_eval, slot.started_s = kind, self.eval_id, time.monotonic()

    def _on_replica_result(self, rid: int, q: PortionQueue, losses: dict[int, float],
                           pushes: list[_Push]) -> None:
        slot = self.slots[rid]
        fut, kind, call_eval = slot.future, slot.kind, slot.call_eval
        slot.future = None
        if kind == "compute":
            try:
                _, pid, loss, _ = fut.result(self.timeout_s)  # four scalars
            except (RoleFailedError, RemoteTimeoutError) as e:
                self._replica_failed(rid, e, q)
                return
            self.portions_by_replica[rid] = self.portions_by_replica.get(rid, 0) + 1
            if call_eval != self.eval_id:  # a backup still running when the last evaluation finished
                self.portions_duplicated += 1
                return
            if q.result(pid, rid):
                losses[pid] = loss  # every copy has the same loss; the first one is recorded
            else:
                self.portions_duplicated += 1
            return
        # "take": the pushed gradient is ready (in Ray's object store); pass it on without looking at it.
        claim, slot.claim = slot.claim, []
        try:
            ref = fut.as_arg()
        except (RoleFailedError, RemoteTimeoutError) as e:  # the in-process runtime reports a failed take here
            self.portions_requeued += len(q.lost(claim))
            self._replica_failed(rid, e, q)
            return
        futs = [self.runtime.call(s, "accumulate", self._grad_target, ref, 0) for s in self.shards]
        pushes.append(_Push(futs, claim, rid, slot.role, time.monotonic()))

    def _on_push_done(self, push: _Push, q: PortionQueue) -> None:
        errors = []
        for f in push.futures:
            try:
                f.result(self.timeout_s)
            except (RoleFailedError, RemoteTimeoutError) as e:
                errors.append(e)
        if not errors:
            q.committed(push.portion_ids)
            self.portions_done += len(push.portion_ids)
            return
        dead = self._dead_shards()
        if dead:
            raise _ShardFailed(dead[0], f"parameter shard {dead[0]} died while adding a gradient push: {errors[0]}")
        if len(errors) < len(push.futures):
            raise RoleFailedError(f"a parameter shard failed while adding a gradient push ({errors[0]}); the "
                                  f"batch gradient is inconsistent and Sandblaster cannot continue")
        # Every shard refused it: the push never existed (its replica died while producing it).
        self.portions_requeued += len(q.lost(push.portion_ids))
        slot = self.slots.get(push.replica_id)
        if slot is not None and slot.role is push.role:
            self._replica_failed(push.replica_id, errors[0], q)

    def _check_deadlines(self, q: PortionQueue, pushes: list[_Push]) -> None:
        now = time.monotonic()
        for rid in list(self.slots):
            slot = self.slots[rid]
            if slot.future is not None and now - slot.started_s > self.timeout_s:
                self._replica_failed(rid, RemoteTimeoutError(
                    f"replica {rid} did not answer {slot.kind} within {self.timeout_s:.0f}s (remote_timeout_s)"), q)
        for push in pushes:
            if now - push.started_s > self.timeout_s:
                raise RemoteTimeoutError(f"parameter shards did not add a gradient push within "
                                         f"{self.timeout_s:.0f}s (remote_timeout_s)")

    def _replica_failed(self, rid: int, err: Exception, q: PortionQueue | None) -> None:
        """Forget what the replica computed or held, then replace it (or go on without it). ``q`` is None when
        the evaluation was abandoned (a shard failure)."""
        slot = self.slots[rid]
        self.replica_failures += 1
        if q is not None and slot.future is not None and slot.kind == "take" and slot.call_eval == self.eval_id:
            self.portions_requeued += len(q.lost(slot.claim))  # its push never left it
        slot.future = None
        if q is not None:
            self.portions_requeued += len(q.replica_failed(rid))
        self.log(f"replica {rid} failed ({err}); what it held is computed again")
        try:
            self.runtime.kill(slot.role)
        except Exception:  # noqa: BLE001 - it is already gone
            pass
        new_role = self.restart(rid, err) if self.restart is not None else None
        if isinstance(new_role, DeferredRestart):
            del self.slots[rid]
            self._deferred[rid] = new_role
            return
        if new_role is None:
            del self.slots[rid]
            if not self.slots and not self._deferred:
                raise DistBeliefError(f"every replica failed (last: replica {rid}: {err})")
            return
        self.slots[rid] = _Slot(new_role)
        if q is not None:
            q.add_replica(rid)

    def _start_deferred(self, q: PortionQueue | None) -> None:
        """Start the failed replicas whose backoff is over; they take portions from now on."""
        now = time.monotonic()
        for rid, d in list(self._deferred.items()):
            if now >= d.at:
                del self._deferred[rid]
                self.slots[rid] = _Slot(d.start())
                if q is not None:
                    q.add_replica(rid)

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict:
        return {
            "iterations": self.iterations,
            "gradient_evals": self.gradient_evals,
            "line_search_evals": self.line_search_evals,
            "portions_done": self.portions_done,
            "portions_duplicated": self.portions_duplicated,
            "backup_tasks_issued": self.backups_issued,
            "portions_requeued": self.portions_requeued,
            "replica_failures": self.replica_failures,
            "examples": self.examples,
            "loss": self.f,
            "history_pairs": len(self.pairs),
            "shard_restarts": self.shard_restarts,
            "iterations_redone": self.iterations_redone,
        }
