"""The Sandblaster driver: starts shards and replicas, runs the Coordinator, evaluates, stops, reports.

Same run directory as the Downpour trainer; the summary is a ``RunSummary`` with Sandblaster's own counters
(``iterations``, ``portions_done``, ``portions_duplicated``, ``line_search_evals``, ...) and no staleness or
rejected pushes (every gradient is computed at the parameters it is applied to, and no push is refused). A
failed replica is restarted after its backoff, or dropped, by the shared ``Supervisor``.

Durability: after every iteration the shards checkpoint all their vectors and the trainer writes the
coordinator's and its own scalars next to them (``sandblaster.state``). Ctrl-C / SIGTERM drops the iteration in
progress, rolls back to that checkpoint and stops with it on disk; ``resume=True`` continues from the newest
consistent pair, with any number of shards, taking the same steps as an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from distbelief import stopping
from distbelief.buffers import average, buffers_of, load_buffers
from distbelief.evaluation import evaluate_job
from distbelief.exceptions import ConfigError, RemoteTimeoutError, RoleFailedError
from distbelief.job import Job, materialize
from distbelief.metrics import Clock, EvalSchedule, RunRecorder
from distbelief.ps.shard import ParameterShard
from distbelief.ps.sharding import ShardLayout, flatten, unflatten_into
from distbelief.runtime.base import Role, Runtime, ShardClient
from distbelief.sandblaster.coordinator import Coordinator, CoordinatorSettings, DeferredRestart
from distbelief.sandblaster.lbfgs import LBFGSSettings
from distbelief.sandblaster.replica import SandblasterReplicaRecipe, SandblasterReplicaSettings
from distbelief.sandblaster.state import ResumePoint, find_resume_point, resliced_shard, tidy, write_state
from distbelief.stopping import StopRule
from distbelief.summary import RunSummary
from distbelief.supervisor import Decision, RestartPolicy, Supervisor


def start_vector_shards(runtime: Runtime, init: torch.Tensor, num_shards: int) -> tuple[ShardLayout, list[Role]]:
    """Place ``num_shards`` shards holding the balanced slices of ``init``; no server optimizer (L-BFGS updates
    the parameters through vector ops, never through pushes)."""
    total = init.numel()
    layout = ShardLayout.balanced(total, num_shards)
    shards = []
    for k in range(num_shards):
        lo, hi = layout.range(k)
        shards.append(runtime.create_shard(k, partial(ParameterShard, k, lo, hi, init[lo:hi].numpy(), None, total)))
    return layout, shards


def start_resumed_shards(runtime: Runtime, point: ResumePoint, ckpt_root: str, total: int,
                         num_shards: int) -> tuple[ShardLayout, list[Role]]:
    """Place ``num_shards`` shards holding every named vector of ``point``'s iteration checkpoint, resliced from
    however many shards wrote it; each shard reads its part of the files where it lives."""
    layout = ShardLayout.balanced(total, num_shards)
    old = [tuple(r) for r in point.state["shards"]]
    shards = [runtime.create_shard(k, partial(resliced_shard, ckpt_root, point.tag, old, k, *layout.range(k), total))
              for k in range(num_shards)]
    return layout, shards


def _last_recorded_wall(run_dir: str) -> float:
    """The training clock of the last metrics record (0 without one; a torn last line is skipped)."""
    p = Path(run_dir) / "metrics.jsonl"
    walls = []
    for line in p.read_text().splitlines() if p.is_file() else []:
        try:
            walls.append(float(json.loads(line)["wall_s"]))
        except (ValueError, KeyError, TypeError):
            continue
    return max(walls, default=0.0)


def read_params(client: ShardClient, total: int, timeout_s: float) -> torch.Tensor:
    """The shards' ``params`` as one flat vector (for evaluation in the driver; never used by the coordinator)."""
    parts, _ = client.fetch_async().result(timeout_s)
    flat = torch.empty(total, dtype=torch.float32)
    out = flat.numpy()
    for lo, values in parts:
        out[lo : lo + len(values)] = values  # numpy copy: the values may be a read-only view of Ray's store
    return flat


class SandblasterTrainer:
    """Runs ``strategy = "sandblaster"`` over a Runtime. One instance per run."""

    def __init__(self, job: Job, runtime: Runtime, recorder: RunRecorder, resume: bool = False):
        self.job, self.runtime, self.rec = job, runtime, recorder
        cfg = self.cfg = job.cfg
        self.timeout_s = cfg.remote_timeout_s
        self.final_buffers: dict | None = None  # the replicas' module buffers, averaged at each evaluation
        torch.manual_seed(cfg.seed)
        self.eval_model = job.model_fn()
        init = flatten(self.eval_model)
        self.total = init.numel()
        self.num_examples = len(materialize(job.train_data))
        self.checkpoint_dir = self._checkpoint_dir()
        # A run that is resumed continues from its newest consistent (state, vector checkpoints) pair; every
        # problem with it is a ConfigError here, before any role starts.
        self.resume_point = self._find_resume_point() if resume else None
        prev = self.resume_point.state["trainer"] if self.resume_point else {}
        if self.resume_point:
            self.layout, self.shards = start_resumed_shards(runtime, self.resume_point, self.checkpoint_dir,
                                                            self.total, cfg.shards)
        else:
            self.layout, self.shards = start_vector_shards(runtime, init, cfg.shards)
        self.client = runtime.shard_client(self.shards, self.layout)
        self.coord: Coordinator | None = None
        self.clock: Clock | None = None
        # time to target counts only for the target it was measured against
        same_target = prev.get("target_accuracy") == cfg.target_accuracy
        self.stop = StopRule(cfg.max_steps, cfg.max_seconds, lambda: self.clock.elapsed() if self.clock else 0.0,
                             target=cfg.target_accuracy, best=prev.get("best_acc", -1.0),
                             time_to_target=prev.get("time_to_target") if same_target else None)
        # Replica restarts and drops. Each run has the policy's full budget per replica (a resumed run starts
        # every replica afresh); the totals reported count on from the run that was resumed.
        self.supervisor = Supervisor(RestartPolicy(max_restarts=cfg.max_replica_restarts),
                                     earlier=(prev.get("replica_restarts", 0), prev.get("replicas_lost", 0)))
        self.hooks = job.hooks.start(self, resumed=resume)  # distbelief/hooks.py: tooling's way in

    def _checkpoint_dir(self) -> str:
        """Where shards save their vectors every iteration (on whenever Downpour's shard durability is: any
        ``durability`` but "off")."""
        cfg = self.cfg
        if cfg.durability == "off":
            return ""
        if cfg.out:
            root = Path(cfg.out) / "checkpoints"
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="distbelief-ckpt-")
            root = Path(self._tmp.name)
        return str(root.resolve())

    def _find_resume_point(self) -> ResumePoint:
        cfg = self.cfg
        if not self.checkpoint_dir:
            raise ConfigError("resume", "sandblaster writes iteration checkpoints only with shard durability on; "
                                        "this run has --durability off (use snapshot or log)")
        point = find_resume_point(self.checkpoint_dir, self.total)
        st = point.state
        if st["history"] != cfg.history:
            raise ConfigError("history", f"{point.path}: the run keeps {st['history']} L-BFGS pairs on its shards; "
                                         f"resume with history = {st['history']}")
        for msg in point.skipped:
            self.rec.log(f"resume: skipped a damaged or incomplete iteration checkpoint: {msg}")
        if point.skipped:
            self.rec.log(f"resume: using the previous consistent one ({point.path.name})")
        batch = min(cfg.lbfgs_batch, self.num_examples)
        if (st["batch_size"], st["num_examples"], st["seed"]) != (batch, self.num_examples, cfg.seed):
            self.rec.log(f"resume: the run used batches of {st['batch_size']} of {st['num_examples']} examples "
                         f"(seed {st['seed']}), this one {batch} of {self.num_examples} (seed {cfg.seed}): it "
                         f"continues, but no longer as the uninterrupted run would")
        old_k = len(st["shards"])
        self.rec.log(f"resuming from {cfg.out}: iteration {st['coordinator']['iterations']} (iteration checkpoint "
                     f"{point.tag}, {old_k} shards" + (f", resharded to {cfg.shards}" if old_k != cfg.shards else "")
                     + f"); training time so far {st['trainer']['wall_s']:.1f}s")
        return point

    def _persist(self, tag: int, coord_state: dict) -> None:
        """Every shard wrote iteration checkpoint ``tag``: write its state file now (before anything else)."""
        self._write_state()

    def _write_state(self) -> None:
        """Write the last iteration checkpoint's state file (the coordinator's scalars at that checkpoint, the
        trainer's numbers now). Only in a run directory: that is where a resume looks."""
        last = self.coord.last_checkpoint if self.coord is not None else None
        if not (self.cfg.out and last):
            return
        tag, coord_state = last
        cfg = self.cfg
        write_state(self.checkpoint_dir, tag, {
            "tag": tag, "total": self.total, "shards": [list(self.layout.range(k)) for k in range(cfg.shards)],
            "history": cfg.history, "batch_size": min(cfg.lbfgs_batch, self.num_examples),
            "num_examples": self.num_examples, "seed": cfg.seed, "coordinator": coord_state,
            "trainer": {"wall_s": self.clock.elapsed(), "best_acc": self.stop.best,
                        "time_to_target": self.stop.time_to_target, "target_accuracy": cfg.target_accuracy,
                        "replica_restarts": self.supervisor.replica_restarts,
                        "replicas_lost": self.supervisor.replicas_lost},
        })

    def _shard_replaced(self, k: int, role: Role) -> None:
        self.client.replace_shard(k, role.handle)  # self.shards is the coordinator's list, already updated
        self.rec.log(f"parameter shard {k} restarted from its iteration checkpoint; the iteration is redone")

    # ---------------------------------------------------------------- roles
    def _start_replicas(self, rids: list[int]) -> dict[int, Role]:
        """Place replicas ``rids``, all at once (process start-up dominates), then wait until each is built."""
        cfg, j = self.cfg, self.job
        roles = {}
        for rid in rids:
            settings = SandblasterReplicaSettings(seed=cfg.seed, remote_timeout_s=cfg.remote_timeout_s,
                                                  portion_hook=self.hooks.replica_hook(rid))
            recipe = SandblasterReplicaRecipe(rid, j.model_fn, j.train_data, settings, j.loss_fn)
            roles[rid] = self.runtime.create_replica(rid, recipe, self.shards, self.layout, j.threads)
        # A replica that cannot even be built (bad model, bad data) fails here, with its own error.
        ready = {rid: self.runtime.call(role, "stats") for rid, role in roles.items()}
        for f in ready.values():
            f.result(max(self.timeout_s, 180.0))
        return roles

    def _restart(self, rid: int, err: Exception) -> DeferredRestart | None:
        """The coordinator lost replica ``rid``: the supervisor restarts it after its backoff (the others go on
        meanwhile; the coordinator starts it when it is due) or drops it."""
        decision = self.supervisor.failed(rid)
        self.rec.log(f"replica {rid} failed ({err}); decision: {decision.value}")
        if decision is Decision.DROP:
            return None

        def start() -> Role:
            role = self._start_replicas([rid])[rid]
            n = self.supervisor.restarted(rid)
            self.rec.log(f"replica {rid} restarted ({n}/{self.supervisor.policy.max_restarts}); it takes portions "
                         f"again")
            return role

        return DeferredRestart(self.supervisor.restart_at(rid), start)

    def _call_hooks(self, coord: Coordinator) -> None:
        """On every turn of the portion loop: the hooks' ``on_step`` once the coordinator has finished the
        L-BFGS iteration they wait for (a kill then lands in the middle of the next one, while its portions are
        out; distbelief/hooks.py)."""
        due = self.hooks.next_step()
        if due is not None and coord.iterations >= due:
            self.hooks.on_step(self, coord.iterations)

    def kill_shard(self, k: int, iterations: int | None = None) -> None:
        """Kill parameter shard ``k``'s process, as losing its machine would (the iteration is redone from the
        shards' iteration checkpoints)."""
        self.rec.log(f"killing parameter shard {k} at iteration {self._iterations(iterations)}")
        self.runtime.kill(self.shards[k])

    def kill_replica(self, rid: int, partition_id: int = -1, iterations: int | None = None) -> bool:
        """Kill replica ``rid``'s process, as losing its machine would (its portions are recomputed elsewhere).
        False when it holds no slot now (nothing killed)."""
        slot = self.coord.slots.get(rid) if self.coord is not None else None
        if slot is None:
            return False
        self.rec.log(f"killing replica {rid} at iteration {self._iterations(iterations)}")
        self.runtime.kill(slot.role)
        return True

    def _iterations(self, given: int | None) -> int:
        return given if given is not None else (self.coord.iterations if self.coord is not None else 0)

    # ---------------------------------------------------------------- evaluation
    def server_params(self) -> torch.Tensor:
        return read_params(self.client, self.total, self.timeout_s)

    def _gather_buffers(self) -> None:
        """The replicas' module buffers (BatchNorm statistics), averaged into the evaluation model (buffers.py);
        evaluations happen between L-BFGS iterations, so the replicas are idle."""
        if not buffers_of(self.eval_model) or self.coord is None:
            return
        futs = [self.runtime.call(slot.role, "module_buffers") for slot in self.coord.slots.values()]
        got = []
        for f in futs:
            try:
                got.append({k: torch.as_tensor(v) for k, v in f.result(self.timeout_s).items()})
            except (RoleFailedError, RemoteTimeoutError):
                continue  # a replica that died: it is replaced; the others' buffers serve
        if got:
            self.final_buffers = average(got)
            load_buffers(self.eval_model, self.final_buffers)

    def evaluate_now(self) -> dict:
        wall = self.clock.elapsed()
        unflatten_into(self.eval_model, self.server_params())
        self._gather_buffers()
        acc, test_loss, train_acc = evaluate_job(self.eval_model, self.job)
        c = self.coord.stats()
        examples = c["examples"]
        rec = {
            "wall_s": round(wall, 3),
            "updates": c["iterations"] * self.cfg.shards,
            "updates_per_shard": [c["iterations"]] * self.cfg.shards,
            "examples": examples,
            "examples_per_s": examples / wall if wall > 0 else 0.0,
            "train_loss": c["loss"] if math.isfinite(c["loss"]) else None,
            "test_accuracy": acc,
            "train_accuracy": train_acc,
            "test_loss": test_loss,
            # no staleness (every gradient is computed at the parameters it is applied to), no rejected pushes
            "replicas_alive": len(self.coord.slots),
            "iterations": c["iterations"],
            "line_search_evals": c["line_search_evals"],
            "portions_done": c["portions_done"],
            "portions_duplicated": c["portions_duplicated"],
        }
        self.rec.record(rec)
        self.stop.evaluated(acc, wall)
        self.hooks.on_evaluation(self, rec)
        return rec

    # ---------------------------------------------------------------- the run
    def _coordinator_settings(self) -> CoordinatorSettings:
        cfg = self.cfg
        return CoordinatorSettings(
            num_examples=self.num_examples, batch_size=cfg.lbfgs_batch, portion_size=cfg.portion_size,
            push_every_portions=cfg.push_every_portions, backup_tasks=cfg.backup_tasks,
            lbfgs=LBFGSSettings(history=cfg.history), seed=cfg.seed, remote_timeout_s=cfg.remote_timeout_s,
            checkpoint_dir=self.checkpoint_dir, max_shard_restarts=cfg.max_shard_restarts)

    def run(self) -> RunSummary:
        cfg = self.cfg
        for s in self.shards:
            self.runtime.call(s, "stats").result(max(self.timeout_s, 180.0))
        batch = min(cfg.lbfgs_batch, self.num_examples)
        self.rec.log(f"sandblaster L-BFGS: {cfg.replicas} replicas x {cfg.shards} shards on the "
                     f"{self.runtime.name} runtime ({self.total:,} parameters); batch {batch} in portions of "
                     f"{cfg.portion_size}, history {cfg.history}, backup tasks {'on' if cfg.backup_tasks else 'off'}")
        replicas: dict[int, Role] = {}
        try:
            try:
                replicas = self._start_replicas(list(range(cfg.replicas)))
                self.coord = Coordinator(self.runtime, self.shards, replicas, self._coordinator_settings(),
                                         restart=self._restart, log=self.rec.log, on_poll=self._call_hooks,
                                         shard_replaced=self._shard_replaced,
                                         persist=self._persist)
                prev_wall = 0.0
                if self.resume_point is not None:
                    self.coord.restore_state(self.resume_point.state["coordinator"], self.resume_point.next_tag)
                    # The clock goes on from where the run stood; never behind a metrics record already written
                    # (after a fallback to an older checkpoint, the time since was spent all the same).
                    prev_wall = max(self.resume_point.state["trainer"]["wall_s"], _last_recorded_wall(cfg.out))
                self.clock = Clock(offset_s=prev_wall)
                # The first consistent pair (after a resume: in the new shard layout, so the old files can go).
                self.coord.checkpoint()
                if self.resume_point is not None:
                    tidy(self.checkpoint_dir)
                self._iterate(self.coord)
            except KeyboardInterrupt:
                # Ctrl-C / SIGTERM: drop the iteration in progress, so that the shards hold exactly the last
                # iteration checkpoint, then fall through to the final evaluation and state file.
                if self.coord is None or self.clock is None:
                    raise
                self.stop.end(stopping.INTERRUPTED)
                self.rec.log("interrupted: dropping the iteration in progress and writing a final checkpoint "
                             f"(resume with: distbelief train --resume {cfg.out or 'RUN_DIR'})")
                if self.coord.abandon_iteration():
                    self.rec.log(f"the run stands at iteration {self.coord.iterations}, its last checkpoint")
            coord = self.coord
            wall = self.clock.elapsed()
            final = self.evaluate_now()
            flat = self.server_params()
            steps = self._replica_portions()
            self._write_state()  # the final numbers (best accuracy, clock) with the last checkpoint
            if self.resume_point is not None and self.stop_reason != stopping.INTERRUPTED:
                tidy(self.checkpoint_dir)  # no write in flight now; a reshard to fewer shards left old files
        finally:
            roles = [s.role for s in self.coord.slots.values()] if self.coord else list(replicas.values())
            for role in roles:
                try:
                    self.runtime.release(role)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        c = coord.stats()
        batch = min(cfg.lbfgs_batch, self.num_examples)
        summary = RunSummary(
            strategy="sandblaster", runtime=self.runtime.name, replicas=cfg.replicas, num_parameters=self.total,
            **self.stop.outcome_fields(final["test_accuracy"], final["examples"], wall),
            updates=final["updates"], steps_per_replica=steps,
            shards=cfg.shards, optimizer="lbfgs", updates_per_shard=final["updates_per_shard"],
            replica_restarts=self.supervisor.replica_restarts, replicas_lost=self.supervisor.replicas_lost,
            replica_recovery_s=list(self.supervisor.recovery_s),  # this run's (not carried over a resume)
            shard_restarts=c["shard_restarts"],
            # A restarted shard and its peers roll back to the last iteration checkpoint and the iteration is
            # redone: no accepted L-BFGS step is lost.
            updates_lost=0,
            shard_recovery_s=list(coord.counters.shard_recovery_s),
            iterations=c["iterations"], iterations_redone=c["iterations_redone"],
            gradient_evals=c["gradient_evals"], line_search_evals=c["line_search_evals"],
            portions_done=c["portions_done"], portions_duplicated=c["portions_duplicated"],
            backup_tasks_issued=c["backup_tasks_issued"], portions_requeued=c["portions_requeued"],
            final_train_loss=c["loss"], lbfgs_batch=batch, portion_size=cfg.portion_size, history=cfg.history,
            mean_iteration_s=wall / c["iterations"] if c["iterations"] else None,
        )
        self.final_flat = flat  # final_buffers: the replicas' average at the final evaluation
        return summary

    @property
    def stop_reason(self) -> str:
        return self.stop.reason

    def request_stop(self, reason: str) -> None:
        """End the run before its next iteration, with ``reason`` as its stop reason (as Downpour's driver)."""
        self.stop.request(reason)

    def _iterate(self, coord: Coordinator) -> None:
        """L-BFGS iterations until a stop condition; each finished iteration is checkpointed before anything else.

        The stop conditions are checked before each step, so a resumed run that already met one takes no step."""
        cfg = self.cfg
        next_eval = self.clock.elapsed() + cfg.eval_every_seconds
        schedule = EvalSchedule(cfg.eval_every_seconds, self.rec.log)
        while True:
            # (iterations count across resumes)
            if self.stop.check(steps=coord.iterations):
                return
            result = coord.step()
            coord.checkpoint()
            if result.stopped:  # L-BFGS's own end (converged, or no descent direction left)
                self.stop.end(result.stopped)
                return
            if self.clock.elapsed() >= next_eval:
                t0 = time.monotonic()
                self.clock.pause()  # L-BFGS waits while we evaluate: don't count it as training time
                self.evaluate_now()
                self._write_state()  # the best accuracy so far, with the checkpoint just written
                self.clock.resume()
                next_eval = self.clock.elapsed() + schedule.interval(time.monotonic() - t0)

    def _replica_portions(self) -> list[int]:
        """Portions each replica id computed (duplicates included; restarts add up)."""
        return [self.coord.counters.portions_by_replica.get(rid, 0) for rid in range(self.cfg.replicas)]
