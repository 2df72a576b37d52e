"""Two baselines a user would otherwise pick on one machine, without a parameter server.

* ``hogwild`` — Hogwild! (Niu et al., 2011): the model's parameters (and, for Adagrad, its accumulators)
  live in shared memory; ``replicas`` worker processes each train on their own data subset and update them in
  place, without any lock. A dead worker does not stop the others.
* ``ddp`` — synchronous data parallelism with ``torch.nn.parallel.DistributedDataParallel`` (gloo on CPU):
  ``replicas`` ranks average their gradients with an all-reduce every step and each applies the same update,
  so the global batch is ``replicas x batch_size``. Every rank meets every all-reduce: one dead rank ends
  the run.

Both are measured exactly like Downpour and sgd: the training clock starts once every worker is ready to
train; every ``eval_every_seconds`` of training the driver pauses the workers at a step boundary (DDP: every
rank after the same step), stops the clock, evaluates the *current* parameters (the shared ones; DDP's rank 0
trains the driver's shared-memory model), then resumes both. Evaluation thus neither competes with training
for the cores nor counts as training time: examples/s and time-to-accuracy are training time. Metrics records
and summary fields are Downpour's, less those that do not apply (DDP: no shards, no staleness; neither
restarts a worker nor refuses a gradient).
Module buffers (BatchNorm's running statistics) live in the same shared memory as the parameters: Hogwild's
workers all update the driver's (lock-free, like the parameters), DDP's are rank 0's (which DDP broadcasts to the
other ranks at every forward). Evaluations and the returned model use them (docs/api.md, "Module buffers").
Workers are torch.multiprocessing processes, not Ray roles (nothing here imports ray). This module is the
driver; the workers' code is in ``workers.py``, their shared progress block in ``progress.py``.
"""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.connection import wait as wait_any
from typing import Any

import torch

from distbelief import stopping
from distbelief.baselines.processes import check_picklable, context, exit_text, free_port
from distbelief.baselines.progress import DONE, READY, SharedProgress
from distbelief.baselines.single import make_torch_optimizer
from distbelief.baselines.workers import (
    WorkerSpec,
    ddp_worker,
    hogwild_worker,
    param_digest,
    startup_timeout_s,
    worker_main,
)
from distbelief.buffers import buffers_of
from distbelief.evaluation import evaluate_job
from distbelief.exceptions import DistBeliefError, RemoteTimeoutError, RoleFailedError
from distbelief.hooks import StepWake
from distbelief.metrics import Clock, EvalSchedule, RunRecorder
from distbelief.ps.sharding import flatten
from distbelief.stopping import StopRule
from distbelief.summary import RunSummary, rate


class MultiprocessRun:
    """Drives one hogwild or ddp run: starts the workers, evaluates, enforces the stop conditions, handles
    deaths and hangs, writes the metrics. A test's probe (``Faults.on_evaluation``) sees ``run.worker_pids``."""

    def __init__(self, job, recorder: RunRecorder, strategy: str):
        self.job, self.rec, self.strategy = job, recorder, strategy
        self.cfg = cfg = job.cfg
        self.timeout_s = cfg.remote_timeout_s
        self.ctx = context(preload=[worker_main.__module__])
        self.progress = SharedProgress(cfg.replicas)
        torch.manual_seed(cfg.seed)  # the same initial parameters as --strategy sgd
        self.model = job.model_fn()
        # The workers (hogwild) or rank 0 (ddp) update these very tensors in place: the parameters, and the module
        # buffers too (Module.share_memory moves both). Hogwild's buffers are thus shared like its parameters:
        # every worker's forward updates the one set of BatchNorm statistics in place, without a lock (an update
        # can be lost in a race, as a parameter update can; the statistics stay a running average of the
        # workers' batches). That needs no machinery at all, where averaging private copies as Downpour does
        # would need every worker to send its buffers to the driver at every evaluation. DDP's run buffers are
        # rank 0's (broadcast to every rank at each forward), which rank 0 keeps in this model. Either way the
        # driver evaluates and returns the live buffers. (A module that replaces a buffer tensor rather than
        # updating it in place would leave the shared one behind; BatchNorm updates in place.)
        self.model.share_memory()
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        check_picklable(job)
        self.procs: dict[int, Any] = {}
        self.conns: dict[int, Any] = {}
        self.reports: dict[int, dict] = {}
        self.training: set[int] = set()  # started, neither finished nor lost
        self.lost: dict[int, str] = {}
        self.events: list[dict] = []
        self.clock: Clock | None = None
        # the run's stop rule (distbelief/stopping.py); the step limit is the workers' own (each stops at it)
        self.stop = StopRule(cfg.max_steps, cfg.max_seconds, lambda: self.clock.elapsed() if self.clock else 0.0,
                             target=cfg.target_accuracy)
        self.hooks = job.hooks.start(self, resumed=False)  # distbelief/hooks.py: tooling's way in
        self.wake = StepWake()  # when to look at the step count for the hooks' next step

    @property
    def worker_pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items() if r in self.training}

    def request_stop(self, reason: str) -> None:
        """End the run at the next supervision tick, with ``reason`` as its stop reason (as Downpour's driver: a
        test probe's way to end a run once what it waited for happened, instead of a time budget)."""
        self.stop.request(reason)

    @property
    def stop_reason(self) -> str:
        return self.stop.reason

    # ------------------------------------------------------------------ processes
    def _start_workers(self) -> None:
        job = self.job
        spec = WorkerSpec(self.cfg, job.model_fn, job.train_data, job.loss_fn, job.threads)
        if self.strategy == "hogwild":
            optimizer = make_torch_optimizer(self.cfg, self.model.parameters())
            if isinstance(optimizer, torch.optim.Adagrad):
                optimizer.share_memory()  # one set of accumulators, updated lock-free by every worker
            per_rank = [(hogwild_worker, self.model, optimizer)] * self.cfg.replicas
        else:
            port = free_port()
            per_rank = [(ddp_worker, port, self.model if r == 0 else None) for r in range(self.cfg.replicas)]
        for rank, (body, *args) in enumerate(per_rank):
            recv, send = self.ctx.Pipe(duplex=False)
            p = self.ctx.Process(target=worker_main, args=(body, rank, spec, self.progress, send, *args),
                                 name=f"distbelief-{self.strategy}-{rank}", daemon=True)
            p.start()
            send.close()  # the worker holds the only write end: EOF on recv means it is gone
            self.procs[rank], self.conns[rank] = p, recv
            self.training.add(rank)

    def _reap(self, rank: int) -> str | None:
        """Collect worker ``rank``'s report once it exited: its failure text, or None if it finished."""
        p, conn = self.procs[rank], self.conns[rank]
        p.join(self.timeout_s)
        report: dict = {}
        try:
            if conn.poll(0):
                report = conn.recv()
        except (EOFError, OSError):
            pass
        self.training.discard(rank)
        if p.exitcode == 0 and "error" not in report:
            self.reports[rank] = report
            return None
        # no report: it died before worker_main could send one (e.g. unpickling its arguments), or was killed
        return report.get("error") or f"{exit_text(p.exitcode)}, without a report (see its stderr)"

    def _collect_exits(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for workers to exit; reap those that did, counting failures as lost."""
        for rank in self._exited(timeout_s):
            err = self._reap(rank)
            if err is not None:
                self._worker_failed(rank, err)

    def _exited(self, timeout_s: float) -> list[int]:
        """Wait up to ``timeout_s`` for any training worker to exit; the ranks that did."""
        live = {self.procs[r].sentinel: r for r in self.training}
        if not live:
            return []
        return [live[s] for s in wait_any(list(live), timeout=max(0.0, timeout_s))]

    def _wait_ready(self) -> None:
        limit_s = startup_timeout_s(self.timeout_s)
        deadline = time.monotonic() + limit_s
        while any(self.progress.phase(r) != READY for r in self.training):
            for rank in self._exited(0.05):
                raise RoleFailedError(f"{self.strategy} worker {rank} failed while starting: "
                                      f"{self._reap(rank)}")
            if time.monotonic() > deadline:
                slow = [r for r in self.training if self.progress.phase(r) != READY]
                raise RemoteTimeoutError(f"{self.strategy} worker(s) {slow} not ready to train within "
                                         f"{limit_s:.0f}s (remote_timeout_s, at least 60)")

    def _stop_workers(self, timeout_s: float) -> None:
        """Ask every worker to stop and reap it; terminate any that does not stop within ``timeout_s``."""
        self.progress.stop()
        deadline = time.monotonic() + timeout_s
        for rank in sorted(self.training):
            p = self.procs[rank]
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                self.rec.log(f"{self.strategy} worker {rank} did not stop within {timeout_s:.0f}s of being "
                             f"asked (remote_timeout_s); terminating it")
                self._terminate(p)
            err = self._reap(rank)
            if err is not None and rank not in self.lost:
                self.lost[rank] = err

    @staticmethod
    def _terminate(p) -> None:
        p.terminate()
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)

    # ------------------------------------------------------------------ measurement
    def _evaluate_paused(self) -> dict:
        """Evaluate with every worker held at a step boundary and the training clock stopped: evaluation
        then neither competes with training for the cores nor counts as training time (as for sgd and
        Downpour), and it reads parameters no worker is writing."""
        self._pause_workers()
        self.clock.pause()  # after the workers stopped: finishing their last step was training
        try:
            return self._record()
        finally:
            self.clock.resume()
            self.progress.resume()

    def _pause_workers(self) -> None:
        """Request a pause and wait until every training worker holds it (or has finished). A worker that
        exits meanwhile is handled as in _supervise (a lost ddp rank fails the run, which stops the paused
        ones); one that does not reach a step boundary within remote_timeout_s is hung: terminated and
        lost."""
        generation = self.progress.request_pause()
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._collect_exits(0.0005)
            waiting = [r for r in sorted(self.training)
                       if not self.progress.paused(r, generation) and self.progress.phase(r) != DONE]
            if not waiting:
                return
            if time.monotonic() > deadline:
                for rank in waiting:
                    self._fail_hung(rank, "did not reach a step boundary to pause for evaluation")
                return

    def _record(self) -> dict:
        wall = self.clock.elapsed()  # training time: the clock is paused while the driver evaluates
        snap = self.progress.snapshot([r for r in range(self.cfg.replicas) if r not in self.lost])
        acc, test_loss, train_acc = evaluate_job(self.model, self.job)
        updates = self._updates(snap["steps"])
        rec = {
            "wall_s": round(wall, 3), "updates": updates, "examples": snap["examples"],
            "examples_per_s": rate(snap["examples"], wall), "train_loss": snap["train_loss"],
            "test_accuracy": acc, "train_accuracy": train_acc, "test_loss": test_loss,
            "replicas_alive": self.cfg.replicas - len(self.lost),
        }
        if self.strategy == "hogwild":  # one shared vector, updated by every worker's steps with some staleness
            rec.update(updates_per_shard=[updates], staleness_mean=snap["staleness_mean"],
                       staleness_max=snap["staleness_max"])
        self.rec.record(rec)
        self.stop.evaluated(acc, wall)
        self.hooks.on_evaluation(self, rec)
        return rec

    def _updates(self, steps: list[int]) -> int:
        # Hogwild: every step of every worker is one update of the shared parameters. DDP: one synchronous
        # step updates the model once (every rank applies the same averaged gradient).
        return sum(steps) if self.strategy == "hogwild" else min(steps)

    # ------------------------------------------------------------------ failures
    def _worker_failed(self, rank: int, err: str) -> None:
        self.lost[rank] = err
        self.events.append({"event": "replica lost", "id": rank, "wall_s": self.clock.elapsed(),
                            "error": err})
        first_line = err.splitlines()[0] if err else ""
        if self.strategy == "ddp":
            # every rank meets every all-reduce: without this one the others can only wait, so the run ends
            raise RoleFailedError(f"ddp rank {rank} failed ({first_line}); the other ranks cannot go on "
                                  f"without it")
        if not self.training and not self.reports:  # (a worker that finished its steps did not fail)
            raise RoleFailedError(f"every hogwild worker failed; the last, worker {rank}: {first_line}")
        # Hogwild workers are independent: the rest keep training the shared parameters
        self.rec.log(f"hogwild worker {rank} failed ({first_line}); continuing with {len(self.training)}")

    def _check_hangs(self, last: dict[int, tuple[int, float]]) -> None:
        now, steps = time.monotonic(), self.progress.steps()
        for rank in sorted(self.training):
            seen, since = last.get(rank, (-1, now))
            if steps[rank] != seen:
                last[rank] = (steps[rank], now)
            elif now - since > self.timeout_s:
                self._fail_hung(rank)

    def _fail_hung(self, rank: int, why: str = "") -> None:
        self._terminate(self.procs[rank])
        self._reap(rank)
        self._worker_failed(rank, f"made no progress for {self.timeout_s:g}s (remote_timeout_s)"
                                  f"{': ' + why if why else ''}; terminated")

    def _call_hooks(self) -> None:
        """The hooks' ``on_step`` once the run's steps (every worker's, as the driver sees them in shared memory)
        reach the step they wait for (distbelief/hooks.py)."""
        due = self.hooks.next_step()
        if due is None:
            return
        steps = self.progress.total_steps()
        self.wake.observe(steps)
        if steps >= due:
            self.hooks.on_step(self, steps)

    def kill_shard(self, shard_id: int, steps: int | None = None) -> None:
        """Nothing to kill: {hogwild, ddp} keep no parameter shards (logged)."""
        self.rec.log(f"{self.strategy} has no parameter shards; shard {shard_id} not killed")

    def kill_replica(self, rank: int, partition_id: int = -1, steps: int | None = None) -> bool:
        """SIGKILL worker ``rank``'s process, as losing its machine would. True even when it is already gone (there
        is nothing left to kill)."""
        pid = self.worker_pids.get(rank)
        if pid is not None:
            steps = self.progress.total_steps() if steps is None else steps
            self.rec.log(f"killing {self.strategy} worker {rank} at step {steps}")
            self.events.append({"event": "replica killed", "id": rank, "step": steps,
                                "wall_s": self.clock.elapsed()})
            os.kill(pid, signal.SIGKILL)
        return True

    # ------------------------------------------------------------------ the run
    def _supervise(self) -> None:
        cfg = self.cfg
        next_eval = cfg.eval_every_seconds
        schedule = EvalSchedule(cfg.eval_every_seconds, self.rec.log)
        last_progress: dict[int, tuple[int, float]] = {}
        while True:
            # a step the hooks wait for is looked at when the measured rate says it will be reached
            poll_s = min(0.25, self.wake.seconds_until(self.hooks.next_step()))
            self._collect_exits(min(next_eval - self.clock.elapsed(), poll_s))
            if not self.training:  # every worker reached max_steps (the lost ones were counted above)
                self.stop.end(stopping.STEP_LIMIT)
                return
            self._check_hangs(last_progress)
            self._call_hooks()
            if self.clock.elapsed() >= next_eval:
                t0 = time.monotonic()
                self._evaluate_paused()
                next_eval = self.clock.elapsed() + schedule.interval(time.monotonic() - t0)
                last_progress.clear()  # the workers were paused on purpose: no step then is not a hang
            if self.stop.check():
                return

    def run(self) -> tuple[RunSummary, torch.Tensor, dict | None]:
        cfg = self.cfg
        torch.set_num_threads(1)  # the driver only evaluates; leave the cores to the workers
        self.rec.log(f"{self.strategy}: starting {cfg.replicas} worker processes "
                     f"({self.ctx.get_start_method()}), {self.job.threads} torch thread(s) each, "
                     f"{cfg.optimizer} lr {cfg.lr} ({self.num_parameters:,} parameters)")
        failure: DistBeliefError | None = None
        try:
            self._start_workers()
            self._wait_ready()
            self.clock = Clock()  # like Downpour's: from the moment every worker is ready to train
            self.progress.go()
            try:
                self._supervise()
            except KeyboardInterrupt:
                self.stop.end(stopping.INTERRUPTED)
                self.rec.log("interrupted: stopping the workers, then a final evaluation")
            except DistBeliefError as e:
                failure = e
                self.stop.end(stopping.FAILED)
            # after a failure there is nothing to wait for: survivors of a broken DDP group hang or error
            self._stop_workers(5.0 if failure else self.timeout_s)
        finally:
            self.progress.stop()
            for p in self.procs.values():
                if p.is_alive():
                    self._terminate(p)
        self.clock.pause()  # the workers are gone: what follows is not training
        wall = self.clock.elapsed()
        final = self._record()
        summary = self._summary(final, wall)
        flat = flatten(self.model)  # a new vector (torch.cat copies), not a view of the shared memory
        buffers = buffers_of(self.model) or None  # copies of the shared buffers the last evaluation used
        if failure is not None:
            summary.error = str(failure)
            # the partial run is still a valid run directory
            self.rec.finish(summary.to_dict(), flat, buffers=buffers)
            raise failure
        return summary, flat, buffers

    def _summary(self, final: dict, wall: float) -> RunSummary:
        """Hogwild's workers update one shared vector (one "shard", with staleness); DDP's ranks have no owner
        of the parameters: no shards, no staleness (every rank applies the same averaged gradient). Neither
        restarts a worker nor refuses a gradient: those fields do not apply."""
        cfg = self.cfg
        steps = self.progress.steps()
        updates = self._updates(steps)
        summary = RunSummary(
            strategy=self.strategy,
            runtime="torch.multiprocessing" if self.strategy == "hogwild" else "torch.distributed (gloo)",
            replicas=cfg.replicas, num_parameters=self.num_parameters,
            **self.stop.outcome_fields(final["test_accuracy"], final["examples"], wall),
            updates=updates, steps_per_replica=steps,
            events=self.events, threads=self.job.threads, start_method=self.ctx.get_start_method(), partitions=1,
            optimizer=cfg.optimizer, replicas_lost=len(self.lost),
        )
        if self.strategy == "hogwild":
            summary.shards, summary.updates_per_shard = 1, [updates]
            summary.staleness_mean, summary.staleness_max = final["staleness_mean"], final["staleness_max"]
        else:
            digests = [self.reports.get(r, {}).get("param_digest") for r in range(cfg.replicas)]
            summary.global_batch_size = cfg.replicas * cfg.batch_size
            summary.rank_param_digests = digests
            # every rank's final bits, and the driver's view of rank 0's shared parameters, are the same
            summary.ranks_in_sync = (None if None in digests
                                     else len(set(digests + [param_digest(self.model)])) == 1)
        return summary

def run_hogwild(job, recorder: RunRecorder) -> tuple[RunSummary, torch.Tensor, dict | None]:
    """Hogwild! over ``job.cfg.replicas`` processes sharing the parameters (and module buffers) lock-free.
    Returns (summary, flat, buffers): buffers None where the model has none.

    Raises RoleFailedError / RemoteTimeoutError naming the worker when a worker fails to start, or when every
    worker has failed (the run directory is still written). The user's script needs the usual
    ``if __name__ == "__main__":`` guard: workers are started with forkserver or spawn.
    """
    return MultiprocessRun(job, recorder, "hogwild").run()


def run_ddp(job, recorder: RunRecorder) -> tuple[RunSummary, torch.Tensor, dict | None]:
    """Synchronous data parallelism with DistributedDataParallel (gloo, CPU) over ``job.cfg.replicas`` ranks
    on this machine. Returns (summary, flat, buffers) with rank 0's final parameters and module buffers (None
    where the model has none).

    Raises RoleFailedError / RemoteTimeoutError naming the rank when any rank fails or hangs (the run
    directory is still written with the partial results).
    """
    return MultiprocessRun(job, recorder, "ddp").run()
