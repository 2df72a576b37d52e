"""The Downpour driver: starts the shards and replicas through a Runtime, runs warmstart, evaluates the
*server's* parameters on a wall-clock cadence, enforces the stop conditions, and has failed replicas restarted
(``supervisor.Supervisor``) and dead shards restored (``shards.ServerShards``) while the others train.

``downpour/sync.py`` drives synchronous data parallelism over the same shards and replicas.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from distbelief import stopping
from distbelief.buffers import average, buffers_of, load_buffers
from distbelief.downpour.elastic import ElasticPlan
from distbelief.downpour.replica import ReplicaRecipe, ReplicaSettings
from distbelief.downpour.shards import ServerShards, durability_for, staleness
from distbelief.evaluation import evaluate_job
from distbelief.exceptions import ConfigError, RemoteTimeoutError, RoleFailedError
from distbelief.hooks import StepWake
from distbelief.job import Job
from distbelief.metrics import Clock, EvalSchedule, RunRecorder
from distbelief.ps.optimizers import make_server_optimizer
from distbelief.ps.sharding import flatten, unflatten_into
from distbelief.ps.slicer import Slicer
from distbelief.resume import load_server_state, read_trainer_state, retire_checkpoints, write_trainer_state
from distbelief.runtime.base import Future, Role, Runtime
from distbelief.stopping import StopRule
from distbelief.summary import RunSummary
from distbelief.supervisor import Decision, RestartPolicy, Supervisor


@dataclass
class _ReplicaState:
    role: Role | None  # None while it waits out its restart backoff
    future: Future | None = None
    steps: int = 0  # steps done by earlier incarnations plus the last polled count of this one
    base_steps: int = 0
    phase_base: int = 0  # steps done before the current phase (warmstart, then everyone)
    phase_limit: int | None = None  # steps this replica runs in the current phase
    alive: bool = True
    finished: bool = False
    last_stats: dict = field(default_factory=dict)

    @property
    def running(self) -> bool:
        """Alive with a live role to call (not waiting out a restart backoff)."""
        return self.alive and self.role is not None


class ParameterServerTrainer:
    """Runs ``downpour`` over a Runtime (``SyncTrainer`` in sync.py: ``sync``). One instance per run."""

    # The replicas push whenever they are done (Downpour; a push's staleness is then its own). SyncTrainer: the
    # driver steps them together, and overrides what that changes (the loop, the step and example counts, the
    # data plane's summary); consistency (ssp) and elastic replicas are objects given to it (clocks, ElasticPlan).
    asynchronous = True

    def __init__(self, job: Job, runtime: Runtime, recorder: RunRecorder, resume: bool = False):
        self.job, self.runtime, self.rec = job, runtime, recorder
        cfg = job.cfg
        self.cfg = cfg
        self.timeout_s = cfg.remote_timeout_s
        torch.manual_seed(cfg.seed)
        self.eval_model = job.model_fn()
        # Module buffers are the replicas' own; evaluations use their average. (Partitioned models have none.)
        self._has_buffers = bool(buffers_of(self.eval_model)) and cfg.partitions == 1
        self.final_buffers: dict | None = None
        init = flatten(self.eval_model)
        self.total = init.numel()
        self.optimizer = make_server_optimizer(cfg.optimizer, cfg.lr, cfg.adagrad_eps,
                                               cfg.adagrad_initial_accumulator,
                                               staleness_aware=cfg.staleness_aware and self.asynchronous)
        self.durability, self._tmp = durability_for(cfg)
        self.prev: dict = {}  # the trainer state of the run we resume, if any
        self._retired = None
        server_state = None
        slicer = Slicer.for_model(self.eval_model, cfg.shards)  # embedding tables row-sharded, if the model has any
        tabled = slicer if slicer.has_tables else None
        if resume:
            if self.durability is None:
                raise ConfigError("resume", f"the run keeps no checkpoints with --durability {cfg.durability}; "
                                            f"resume needs --durability snapshot or log")
            # a model with tables: its dense part by ranges, its rows by their keys (moved to the new shards)
            server_state = load_server_state(self.durability.root, slicer.total if tabled else self.total,
                                             self.optimizer, slicer=tabled)
            for msg in server_state.corrupt_checkpoints:
                self.rec.log(f"resume: skipped a damaged checkpoint, using the previous good one: {msg}")
            self.prev = read_trainer_state(cfg.out)
            self._retired = retire_checkpoints(self.durability.root)
            old_k = len(server_state.versions)
            self.rec.log(f"resuming from {cfg.out}: {old_k} shard checkpoint(s) at versions "
                         f"{[v for _, _, v in server_state.versions]}" +
                         (f", resharded to {cfg.shards} shards" if old_k != cfg.shards else "") +
                         f"; training time so far {self.prev.get('wall_s', 0.0):.1f}s")
        self.events: list[dict] = []  # failures and recoveries, with training-clock times
        self.clock: Clock | None = None
        p = self.prev
        self.server = ServerShards(cfg, runtime, self.rec.log, self.optimizer, init, self.durability, server_state,
                                   hand_over=self._hand_over, on_event=self._event, prev=p, slicer=tabled)
        self.layout, self.client = self.server.layout, self.server.client
        self._warmstart_done = False
        self.settings = ReplicaSettings(
            fetch_every=cfg.fetch_every, push_every=cfg.push_every, local_lr=cfg.local_lr,
            overlap=cfg.overlap, remote_timeout_s=cfg.remote_timeout_s, device=cfg.device,
            compress=cfg.compress, compress_ratio=cfg.compress_ratio, compress_bits=cfg.compress_bits,
            compress_rank=cfg.compress_rank, compress_fetch=cfg.compress_fetch,
        )
        # consistency = "ssp": the clock table that bounds how far a replica runs ahead (runtime/clocks.py)
        self.clocks = runtime.create_clocks(cfg.staleness_bound) if cfg.consistency == "ssp" else None
        self.dropped_gradients = p.get("dropped_gradients", 0)  # sync with backup replicas: stragglers' gradients
        self.dropped_by_replica: dict[int, int] = {}  # of those, this run's, by the replica that computed them
        # --replicas MIN:MAX (downpour/elastic.py): replicas come and go with the cluster's free CPUs
        self.elastic = ElasticPlan(cfg.replicas, cfg.max_replicas) if cfg.max_replicas else None
        self._ceiling = cfg.max_replicas  # less the replicas that used up their restarts
        self._next_scale = 0.0
        self._scaling = False  # only once every replica runs (after warmstart)
        self._added_at: dict[int, float] = {}  # elastic replicas added, until their first push is seen
        self.first_push_s: list[float] = []  # elastic: from a replica's start to its first applied push
        self.replicas: dict[int, _ReplicaState] = {}
        self.eval_mode = "paused"  # set once the replicas are placed (_choose_evaluation)
        self._last_eval_s = 0.0
        self.eval_schedule = EvalSchedule(cfg.eval_every_seconds, self.rec.log)
        # the run's stop rule (distbelief/stopping.py); the step limit is the replicas' own (each stops at it)
        self.stop = StopRule(cfg.max_steps, cfg.max_seconds, lambda: self.clock.elapsed() if self.clock else 0.0,
                             target=cfg.target_accuracy, best=p.get("best_acc", -1.0),
                             time_to_target=p.get("time_to_target"))
        self.examples_sync = p.get("examples_sync", 0)
        # restarts and losses of the run we resume carry over (the policy's budget is per run, not per resume)
        self.supervisor = Supervisor(RestartPolicy(max_restarts=cfg.max_replica_restarts),
                                     earlier=(p.get("replica_restarts", 0), p.get("replicas_lost", 0)))
        self.hooks = job.hooks.start(self, resumed=bool(p))  # distbelief/hooks.py: tooling's way in
        self.wake = StepWake()  # when to look at the step count for the hooks' next step

    @property
    def shards(self) -> list[Role]:
        return self.server.roles

    def _event(self, record: dict) -> None:
        self.events.append({**record, "wall_s": self.clock.elapsed() if self.clock else 0.0})

    # ---------------------------------------------------------------- shard failures
    def _check_shards(self) -> None:
        self.server.check()

    def _hand_over(self, k: int, handle) -> int:
        """Point every running replica at restarted shard ``k``; the highest version of the dead shard any of
        them saw acknowledged: from their last statistics, and from what each reports as it switches."""
        self._poll_replicas()
        acked = max([r.last_stats.get("acked", [0] * (k + 1))[k] for r in self.replicas.values()
                     if r.last_stats] + [0])
        handed = [(rid, self.runtime.call(r.role, "replace_shard", k, handle))
                  for rid, r in self.replicas.items() if r.running]
        for rid, f in handed:
            try:
                acked = max(acked, f.result(self.timeout_s) or 0)
            except (RoleFailedError, RemoteTimeoutError) as e:  # its run() will fail too and be restarted
                self.rec.log(f"replica {rid} could not take the restarted shard {k}: {e}")
        return acked

    # ---------------------------------------------------------------- roles
    def _recipe(self, rid: int) -> ReplicaRecipe:
        j = self.job
        shares = 1 if self.elastic else self.cfg.replicas_started  # elastic: each its own order over all the data
        return ReplicaRecipe(rid, shares, j.model_fn, j.train_data, self.cfg.batch_size,
                             self.cfg.seed, self._settings_for(rid), j.loss_fn, clocks=self.clocks)

    def _settings_for(self, rid: int) -> ReplicaSettings:
        hook = self.hooks.replica_hook(rid)
        return self.settings if hook is None else dataclasses.replace(self.settings, step_hook=hook)

    def _start_replica(self, rid: int) -> Role:
        role = self._place_replica(rid)
        self._await_built(role)
        return role

    def _await_built(self, role: Role) -> None:
        # A replica that cannot even be built (bad model, bad data) fails here, with its own error.
        self.runtime.call(role, "stats").result(max(self.timeout_s, 180.0))

    def _place_replica(self, rid: int) -> Role:
        if self.cfg.partitions > 1:  # model parallelism: the replica is a group of partitions (distbelief.partition)
            from distbelief.partition.replica import PartitionRecipe
            j = self.job
            recipe = PartitionRecipe(rid, self.cfg.replicas, j.model_fn, j.train_data, self.cfg.batch_size,
                                     self.cfg.seed, self._settings_for(rid), j.loss_fn, clocks=self.clocks)
            role = self.runtime.create_partition_group(rid, recipe, self.shards, self.layout, self.job.threads,
                                          self.cfg.partitions)
        else:
            role = self.runtime.create_replica(rid, self._recipe(rid), self.shards, self.layout, self.job.threads)
        return role

    def _wait_shards_ready(self) -> None:
        self.server.wait_ready(self._retired)
        self._retired = None

    def _start_replicas(self, count: int) -> None:
        """Start replicas 0..count-1: all placed first, then awaited, so that their processes start together."""
        prev_steps = self.prev.get("steps_per_replica", [])
        roles = [self._place_replica(rid) for rid in range(count)]
        for rid, role in enumerate(roles):
            self._await_built(role)
            steps = prev_steps[rid] if rid < len(prev_steps) else 0
            self.replicas[rid] = _ReplicaState(role=role, steps=steps, base_steps=steps)
        self.server.place_spares()  # (--durability replicate) now that the first step waits for no process

    def _save_state(self) -> None:
        if not self.cfg.out:
            return
        write_trainer_state(self.cfg.out, {
            "wall_s": self.clock.elapsed(), "best_acc": self.stop.best, "time_to_target": self.stop.time_to_target,
            "examples_sync": self.examples_sync, "dropped_gradients": self.dropped_gradients,
            "replica_restarts": self.supervisor.replica_restarts,
            "replicas_lost": self.supervisor.replicas_lost, "shard_restarts": self.server.restarts,
            "updates_lost": self.server.updates_lost, "steps_per_replica": [st.steps for st in self.replicas.values()],
            "warmstart_done": True if self.prev.get("warmstart_done") else self._warmstart_done,
        })

    # ---------------------------------------------------------------- evaluation and metrics
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
        flat = self.server.read(self.server.params)
        unflatten_into(self.eval_model, flat)
        self._gather_buffers()
        acc, test_loss, train_acc = evaluate_job(self.eval_model, self.job)
        stats = self.server.read(self.server.stats)
        self._poll_replicas()
        losses = [st.last_stats.get("loss_ema") for st in self.replicas.values() if st.last_stats]
        losses = [x for x in losses if x is not None and math.isfinite(x)]
        stale_mean, stale_max = staleness(stats)
        examples = self._examples_trained(stats)
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
            "staleness_mean": stale_mean,
            "staleness_max": stale_max,
            "rejected_pushes": sum(s["rejected_pushes"] for s in stats),
            "replicas_alive": sum(st.alive for st in self.replicas.values()),
            # cumulative traffic through the shards (fetched includes this evaluation's own read)
            "bytes_pushed": sum(s["bytes_pushed"] for s in stats),
            "bytes_fetched": sum(s["bytes_fetched"] for s in stats),
        }
        rec.update(self._table_traffic(stats))  # embedding rows moved (cumulative; rows/s in Prometheus)
        live = [st.last_stats for st in self.replicas.values() if st.last_stats and "wait_s" in st.last_stats]
        if live:  # where the replicas' time goes: computing gradients vs waiting for fetches and pushes
            rec["replica_compute_s"] = round(sum(s["compute_s"] for s in live), 3)
            rec["replica_wait_s"] = round(sum(s["wait_s"] for s in live), 3)
            if self.cfg.compress != "none":  # ... and compressing pushes
                rec["replica_compress_s"] = round(sum(s.get("compress_s") or 0.0 for s in live), 3)
        if self.cfg.partitions > 1:
            from distbelief.partition.stats import messaging_metrics

            rec.update(messaging_metrics([st.last_stats for st in self.replicas.values() if st.last_stats]))
        self.rec.record(rec)
        self.stop.evaluated(acc, wall)
        self._save_state()
        self.hooks.on_evaluation(self, rec)
        return rec

    # ---------------------------------------------------------------- stop conditions
    def _gather_buffers(self) -> None:
        """The replicas' module buffers (BatchNorm statistics), averaged into the evaluation model (buffers.py)."""
        if not self._has_buffers:
            return
        futs = [self.runtime.call(st.role, "module_buffers") for st in self.replicas.values() if st.running]
        got = []
        for f in futs:
            try:
                got.append({k: torch.as_tensor(v) for k, v in f.result(self.timeout_s).items()})
            except (RoleFailedError, RemoteTimeoutError):
                continue  # a replica that died: the supervisor restarts it; the others' buffers serve
        if got:
            self.final_buffers = average(got)
            load_buffers(self.eval_model, self.final_buffers)

    @property
    def stop_reason(self) -> str:
        return self.stop.reason

    def _time_left(self) -> float:
        return self.stop.seconds_left()

    def request_stop(self, reason: str) -> None:
        """End the run at the next supervision tick, with ``reason`` as its stop reason (a probe's way to end a
        run once what it waited for happened, instead of a time budget; callable from the driver's thread)."""
        self.stop.request(reason)

    def _should_stop(self) -> bool:
        return self.stop.check()

    # ---------------------------------------------------------------- Downpour
    def _run_replica(self, rid: int, max_steps: int | None) -> None:
        st = self.replicas[rid]
        left = self._time_left()
        st.future = self.runtime.call(st.role, "run", max_steps, None if math.isinf(left) else max(0.0, left))
        st.finished = False

    def _handle_failure(self, rid: int, err: Exception) -> None:
        """Replica ``rid`` failed: its role is killed, and the supervisor drops it or schedules its restart (the
        other replicas go on; nothing waits for the backoff)."""
        st = self.replicas[rid]
        decision = self.supervisor.failed(rid, stopping=self._should_stop())
        self.rec.log(f"replica {rid} failed ({err}); decision: {decision.value}")
        try:
            self.runtime.kill(st.role)
        except Exception:  # noqa: BLE001 - it is already dead
            pass
        st.future = None
        if self.clocks is not None:
            self.clocks.retire(rid)  # a dead replica holds no one back (its successor joins when it runs)
        if decision is Decision.DROP:
            st.alive = False
            self._ceiling -= 1  # elastic: not replaced under a new id either
            alive = sum(s.alive for s in self.replicas.values())
            self.rec.log(f"replica {rid} exhausted its {self.supervisor.policy.max_restarts} restarts; "
                         f"continuing with {alive} replicas")
        elif self.supervisor.waiting(rid):
            st.role = None
        else:  # the run is stopping: no restart
            st.alive = False

    def _restart_due(self) -> None:
        """Start the failed replicas whose backoff is over (the supervision loop calls this every tick)."""
        for rid in self.supervisor.due():
            st = self.replicas[rid]
            if self._should_stop():
                self.supervisor.cancel(rid)
                st.alive = False
                continue
            if self.elastic and not self.elastic.can_restart(self.runtime.free_replica_slots()):
                self.supervisor.cancel(rid)
                st.alive = False
                self._event({"event": "replica removed", "id": rid, "time": time.time()})
                self.rec.log(f"elastic: replica {rid} removed (no free CPU to restart it on: its node left); "
                             f"{self._active()} replicas go on")
                continue
            st.base_steps = st.steps
            st.role = self._start_replica(rid)
            n = self.supervisor.restarted(rid)
            self._event({"event": "replica restarted", "id": rid})
            self.rec.log(f"replica {rid} restarted (restart {n}/{self.supervisor.policy.max_restarts}); "
                         f"it rejoins from the server's parameters")
            self._rejoin(rid)

    # ---------------------------------------------------------------- elastic replicas
    def _active(self) -> int:
        return sum(st.alive for st in self.replicas.values())

    def _scale(self, rids: list[int]) -> None:
        """Elastic Downpour, once per supervision tick (at most every 0.5 s): add the replicas the free CPUs hold
        (up to MAX) to the running phase ``rids``, and note each new replica's first applied push."""
        now = time.monotonic()
        if self.elastic is None or not self._scaling or now < self._next_scale or self._should_stop():
            return
        self._next_scale = now + 0.5
        for rid in [r for r in self._added_at if self.replicas[r].running]:
            try:
                first = self.runtime.call(self.replicas[rid].role, "stats").result(10.0).get("first_push_time")
            except (RoleFailedError, RemoteTimeoutError):
                continue
            if first is not None:
                after = max(0.0, first - self._added_at.pop(rid))
                self.first_push_s.append(round(after, 3))
                self._event({"event": "replica first push", "id": rid, "after_s": round(after, 3)})
        placed = []  # placed together, so that they are built at the same time
        for _ in range(self.elastic.to_add(self._active(), self.runtime.free_replica_slots(), self._ceiling)):
            rid = max([*self.replicas, *(r for r, _, _ in placed)], default=-1) + 1
            placed.append((rid, time.time(), self._place_replica(rid)))
        for rid, t0, role in placed:
            self._await_built(role)
            self.replicas[rid] = st = _ReplicaState(role=role)
            st.phase_limit = self.cfg.max_steps or None
            self._run_replica(rid, st.phase_limit)
            rids.append(rid)
            self._added_at[rid] = t0
            self._event({"event": "replica added", "id": rid, "time": t0})
            self.rec.log(f"elastic: replica {rid} added (free CPUs appeared); {self._active()} replicas")

    def _rejoin(self, rid: int) -> None:
        """A restarted replica takes up its phase where its predecessor left it."""
        st = self.replicas[rid]
        limit = st.phase_limit
        self._run_replica(rid, None if limit is None else max(0, limit - (st.steps - st.phase_base)))

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
            # A step the hooks wait for is looked for when the measured rate says it will be reached.
            wait = max(0.0, min(next_eval - self.clock.elapsed(), self.wake.seconds_until(self.hooks.next_step()),
                                self.supervisor.until_next()))
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
                        self._handle_failure(rid, e)
            self._restart_due()
            self._scale(rids)
            self._call_hooks()
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
        self._poll_replicas()
        return sum(st.steps for st in self.replicas.values())

    def _examples_trained(self, stats: list[dict]) -> int:
        """The run's examples so far: every one a shard applied (any push reaches every shard)."""
        return max(s["examples"] for s in stats)

    def _data_plane_summary(self, latest: list[dict]) -> dict:
        """Summary fields of how the replicas reached the shards: Downpour's client loop and its transports."""
        return dict(
            push_fetch_calls=sum(s.get("push_fetches", 0) for s in latest),
            replicas_zero_copy=sum(bool(s.get("zero_copy")) for s in latest),
            replicas_colocated=sum(bool(s.get("colocated")) for s in latest),
            replica_transports=dict(Counter(s["transport"] for s in latest if s.get("transport"))))

    def _call_hooks(self) -> None:
        """The hooks' ``on_step`` once the run reached the step they wait for (distbelief/hooks.py)."""
        due = self.hooks.next_step()
        if due is None:
            return
        steps = self._run_steps()
        self.wake.observe(steps)
        if steps >= due:
            self.hooks.on_step(self, steps)

    def kill_shard(self, k: int, steps: int | None = None) -> None:
        """Kill parameter shard ``k``'s process, as losing its machine would (the durability mode recovers it);
        ``steps``: the run's step count it is recorded at (default: counted now)."""
        steps = self._run_steps() if steps is None else steps
        self._event({"event": "shard killed", "id": k, "step": steps})
        self.rec.log(f"killing parameter shard {k} at step {steps}")
        self.server.kill(k)

    def kill_replica(self, rid: int, partition_id: int = -1, steps: int | None = None) -> bool:
        """Kill replica ``rid``'s process (``partition_id >= 0``: only that partition's; its group fails and
        restarts), as losing its machine would. False when it is not running (nothing killed)."""
        st = self.replicas.get(rid)
        if st is None or not st.running or st.finished:
            return False
        steps = self._run_steps() if steps is None else steps
        self._event({"event": "replica killed", "id": rid, "step": steps})
        if partition_id >= 0:
            self.rec.log(f"killing partition {partition_id} of replica {rid} at step {steps}")
            self.runtime.kill_partition(st.role, partition_id)
        else:
            self.rec.log(f"killing replica {rid} at step {steps}")
            self.runtime.kill(st.role)
        return True

    def run_downpour(self) -> None:
        cfg = self.cfg
        max_steps = cfg.max_steps or None
        self._wait_shards_ready()
        count = cfg.replicas
        if self.elastic:
            count = self.elastic.initial(self.runtime.free_replica_slots())
            self.rec.log(f"elastic: {count} replicas to start with ({cfg.replicas}:{cfg.max_replicas}, as the free "
                         f"CPUs hold)")
        self.rec.log(f"starting {count} replicas x {cfg.shards} shards on the {self.runtime.name} runtime "
                     f"({self.total:,} parameters)")
        self._start_replicas(count)
        self._choose_evaluation()
        self.clock = Clock(offset_s=self.prev.get("wall_s", 0.0))
        next_eval = self.clock.elapsed() + cfg.eval_every_seconds
        if cfg.warmstart_steps and count > 1 and not self.prev.get("warmstart_done"):
            self.rec.log(f"warmstart: replica 0 trains alone for {cfg.warmstart_steps} steps")
            next_eval = self._supervise([0], cfg.warmstart_steps, next_eval)
            self.replicas[0].finished = False
            if self._should_stop():
                return
        self._warmstart_done = True
        limits = None
        if max_steps is not None:  # max_steps counts each replica's steps after warmstart, across resumes
            ws = cfg.warmstart_steps if count > 1 else 0
            limits = {rid: max(0, max_steps - (st.steps - (ws if rid == 0 else 0)))
                      for rid, st in self.replicas.items()}
        self._scaling = True
        self._supervise(list(range(count)), limits, next_eval)

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
    def train(self) -> None:
        """The strategy's training loop (Downpour here; sync.py overrides it)."""
        self.run_downpour()

    def run(self) -> RunSummary:
        cfg = self.cfg
        try:
            try:
                self.train()
            except KeyboardInterrupt:
                # Ctrl-C / SIGTERM: stop the replicas, then fall through to the final evaluation and checkpoint.
                self.stop.end(stopping.INTERRUPTED)
                self.rec.log("interrupted: stopping replicas and writing a final checkpoint "
                             f"(resume with: distbelief train --resume {cfg.out or 'RUN_DIR'})")
                self._stop_all_replicas()
                if self.clock is None:
                    raise
            self.stop.end(stopping.STEP_LIMIT)  # (if nothing else ended it: every replica ran its steps)
            wall = self.clock.elapsed()
            self._check_shards()
            final = self.evaluate_now()
            flat = self.server.read(self.server.params)
            stats = self.server.read(self.server.stats)
            self.server.read(self.server.checkpoint)
        finally:
            for st in self.replicas.values():
                if st.role is not None:
                    try:
                        self.runtime.release(st.role)
                    except Exception:  # noqa: BLE001
                        pass
        self.final_flat = flat
        stale_mean, stale_max = staleness(stats)
        latest = [st.last_stats for st in self.replicas.values()]  # the replicas' latest incarnations
        ssp = self.clocks is not None
        clock_stats = self.clocks.stats(self.timeout_s) if ssp else {}
        return RunSummary(
            strategy=cfg.strategy, runtime=self.runtime.name, replicas=cfg.replicas, num_parameters=self.total,
            **self.stop.outcome_fields(final["test_accuracy"], final["examples"], wall),
            updates=sum(s["updates"] for s in stats),
            steps_per_replica=[st.steps for st in self.replicas.values()], events=self.events,
            partitions=cfg.partitions, evaluation=self.eval_mode, durability=cfg.durability,
            shards=cfg.shards, optimizer=cfg.optimizer,
            updates_per_shard=[s["updates"] for s in stats],
            staleness_mean=stale_mean, staleness_max=stale_max,
            rejected_pushes=sum(s["rejected_pushes"] for s in stats),
            staleness_histogram=[sum(col) for col in zip(*(s["staleness_histogram"] for s in stats))],
            consistency=cfg.consistency, staleness_bound=cfg.staleness_bound if ssp else None,
            clock_gap_max=clock_stats.get("clock_gap_max"), clock_waits=clock_stats.get("clock_waits"),
            clock_wait_s=round(sum(s.get("clock_wait_s", 0.0) for s in latest), 3) if ssp else None,
            max_replicas=cfg.max_replicas or None,
            replicas_added=sum(e["event"] == "replica added" for e in self.events) if self.elastic else None,
            replicas_removed=sum(e["event"] == "replica removed" for e in self.events) if self.elastic else None,
            replica_first_push_s=list(self.first_push_s) if self.elastic else None,
            **self._data_plane_summary(latest),
            replica_restarts=self.supervisor.replica_restarts, replicas_lost=self.supervisor.replicas_lost,
            replica_recovery_s=list(self.supervisor.recovery_s),
            shard_restarts=self.server.restarts, updates_lost=self.server.updates_lost,
            shard_recovery_s=list(self.server.recovery_s),
            backups_replaced=self.server.backups_replaced if self.server.replicate else None,
            duplicate_pushes=sum(s["duplicate_pushes"] for s in stats),
            partition_bytes_per_step=final.get("partition_bytes_per_step"),
            partition_messages_per_step=final.get("partition_messages_per_step"),
            partition_cpu_s_per_step=final.get("partition_cpu_s_per_step"),
            **self._table_summary(stats),
            **self._table_traffic(stats),
            **self._compression_summary(stats, latest),
        )

    def _table_traffic(self, stats: list[dict]) -> dict:
        """The bytes each shard read (pushes) and served (fetches) so far, and the table rows moved (a model with
        embedding tables): every evaluation's record and the summary."""
        traffic = {}
        if self.server.tabled:
            traffic.update(rows_pushed=sum(s["rows_pushed"] for s in stats),
                           rows_fetched=sum(s["rows_fetched"] for s in stats))
        traffic.update(bytes_pushed_per_shard=[s["bytes_pushed"] for s in stats],
                       bytes_fetched_per_shard=[s["bytes_fetched"] for s in stats])
        return traffic

    def _compression_summary(self, stats: list[dict], latest: list[dict]) -> dict:
        """The summary's compression fields (none for uncompressed pushes)."""
        if self.cfg.compress == "none" and self.cfg.compress_fetch == "none":
            return {}
        from distbelief.compression.registry import describe

        cfg = self.cfg
        return dict(compress=describe(cfg.compress, cfg.compress_ratio, cfg.compress_bits, cfg.compress_rank),
                    compress_fetch=cfg.compress_fetch,
                    compressed_push_bytes=sum(s.get("compressed_bytes") or 0 for s in latest if s),
                    residuals_dropped=self.supervisor.replica_restarts + self.supervisor.replicas_lost
                    + (cfg.replicas_started if self.prev else 0))

    def _table_summary(self, stats: list[dict]) -> dict:
        """The summary's table fields (none for a model without embedding tables)."""
        if not self.server.tabled:
            return {}
        tables = self.layout.tables
        return dict(table_rows=sum(t.num_rows for t in tables), table_parameters=sum(t.numel for t in tables))
