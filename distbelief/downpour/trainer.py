"""The Downpour driver (and the synchronous data-parallel baseline on the same shards and replicas).

The trainer starts the roles through a Runtime, runs warmstart, evaluates the *server's* parameters on a
wall-clock cadence, enforces the stop conditions, and restarts failed replicas (bounded, by RestartPolicy).
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from distbelief.data.batches import BatchSource, replica_indices
from distbelief.downpour.replica import ModelReplica, ReplicaSettings
from distbelief.evaluation import evaluate_job
from distbelief.exceptions import ConfigError, DistBeliefError, RemoteTimeoutError, RoleFailedError
from distbelief.job import Job, materialize
from distbelief.metrics import Clock, EvalSchedule, RunRecorder
from distbelief.policies import Decision, RestartPolicy
from distbelief.ps.optimizers import make_server_optimizer
from distbelief.ps.shard import Durability, ParameterShard
from distbelief.ps.sharding import ShardLayout, flatten, unflatten_into
from distbelief.resume import (drop_retired, load_server_state, read_trainer_state, retire_checkpoints,
                               write_trainer_state)
from distbelief.runtime.base import Future, Role, Runtime


@dataclass
class ReplicaRecipe:
    """Builds a ModelReplica where it will live (picklable: it travels to the replica's process)."""

    replica_id: int
    num_replicas: int
    model_fn: Callable[[], torch.nn.Module]
    train_data: Any
    batch_size: int
    seed: int
    settings: ReplicaSettings
    loss_fn: Callable

    def __call__(self, client) -> ModelReplica:
        ds = materialize(self.train_data)
        torch.manual_seed(self.seed + 1009 * (self.replica_id + 1))
        model = self.model_fn()
        idx = replica_indices(len(ds), self.num_replicas, self.replica_id, self.seed)
        batches = BatchSource(ds, idx, self.batch_size, seed=self.seed * 7919 + self.replica_id)
        return ModelReplica(self.replica_id, model, batches, client, self.settings, self.loss_fn)


@dataclass
class _ReplicaState:
    role: Role
    future: Future | None = None
    restarts: int = 0
    steps: int = 0  # steps done by earlier incarnations plus the last polled count of this one
    base_steps: int = 0
    phase_base: int = 0  # steps done before the current phase (warmstart, then everyone)
    phase_limit: int | None = None  # steps this replica runs in the current phase
    alive: bool = True
    finished: bool = False
    last_stats: dict = field(default_factory=dict)
    # A failed replica waiting out its restart backoff (time.monotonic() when it may start again): its old role is
    # dead, and the driver goes on evaluating and supervising meanwhile instead of sleeping.
    restart_at: float | None = None
    failed_at: float = 0.0

    @property
    def running(self) -> bool:
        """Alive with a live role to call (not waiting to be restarted)."""
        return self.alive and self.restart_at is None


class ParameterServerTrainer:
    """Runs ``downpour`` or ``sync`` over a Runtime. One instance per run."""

    def __init__(self, job: Job, runtime: Runtime, recorder: RunRecorder, resume: bool = False,
                 callbacks: list | None = None):
        self.job, self.runtime, self.rec = job, runtime, recorder
        self.callbacks = list(callbacks or [])  # callback(trainer, metrics_record) after each evaluation
        cfg = job.cfg
        self.cfg = cfg
        self.policy = RestartPolicy(max_restarts=cfg.max_replica_restarts)
        self.timeout_s = cfg.remote_timeout_s
        torch.manual_seed(cfg.seed)
        self.eval_model = job.model_fn()
        init = flatten(self.eval_model)
        self.total = init.numel()
        self.layout = ShardLayout.balanced(self.total, cfg.shards)
        self.optimizer = make_server_optimizer(cfg.server_optimizer, cfg.lr, cfg.adagrad_eps,
                                               cfg.adagrad_initial_accumulator)
        self.init_flat = init
        self.durability = self._durability()
        self.prev: dict = {}  # the trainer state of the run we resume, if any
        self._retired = None
        server_state = None
        if resume:
            if self.durability is None:
                raise ConfigError("resume", "the run keeps no checkpoints with --durability off; resume with "
                                            "--durability snapshot or log")
            server_state = load_server_state(self.durability.root, self.total, self.optimizer)
            for msg in server_state.corrupt_checkpoints:
                self.rec.log(f"resume: skipped a damaged checkpoint, using the previous good one: {msg}")
            self.prev = read_trainer_state(cfg.out)
            self._retired = retire_checkpoints(self.durability.root)
            old_k = len(server_state.versions)
            self.rec.log(f"resuming from {cfg.out}: {old_k} shard checkpoint(s) at versions "
                         f"{[v for _, _, v in server_state.versions]}" +
                         (f", resharded to {cfg.shards} shards" if old_k != cfg.shards else "") +
                         f"; training time so far {self.prev.get('wall_s', 0.0):.1f}s")
        self.shards: list[Role] = []
        for k in range(cfg.shards):
            lo, hi = self.layout.range(k)
            if server_state is not None:
                values, opt_state, counters = server_state.slice_for(lo, hi)
                factory = partial(ParameterShard, k, lo, hi, values.numpy(), self.optimizer, self.total,
                                  self.durability, {n: v.numpy() for n, v in opt_state.items()}, counters)
            else:
                factory = partial(ParameterShard, k, lo, hi, init[lo:hi].numpy(), self.optimizer, self.total,
                                  self.durability)
            self.shards.append(runtime.create_shard(k, factory))
        self.client = runtime.shard_client(self.shards, self.layout)
        self.shard_recovery_s: list[float] = []
        self.replica_recovery_s: list[float] = []
        self.events: list[dict] = []  # failures and recoveries, with training-clock times
        self._warmstart_done = False
        self._shard_restarts_by_id = [0] * cfg.shards
        self.settings = ReplicaSettings(
            fetch_every=cfg.fetch_every, push_every=cfg.push_every, local_lr=cfg.local_lr,
            overlap=cfg.overlap, remote_timeout_s=cfg.remote_timeout_s,
        )
        self.replicas: dict[int, _ReplicaState] = {}
        self.eval_mode = "paused"  # set once the replicas are placed (_choose_evaluation)
        self._last_eval_s = 0.0
        self.eval_schedule = EvalSchedule(cfg.eval_every_seconds, self.rec.log)
        self.clock: Clock | None = None
        p = self.prev
        self.best_acc = p.get("best_acc", -1.0)
        self.time_to_target: float | None = p.get("time_to_target")
        self.stop_reason = ""
        self.examples_sync = p.get("examples_sync", 0)
        self.replica_restarts = p.get("replica_restarts", 0)
        self.replicas_lost = p.get("replicas_lost", 0)
        self.shard_restarts = p.get("shard_restarts", 0)
        self.updates_lost = p.get("updates_lost", 0)
        self._killed_once = bool(p)  # fault injection fires once per run, not again after a resume
        self._shard_killed_once = bool(p)

    # ---------------------------------------------------------------- durability and shard failures
    def _durability(self) -> Durability | None:
        cfg = self.cfg
        if cfg.durability == "off":
            return None
        if cfg.out:
            root = Path(cfg.out) / "checkpoints"
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="distbelief-ckpt-")
            root = Path(self._tmp.name)
        return Durability(str(root.resolve()), every_updates=cfg.checkpoint_every_updates,
                          every_seconds=cfg.checkpoint_every_seconds, wal=cfg.durability == "log",
                          log_max_bytes=int(cfg.log_max_mb * 2**20))

    def _check_shards(self) -> None:
        """Restart any shard whose process died (from its checkpoint + log), while the replicas keep going."""
        futs = [(k, self.runtime.call(s, "stats")) for k, s in enumerate(self.shards)]
        for k, f in futs:
            try:
                f.result(self.timeout_s)
            except RoleFailedError as e:
                self._restart_shard(k, e)

    def _restart_shard(self, k: int, err: Exception) -> None:
        if self.durability is None:
            raise RoleFailedError(f"parameter shard {k} died ({err}) and --durability is off: its parameters are "
                                  f"lost (use --durability snapshot or log to survive this)") from err
        if self._shard_restarts_by_id[k] >= self.cfg.max_shard_restarts:
            raise RoleFailedError(f"parameter shard {k} died again after {self.cfg.max_shard_restarts} restarts "
                                  f"(max_shard_restarts)") from err
        t0 = time.monotonic()
        self.rec.log(f"parameter shard {k} died ({err}); restarting it from its checkpoint")
        try:
            self.runtime.kill(self.shards[k])
        except Exception:  # noqa: BLE001 - already gone
            pass
        lo, hi = self.layout.range(k)
        role = self.runtime.create_shard(k, partial(
            ParameterShard.restore, k, lo, hi, self.optimizer, self.total, self.durability,
            self.init_flat[lo:hi].numpy()))
        st = self.runtime.call(role, "stats").result(max(self.timeout_s, 180.0))
        # The highest version of the dead shard any replica saw acknowledged: from their last statistics, and
        # from what each reports as it switches to the new shard (replicas with co-located updates were not
        # blocked on the dead shard's process and may have applied more to its memory until then).
        self._poll_replicas()
        acked = max([r.last_stats.get("acked", [0] * (k + 1))[k] for r in self.replicas.values()
                     if r.last_stats] + [0])
        self.shards[k] = role
        self.client.replace_shard(k, role.handle)
        handed = [(rid, self.runtime.call(r.role, "replace_shard", k, role.handle))
                  for rid, r in self.replicas.items() if r.running]
        for rid, f in handed:
            try:
                acked = max(acked, f.result(self.timeout_s) or 0)
            except (RoleFailedError, RemoteTimeoutError) as e:  # its run() will fail too and be restarted
                self.rec.log(f"replica {rid} could not take the restarted shard {k}: {e}")
        lost = max(0, acked - st["updates"])
        self._shard_restarts_by_id[k] += 1
        self.shard_restarts += 1
        self.updates_lost += lost
        self.shard_recovery_s.append(time.monotonic() - t0)
        self.events.append({"event": "shard restored", "id": k, "wall_s": self.clock.elapsed(),
                            "updates_lost": lost, "replayed_updates": st["replayed_updates"]})
        skipped = st.get("corrupt_checkpoints") or []
        for msg in skipped:
            self.rec.log(f"parameter shard {k}: skipped a damaged checkpoint: {msg}")
        self.rec.log(f"parameter shard {k} restored at version {st['updates']} (checkpoint "
                     f"{st['restored_from_version']} + {st['replayed_updates']} logged updates) in "
                     f"{self.shard_recovery_s[-1]:.2f}s; updates lost: {lost}")

    def checkpoint_shards(self) -> None:
        """Ask every shard to write a checkpoint now (end of run, Ctrl-C)."""
        if self.durability is None:
            return
        futs = [self.runtime.call(s, "checkpoint") for s in self.shards]
        for f in futs:
            f.result(self.timeout_s)

    # ---------------------------------------------------------------- roles
    def _recipe(self, rid: int) -> ReplicaRecipe:
        j = self.job
        return ReplicaRecipe(rid, self.cfg.replicas, j.model_fn, j.train_data, self.cfg.batch_size, self.cfg.seed,
                             self.settings, j.loss_fn)

    def _start_replica(self, rid: int) -> Role:
        if self.cfg.partitions > 1:  # model parallelism: the replica is a group of partitions (distbelief.partition)
            from distbelief.partition.replica import PartitionRecipe
            j = self.job
            recipe = PartitionRecipe(rid, self.cfg.replicas, j.model_fn, j.train_data, self.cfg.batch_size,
                                     self.cfg.seed, self.settings, j.loss_fn)
            role = self.runtime.create_partition_group(rid, recipe, self.shards, self.layout, self.job.threads,
                                          self.cfg.partitions)
        else:
            role = self.runtime.create_replica(rid, self._recipe(rid), self.shards, self.layout, self.job.threads)
        # A replica that cannot even be built (bad model, bad data) fails here, with its own error.
        self.runtime.call(role, "stats").result(max(self.timeout_s, 180.0))
        return role

    def _wait_shards_ready(self) -> None:
        for s in self.shards:
            self.runtime.call(s, "stats").result(max(self.timeout_s, 180.0))
        # A base checkpoint per shard: its range and state are on disk before any push (resume needs them).
        self.checkpoint_shards()
        drop_retired(self._retired)
        self._retired = None

    def _new_replica_state(self, rid: int) -> _ReplicaState:
        prev_steps = self.prev.get("steps_per_replica", [])
        steps = prev_steps[rid] if rid < len(prev_steps) else 0
        return _ReplicaState(role=self._start_replica(rid), steps=steps, base_steps=steps)

    def _save_state(self) -> None:
        if not self.cfg.out:
            return
        write_trainer_state(self.cfg.out, {
            "wall_s": self.clock.elapsed(), "best_acc": self.best_acc, "time_to_target": self.time_to_target,
            "examples_sync": self.examples_sync, "replica_restarts": self.replica_restarts,
            "replicas_lost": self.replicas_lost, "shard_restarts": self.shard_restarts,
            "updates_lost": self.updates_lost, "steps_per_replica": [st.steps for st in self.replicas.values()],
            "warmstart_done": True if self.prev.get("warmstart_done") else self._warmstart_done,
        })

    # ---------------------------------------------------------------- evaluation and metrics
    def server_params(self) -> torch.Tensor:
        parts, _ = self.client.fetch_async().result(self.timeout_s)
        flat = torch.empty(self.total, dtype=torch.float32)
        out = flat.numpy()
        for lo, values in parts:
            out[lo : lo + len(values)] = values  # numpy copy: the values may be a read-only view of Ray's store
        return flat

    def shard_stats(self) -> list[dict]:
        futs = [self.runtime.call(s, "stats") for s in self.shards]
        return [f.result(self.timeout_s) for f in futs]

    def _poll_replicas(self) -> None:
        futs = {rid: self.runtime.call(st.role, "stats") for rid, st in self.replicas.items() if st.running}
        for rid, f in futs.items():
            try:
                s = f.result(min(10.0, self.timeout_s))
            except (RoleFailedError, RemoteTimeoutError):
                continue
            st = self.replicas[rid]
            st.last_stats = s
            st.steps = st.base_steps + s["steps"]

    def _read_server(self, fn):
        """Run a driver-side read of the shards; if a shard turns out dead, restart it and read again."""
        for attempt in range(self.cfg.max_shard_restarts + 1):
            try:
                return fn()
            except RoleFailedError:
                if attempt == self.cfg.max_shard_restarts:
                    raise
                self._check_shards()

    def _pause_replicas(self) -> list[int]:
        """Hold every running replica at its next step boundary (its pushes applied); returns those held."""
        futs = [(rid, self.runtime.call(st.role, "pause", self.timeout_s)) for rid, st in self.replicas.items()
                if st.running and st.future is not None and not st.finished]
        held = []
        for rid, f in futs:
            try:
                if f.result(self.timeout_s + 5.0):
                    held.append(rid)
                else:
                    self.rec.log(f"replica {rid} did not pause within {self.timeout_s:.0f}s (remote_timeout_s); "
                                 f"evaluating while it trains")
            except (RoleFailedError, RemoteTimeoutError):
                pass  # it died: the supervisor restarts it
        return held

    def _resume_replicas(self) -> None:
        for st in self.replicas.values():
            if st.running:
                self.runtime.call(st.role, "resume")  # fire and forget: a dead one is found by the supervisor

    def _choose_evaluation(self) -> None:
        """Concurrent evaluation only where the driver has a core the replicas leave free (see config)."""
        mode = self.cfg.evaluation
        if mode == "auto":
            roles = [st.role for st in self.replicas.values()]
            spare = self.runtime.driver_spare_cpus(roles, self.job.threads)
            mode = "concurrent" if spare >= 1 else "paused"
            self.rec.log(f"evaluation: {mode} ({spare:g} core(s) of the driver's machine left free by the "
                         f"replicas)")
        self.eval_mode = mode

    def evaluate_paused(self) -> dict:
        """Evaluate with the replicas held and the training clock stopped: evaluation never competes with
        training for the cores, and the time axis is training time (as for every other strategy). With a core
        of its own (``eval_mode`` concurrent) the driver evaluates while the replicas train."""
        t0 = time.monotonic()
        try:
            if self.eval_mode == "concurrent":
                return self.evaluate_now()
            self._pause_replicas()
            self.clock.pause()
            # The replicas are held: this machine's cores are the driver's until it resumes them.
            threads = torch.get_num_threads()
            torch.set_num_threads(max(1, os.cpu_count() or 1))
            try:
                return self.evaluate_now()
            finally:
                torch.set_num_threads(threads)
                self.clock.resume()
                self._resume_replicas()
        finally:
            self._last_eval_s = time.monotonic() - t0

    def _eval_interval(self) -> float:
        return self.eval_schedule.interval(self._last_eval_s)

    def evaluate_now(self) -> dict:
        wall = self.clock.elapsed()
        flat = self._read_server(self.server_params)
        unflatten_into(self.eval_model, flat)
        acc, test_loss, train_acc = evaluate_job(self.eval_model, self.job)
        stats = self._read_server(self.shard_stats)
        self._poll_replicas()
        losses = [st.last_stats.get("loss_ema") for st in self.replicas.values() if st.last_stats]
        losses = [x for x in losses if x is not None and math.isfinite(x)]
        count = sum(s["staleness_count"] for s in stats)
        examples = self.examples_sync if self.cfg.strategy == "sync" else max(s["examples"] for s in stats)
        rec = {
            "wall_s": round(wall, 3),
            "updates": sum(s["updates"] for s in stats),
            "updates_per_shard": [s["updates"] for s in stats],
            "examples": examples,
            "examples_per_s": examples / wall if wall > 0 else 0.0,
            "train_loss": sum(losses) / len(losses) if losses else None,
            "test_accuracy": acc,
            "train_accuracy": train_acc,
            "test_loss": test_loss,
            "staleness_mean": sum(s["staleness_sum"] for s in stats) / count if count else 0.0,
            "staleness_max": max(s["staleness_max"] for s in stats),
            "rejected_pushes": sum(s["rejected_pushes"] for s in stats),
            "replicas_alive": sum(st.alive for st in self.replicas.values()),
            # cumulative traffic through the shards (fetched includes this evaluation's own read)
            "bytes_pushed": sum(s["bytes_pushed"] for s in stats),
            "bytes_fetched": sum(s["bytes_fetched"] for s in stats),
        }
        live = [st.last_stats for st in self.replicas.values() if st.last_stats and "wait_s" in st.last_stats]
        if live:  # where the replicas' time goes: computing gradients vs waiting for fetches and pushes
            rec["replica_compute_s"] = round(sum(s["compute_s"] for s in live), 3)
            rec["replica_wait_s"] = round(sum(s["wait_s"] for s in live), 3)
        if self.cfg.partitions > 1:
            from distbelief.partition.stats import messaging_metrics

            rec.update(messaging_metrics([st.last_stats for st in self.replicas.values() if st.last_stats]))
        self.rec.record(rec)
        self.best_acc = max(self.best_acc, acc)
        if self.cfg.target_accuracy and acc >= self.cfg.target_accuracy and self.time_to_target is None:
            self.time_to_target = wall
        self._save_state()
        for callback in self.callbacks:
            callback(self, rec)
        return rec

    # ---------------------------------------------------------------- stop conditions
    def _time_left(self) -> float:
        if not self.cfg.max_seconds:
            return math.inf
        return self.cfg.max_seconds - self.clock.elapsed()

    def _should_stop(self) -> bool:
        if self.time_to_target is not None:
            self.stop_reason = self.stop_reason or "target accuracy reached"
            return True
        if self._time_left() <= 0:
            self.stop_reason = self.stop_reason or "time budget spent"
            return True
        return False

    # ---------------------------------------------------------------- Downpour
    def _run_replica(self, rid: int, max_steps: int | None) -> None:
        st = self.replicas[rid]
        left = self._time_left()
        st.future = self.runtime.call(st.role, "run", max_steps, None if math.isinf(left) else max(0.0, left))
        st.finished = False

    def _handle_failure(self, rid: int, err: Exception, max_steps: int | None) -> None:
        st = self.replicas[rid]
        decision = self.policy.decide(st.restarts)
        self.rec.log(f"replica {rid} failed ({err}); decision: {decision.value}")
        try:
            self.runtime.kill(st.role)
        except Exception:  # noqa: BLE001 - it is already dead
            pass
        if decision is Decision.DROP or self._should_stop():
            st.alive, st.future = False, None
            if decision is Decision.DROP:
                self.replicas_lost += 1
                alive = sum(s.alive for s in self.replicas.values())
                self.rec.log(f"replica {rid} exhausted its {self.policy.max_restarts} restarts; "
                             f"continuing with {alive} replicas")
            return
        st.future = None
        self._schedule_restart(st)

    def _schedule_restart(self, st: _ReplicaState) -> None:
        """Restart this failed replica once its backoff is over (``_restart_due``); nothing waits for it."""
        st.failed_at = time.monotonic()
        st.restart_at = st.failed_at + self.policy.backoff(st.restarts)

    def _restart_due(self) -> None:
        """Restart the failed replicas whose backoff is over (the supervision loop calls this every tick)."""
        now = time.monotonic()
        for rid, st in self.replicas.items():
            if st.restart_at is None or now < st.restart_at:
                continue
            st.restart_at = None
            if self._should_stop():
                st.alive = False
                continue
            st.restarts += 1
            self.replica_restarts += 1
            st.base_steps = st.steps
            st.role = self._start_replica(rid)
            self.replica_recovery_s.append(time.monotonic() - st.failed_at)
            self.events.append({"event": "replica restarted", "id": rid, "wall_s": self.clock.elapsed()})
            if self.cfg.strategy == "sync":
                continue  # the lockstep loop calls it at its next step
            limit = st.phase_limit
            remaining = None if limit is None else max(0, limit - (st.steps - st.phase_base))
            self._run_replica(rid, remaining)
            self.rec.log(f"replica {rid} restarted (restart {st.restarts}/{self.policy.max_restarts}); "
                         f"it rejoins from the server's parameters")

    def _until_restart(self) -> float:
        """Seconds until the next scheduled replica restart (inf: none)."""
        due = [st.restart_at for st in self.replicas.values() if st.restart_at is not None]
        return max(0.0, min(due) - time.monotonic()) if due else math.inf

    def _supervise(self, rids: list[int], max_steps, next_eval: float) -> float:
        """Run replicas ``rids`` to completion (or stop), evaluating on the cadence. Returns the next eval time.

        ``max_steps``: steps for each replica in this phase (None = no limit), or a dict of them per replica.
        """
        for rid in rids:
            st = self.replicas[rid]
            st.phase_base = st.steps
            st.phase_limit = max_steps.get(rid) if isinstance(max_steps, dict) else max_steps
            self._run_replica(rid, st.phase_limit)
        stopping_since: float | None = None
        while True:
            pending = {rid: st for rid, st in self.replicas.items() if rid in rids and st.alive and not st.finished}
            if not pending:
                return next_eval
            # A fault due at a step is looked for every 20 ms, so it lands close to that step.
            wait = max(0.0, min(next_eval - self.clock.elapsed(), 0.02 if self._fault_pending() else 0.5,
                                self._until_restart()))
            futures = [st.future for st in pending.values() if st.future is not None]
            if futures:
                done = self.runtime.wait_any(futures, wait)
            else:  # every pending replica waits out its restart backoff
                time.sleep(wait)
                done = []
            for rid, st in pending.items():
                if st.future in done:
                    try:
                        s = st.future.result(self.timeout_s)
                        st.last_stats, st.steps, st.finished = s, st.base_steps + s["steps"], True
                    except (RoleFailedError, RemoteTimeoutError) as e:
                        self._handle_failure(rid, e, max_steps)
            self._restart_due()
            self._maybe_inject_fault()
            self._check_shards()
            if self.clock.elapsed() >= next_eval:
                self.evaluate_paused()
                next_eval = self.clock.elapsed() + self._eval_interval()
            if stopping_since is None and self._should_stop():
                stopping_since = time.monotonic()
                for st in self.replicas.values():
                    if st.running:
                        self.runtime.call(st.role, "stop")
            if stopping_since is not None and time.monotonic() - stopping_since > self.timeout_s:
                raise RemoteTimeoutError(
                    f"replicas did not stop within {self.timeout_s:.0f}s of being asked (remote_timeout_s)")

    def _run_steps(self) -> int:
        """The run's steps so far, all replicas together (polled from the replicas)."""
        if self.cfg.strategy != "sync":
            self._poll_replicas()
        return sum(st.steps for st in self.replicas.values())

    def _fault_pending(self) -> bool:
        faults = self.job.faults
        return bool(faults.kill_shard_at_step and not self._shard_killed_once) or bool(
            faults.kill_replica_at_step and not self._killed_once)

    def _maybe_inject_fault(self) -> None:
        """Fault injection by step (never by wall-clock time, so a test's fault always lands at the same point
        of the run): kill a shard and/or a replica once the run has done ``kill_*_at_step`` steps (``job.faults``:
        distbelief.testing)."""
        faults = self.job.faults
        shard_due = faults.kill_shard_at_step and not self._shard_killed_once
        replica_due = faults.kill_replica_at_step and not self._killed_once
        if not (shard_due or replica_due):
            return
        steps = self._run_steps()
        if shard_due and steps >= faults.kill_shard_at_step:
            self._shard_killed_once = True
            self.events.append({"event": "shard killed", "id": faults.kill_shard_id,
                                "wall_s": self.clock.elapsed(), "step": steps})
            self.rec.log(f"fault injection: killing parameter shard {faults.kill_shard_id} at step {steps}")
            self.runtime.kill(self.shards[faults.kill_shard_id])
        if replica_due and steps >= faults.kill_replica_at_step:
            st = self.replicas.get(faults.kill_replica_id)
            if st is not None and st.running and not st.finished:
                self._killed_once = True
                self.events.append({"event": "replica killed", "id": faults.kill_replica_id,
                                    "wall_s": self.clock.elapsed(), "step": steps})
                if faults.kill_partition_id >= 0:  # one partition's process: its whole group fails and restarts
                    self.rec.log(f"fault injection: killing partition {faults.kill_partition_id} of replica "
                                 f"{faults.kill_replica_id} at step {steps}")
                    self.runtime.kill_partition(st.role, faults.kill_partition_id)
                else:
                    self.rec.log(f"fault injection: killing replica {faults.kill_replica_id} at step {steps}")
                    self.runtime.kill(st.role)

    def run_downpour(self) -> None:
        cfg = self.cfg
        max_steps = cfg.max_steps or None
        self._wait_shards_ready()
        self.rec.log(f"starting {cfg.replicas} replicas x {cfg.shards} shards on the {self.runtime.name} runtime "
                     f"({self.total:,} parameters)")
        for rid in range(cfg.replicas):
            self.replicas[rid] = self._new_replica_state(rid)
        self._choose_evaluation()
        self.clock = Clock(offset_s=self.prev.get("wall_s", 0.0))
        next_eval = self.clock.elapsed() + cfg.eval_every_seconds
        if cfg.warmstart_steps and cfg.replicas > 1 and not self.prev.get("warmstart_done"):
            self.rec.log(f"warmstart: replica 0 trains alone for {cfg.warmstart_steps} steps")
            next_eval = self._supervise([0], cfg.warmstart_steps, next_eval)
            self.replicas[0].finished = False
            if self._should_stop():
                return
        self._warmstart_done = True
        limits = None
        if max_steps is not None:  # max_steps counts each replica's steps after warmstart, across resumes
            ws = cfg.warmstart_steps if cfg.replicas > 1 else 0
            limits = {rid: max(0, max_steps - (st.steps - (ws if rid == 0 else 0)))
                      for rid, st in self.replicas.items()}
        self._supervise(list(range(cfg.replicas)), limits, next_eval)

    # ---------------------------------------------------------------- synchronous data parallel
    def run_sync(self) -> None:
        cfg = self.cfg
        self._wait_shards_ready()
        self.rec.log(f"starting {cfg.replicas} synchronous replicas x {cfg.shards} shards on the "
                     f"{self.runtime.name} runtime ({self.total:,} parameters)")
        for rid in range(cfg.replicas):
            self.replicas[rid] = self._new_replica_state(rid)
        self.clock = Clock(offset_s=self.prev.get("wall_s", 0.0))
        next_eval = self.clock.elapsed() + cfg.eval_every_seconds
        step = max([st.steps for st in self.replicas.values()] + [0])
        while not (cfg.max_steps and step >= cfg.max_steps):
            self._restart_due()
            live = [rid for rid, st in self.replicas.items() if st.running]
            if not live:
                if any(st.alive for st in self.replicas.values()):  # all waiting out their restart backoff
                    time.sleep(min(0.5, self._until_restart()))
                    continue
                raise DistBeliefError("every replica failed and none could be restarted")
            # Each replica returns its gradient split by shard; the driver waits for the small summaries only,
            # and shard k receives part k of every gradient straight from the replicas (Runtime.call_split).
            futs = {rid: self.runtime.call_split(self.replicas[rid].role, "sync_step", cfg.shards) for rid in live}
            grads = []
            for rid, f in futs.items():
                try:
                    f.result(self.timeout_s)  # raises here if the replica died or failed: its parts are unusable
                    grads.append(f)
                except (RoleFailedError, RemoteTimeoutError) as e:
                    self._handle_sync_failure(rid, e)
            self._maybe_inject_fault()
            self._check_shards()
            if grads:
                def apply_on(k: int) -> Future:
                    parts = [g.part(k) for g in grads]
                    return self.runtime.call_with_parts(self.shards[k], "apply_mean", parts, self.layout.range(k)[0],
                                                        self.total)

                applying = [apply_on(k) for k in range(cfg.shards)]  # every shard at once, not one after another
                for k, f in enumerate(applying):
                    try:
                        f.result(self.timeout_s)
                    except RoleFailedError as e:  # died mid-step: restore it, then apply this step there
                        self._restart_shard(k, e)
                        apply_on(k).result(self.timeout_s)
                self.examples_sync += cfg.batch_size * len(grads)
                step += 1
                for st in self.replicas.values():
                    st.steps = step
            if self.clock.elapsed() >= next_eval:
                t0 = time.monotonic()
                self.clock.pause()  # synchronous training stops while we evaluate: don't count it
                self.evaluate_now()
                self.clock.resume()
                self._last_eval_s = time.monotonic() - t0
                next_eval = self.clock.elapsed() + self._eval_interval()
            if self._should_stop():
                break
        for st in self.replicas.values():
            st.steps = step

    def _handle_sync_failure(self, rid: int, err: Exception) -> None:
        st = self.replicas[rid]
        decision = self.policy.decide(st.restarts)
        self.rec.log(f"replica {rid} failed ({err}); decision: {decision.value}")
        try:
            self.runtime.kill(st.role)
        except Exception:  # noqa: BLE001
            pass
        if decision is Decision.DROP:
            st.alive = False
            self.replicas_lost += 1
            return
        self._schedule_restart(st)

    def _stop_all_replicas(self) -> None:
        futs = []
        for st in self.replicas.values():
            if st.running:
                self.runtime.call(st.role, "stop")
                if st.future is not None:
                    futs.append((st, st.future))
        for st, f in futs:
            try:
                s = f.result(self.timeout_s)
                st.steps = st.base_steps + s["steps"]
            except (RoleFailedError, RemoteTimeoutError):
                pass

    # ---------------------------------------------------------------- the whole run
    def run(self) -> dict:
        cfg = self.cfg
        try:
            try:
                if cfg.strategy == "sync":
                    self.run_sync()
                else:
                    self.run_downpour()
            except KeyboardInterrupt:
                # Ctrl-C / SIGTERM: stop the replicas, then fall through to the final evaluation and checkpoint.
                self.stop_reason = "interrupted"
                self.rec.log("interrupted: stopping replicas and writing a final checkpoint "
                             f"(resume with: distbelief train --resume {cfg.out or 'RUN_DIR'})")
                self._stop_all_replicas()
                if self.clock is None:
                    raise
            if not self.stop_reason:
                self.stop_reason = "step limit reached"
            wall = self.clock.elapsed()
            self._check_shards()
            final = self.evaluate_now()
            flat = self._read_server(self.server_params)
            stats = self._read_server(self.shard_stats)
            self._read_server(self.checkpoint_shards)
        finally:
            for st in self.replicas.values():
                try:
                    self.runtime.kill(st.role)
                except Exception:  # noqa: BLE001
                    pass
        count = sum(s["staleness_count"] for s in stats)
        summary = {
            "strategy": cfg.strategy,
            "runtime": self.runtime.name,
            "replicas": cfg.replicas,
            "shards": cfg.shards,
            "server_optimizer": cfg.server_optimizer,
            "num_parameters": self.total,
            "final_test_accuracy": final["test_accuracy"],
            "best_test_accuracy": max(self.best_acc, final["test_accuracy"]),
            "target_accuracy": cfg.target_accuracy or None,
            "time_to_target_s": self.time_to_target,
            "examples": final["examples"],
            "examples_per_s": final["examples"] / wall if wall > 0 else 0.0,
            "updates": sum(s["updates"] for s in stats),
            "updates_per_shard": [s["updates"] for s in stats],
            "steps_per_replica": [st.steps for st in self.replicas.values()],
            # the data plane of the replicas' latest incarnations: fused push+fetch calls, models in shared memory
            "push_fetch_calls": sum(st.last_stats.get("push_fetches", 0) for st in self.replicas.values()),
            "replicas_zero_copy": sum(bool(st.last_stats.get("zero_copy")) for st in self.replicas.values()),
            "replicas_colocated": sum(bool(st.last_stats.get("colocated")) for st in self.replicas.values()),
            "staleness_mean": sum(s["staleness_sum"] for s in stats) / count if count else 0.0,
            "staleness_max": max(s["staleness_max"] for s in stats),
            "rejected_pushes": sum(s["rejected_pushes"] for s in stats),
            "replica_restarts": self.replica_restarts,
            "replicas_lost": self.replicas_lost,
            "shard_restarts": self.shard_restarts,
            "updates_lost": self.updates_lost,
            "shard_recovery_s": self.shard_recovery_s,
            "replica_recovery_s": self.replica_recovery_s,
            "events": self.events,
            "stop_reason": self.stop_reason,
            "evaluation": self.eval_mode,
            "durability": cfg.durability,
            "wall_s": wall,
            "partitions": cfg.partitions,
            **{k: v for k, v in final.items() if k.startswith("partition_")},
        }
        self.final_flat = flat
        return summary
