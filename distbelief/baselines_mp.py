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
and summary fields are Downpour's.
Workers are torch.multiprocessing processes, not Ray roles (nothing here imports ray).
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait as wait_any
from typing import Any, Callable

import numpy as np
import torch
import torch.multiprocessing as mp

from distbelief.baselines import make_torch_optimizer
from distbelief.data.batches import BatchSource, replica_indices
from distbelief.evaluation import evaluate_job
from distbelief.exceptions import ConfigError, DistBeliefError, RemoteTimeoutError, RoleFailedError
from distbelief.metrics import Clock, EvalSchedule, RunRecorder
from distbelief.ps.sharding import flatten

# Worker phases, written by the worker into its row of SharedProgress.
STARTING, READY, DONE = 0, 1, 2
# Columns of a worker's row; _PAUSED holds the pause generation the worker is paused for (0 while it trains).
_STEPS, _EXAMPLES, _STALE_SUM, _STALE_MAX, _PHASE, _PAUSED = range(6)
# The driver's flags; _PAUSE and _RESUME are generations: a pause is requested while _PAUSE > _RESUME.
_GO, _STOP, _PAUSE, _RESUME = range(4)
_MESSAGE_CHARS = 8000  # a worker's error text must fit a pipe buffer, or its send would block its exit


def startup_timeout_s(remote_timeout_s: float) -> float:
    # Starting a process and importing torch is not a remote call: on a busy machine it takes seconds even
    # when remote_timeout_s is set short to catch hung steps quickly.
    return max(remote_timeout_s, 60.0)


def pause_timeout_s(remote_timeout_s: float) -> float:
    # A paused worker waits for the driver's evaluation, which is local work sized by the test set, not a
    # remote call: a short remote_timeout_s (set to catch hung steps) must not fail a run whose evaluation
    # takes a while.
    return max(remote_timeout_s, 300.0)


class SharedProgress:
    """Per-worker progress in shared memory: each worker writes only its own row, lock-free; the driver reads.

    Rows hold steps, examples, staleness sum and max, the phase and the pause the worker is holding;
    ``loss_ema`` the worker's training loss (an EMA, NaN before its first step); ``flags`` the driver's go,
    stop, pause and resume signals. It crosses to a worker by pickling: torch.multiprocessing passes the
    shared tensors by handle, not by copy. Thread/process safety: a single writer per row; readers may see a
    row mid-update (one counter ahead of another), never a torn value.
    """

    def __init__(self, num_workers: int):
        self.counts = torch.zeros(num_workers, 6, dtype=torch.int64).share_memory_()
        self.loss_ema = torch.full((num_workers,), math.nan, dtype=torch.float64).share_memory_()
        self.flags = torch.zeros(4, dtype=torch.int64).share_memory_()
        self._views()

    def _views(self) -> None:
        # numpy views of the same memory: a scalar write costs ~0.1 us, a tensor __setitem__ several us
        self._c, self._loss, self._flags = self.counts.numpy(), self.loss_ema.numpy(), self.flags.numpy()

    def __getstate__(self) -> dict:
        return {"counts": self.counts, "loss_ema": self.loss_ema, "flags": self.flags}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._views()

    # ------------------------------------------------------------------ worker side
    def mark(self, rank: int, phase: int) -> None:
        self._c[rank, _PHASE] = phase

    def count_step(self, rank: int, examples: int, loss: float, staleness: int) -> None:
        row = self._c[rank]
        row[_EXAMPLES] += examples
        row[_STALE_SUM] += staleness
        row[_STALE_MAX] = max(row[_STALE_MAX], staleness)
        prev = self._loss[rank]
        self._loss[rank] = loss if math.isnan(prev) else 0.9 * prev + 0.1 * loss
        row[_STEPS] += 1  # last: a reader that sees the step also sees its examples

    def total_steps(self) -> int:
        return int(self._c[:, _STEPS].sum())

    def stop_requested(self) -> bool:
        return bool(self._flags[_STOP])

    def pause_requested(self) -> bool:
        return bool(self._flags[_PAUSE] > self._flags[_RESUME])

    def hold_pause(self, rank: int, timeout_s: float) -> None:
        """Called at a step boundary once a pause is requested (DDP: agreed by every rank): report paused and
        wait until the driver resumes or stops the run, or is gone, so the driver evaluates on idle cores and
        parameters that no one writes. Raises if the driver neither resumes nor stops it within
        ``timeout_s``."""
        generation = int(self._flags[_PAUSE])
        self._c[rank, _PAUSED] = generation
        deadline = time.monotonic() + timeout_s
        try:
            while self._flags[_RESUME] < generation and not self._flags[_STOP] and _driver_alive():
                if time.monotonic() > deadline:
                    raise RemoteTimeoutError(f"worker {rank} was paused for evaluation and not resumed "
                                             f"within {timeout_s:.0f}s (remote_timeout_s, at least 300)")
                time.sleep(0.0005)
        finally:
            self._c[rank, _PAUSED] = 0

    def wait_go(self, rank: int, timeout_s: float) -> bool:
        """Block until the driver says go (True) or stop (False); raise if neither comes in time."""
        deadline = time.monotonic() + timeout_s
        while not self._flags[_GO]:
            if self._flags[_STOP] or not _driver_alive():
                return False
            if time.monotonic() > deadline:
                raise RemoteTimeoutError(f"worker {rank} waited {timeout_s:.0f}s for the driver to start "
                                         f"training (remote_timeout_s, at least 60)")
            time.sleep(0.001)
        return not self._flags[_STOP]

    # ------------------------------------------------------------------ driver side
    def go(self) -> None:
        self._flags[_GO] = 1

    def stop(self) -> None:
        self._flags[_STOP] = 1

    def request_pause(self) -> int:
        """Ask every worker to pause at its next step boundary; the generation to wait for in ``paused``."""
        generation = int(self._flags[_PAUSE]) + 1
        self._flags[_PAUSE] = generation
        return generation

    def resume(self) -> None:
        self._flags[_RESUME] = self._flags[_PAUSE]

    def paused(self, rank: int, generation: int) -> bool:
        return int(self._c[rank, _PAUSED]) == generation

    def phase(self, rank: int) -> int:
        return int(self._c[rank, _PHASE])

    def steps(self) -> list[int]:
        return [int(s) for s in self._c[:, _STEPS]]

    def snapshot(self, ranks: list[int]) -> dict[str, Any]:
        """Totals over all workers (counts include lost workers' steps: their updates are in the parameters);
        the training loss is the mean of the EMAs of ``ranks`` (the workers not lost)."""
        c = self._c.copy()
        losses = [float(self._loss[r]) for r in ranks if not math.isnan(self._loss[r])]
        steps = int(c[:, _STEPS].sum())
        return {
            "steps": [int(s) for s in c[:, _STEPS]], "examples": int(c[:, _EXAMPLES].sum()),
            "train_loss": sum(losses) / len(losses) if losses else None,
            "staleness_mean": float(c[:, _STALE_SUM].sum()) / steps if steps else 0.0,
            "staleness_max": int(c[:, _STALE_MAX].max()) if len(c) else 0,
        }


def _driver_alive() -> bool:
    parent = mp.parent_process()  # the driver, for spawn and forkserver children alike
    return parent is None or parent.is_alive()


@dataclass
class WorkerSpec:
    """What every worker needs (picklable: it travels to each worker process)."""

    cfg: Any  # RunConfig
    model_fn: Callable[[], torch.nn.Module]
    train_data: Any  # Dataset or zero-arg factory, materialized in the worker
    loss_fn: Callable
    threads: int


def worker_batches(spec: WorkerSpec, rank: int) -> BatchSource:
    """Worker ``rank``'s minibatches over its own subset of the training data."""
    from distbelief.job import materialize

    cfg = spec.cfg
    ds = materialize(spec.train_data)
    # The subset is a set; sorted, a single worker's subset is the whole dataset in order, so a 1-worker run
    # draws exactly the batches of --strategy sgd (same seed) -- the exact oracle for DDP with one rank.
    idx = np.sort(replica_indices(len(ds), cfg.replicas, rank, cfg.seed))
    return BatchSource(ds, idx, cfg.batch_size, seed=cfg.seed * 7919 + rank)


def _worker_main(body: Callable, rank: int, spec: WorkerSpec, progress: SharedProgress, conn, *args) -> None:
    """Process entry point: run ``body``, report its outcome on ``conn`` (this worker's own one-way pipe)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the driver stops us
    try:
        # torch.optim imports torch._dynamo on first use (~1.5 s): do it before the worker reports ready, or
        # the clock would measure an import (a no-op where the forkserver preloaded it)
        import torch._dynamo  # noqa: F401

        torch.set_num_threads(spec.threads)
        report = body(rank, spec, progress, *args) or {}
        conn.send(report)
        progress.mark(rank, DONE)
        code = 0
    except BaseException as e:  # noqa: BLE001 - whatever killed the worker is reported to the driver
        conn.send({"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"[-_MESSAGE_CHARS:]})
        code = 1
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without running destructors: tearing down a gloo process group can deadlock (torch 2.13: its
    # worker thread frees a finished work and needs the GIL, which the main thread holds while joining it).
    # Nothing needs cleaning up: sockets and shared-memory mappings go with the process.
    os._exit(code)


# ====================================================================== Hogwild!
def hogwild_worker(rank: int, spec: WorkerSpec, progress: SharedProgress, model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer) -> dict:
    """Train the shared ``model`` lock-free with the shared ``optimizer`` until max_steps or the stop flag."""
    cfg = spec.cfg
    # The optimizer arrived in the same pickle as the model, so its parameters are the model's shared tensors.
    assert optimizer.param_groups[0]["params"][0] is next(model.parameters())
    torch.manual_seed(cfg.seed + 1009 * (rank + 1))  # dropout etc. differ per worker, as Downpour's replicas
    batches = worker_batches(spec, rank)
    progress.mark(rank, READY)
    if not progress.wait_go(rank, startup_timeout_s(cfg.remote_timeout_s)):
        return {}
    step, next_check = 0, time.monotonic() + 1.0
    while not (cfg.max_steps and step >= cfg.max_steps) and not progress.stop_requested():
        if progress.pause_requested():  # the driver evaluates: hold still at this step boundary
            progress.hold_pause(rank, pause_timeout_s(cfg.remote_timeout_s))
            continue  # the run may have been stopped meanwhile
        seen = progress.total_steps()
        x, y = batches.next_batch()
        optimizer.zero_grad(set_to_none=False)  # .grad is this process's own memory; the values are shared
        loss = spec.loss_fn(model(x), y)
        loss.backward()
        # staleness: updates other workers applied while this gradient was computed (Hogwild reads as it goes)
        staleness = progress.total_steps() - seen
        optimizer.step()  # in place on the shared parameters (and Adagrad's shared sums), no lock
        step += 1
        progress.count_step(rank, len(y), loss.item(), staleness)
        if time.monotonic() > next_check:  # an orphan must not train forever
            if not _driver_alive():
                break
            next_check = time.monotonic() + 1.0
    return {"steps": step}


# ====================================================================== DDP
def _loopback_interface() -> str | None:
    # gloo binds to the interface of the host name by default, which fails where the name does not resolve
    # (containers); every rank is on this machine, so loopback always works.
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), None)


def ddp_worker(rank: int, spec: WorkerSpec, progress: SharedProgress, port: int,
               model: torch.nn.Module | None) -> dict:
    """One DDP rank. Rank 0 trains ``model`` (the driver's shared-memory copy), the others their own copy,
    which DDP overwrites with rank 0's parameters when it wraps it."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    cfg = spec.cfg
    if "GLOO_SOCKET_IFNAME" not in os.environ and (lo := _loopback_interface()):
        os.environ["GLOO_SOCKET_IFNAME"] = lo
    # The rendezvous waits for the slowest rank to start; hung collectives are the driver's to catch (it
    # terminates a rank without progress for remote_timeout_s). No destroy_process_group: see _worker_main.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cfg.replicas,
                            timeout=timedelta(seconds=startup_timeout_s(cfg.remote_timeout_s)))
    if model is None:
        model = spec.model_fn()
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters and buffers to every rank
    torch.manual_seed(cfg.seed + 1009 * (rank + 1))  # dropout etc. differ per rank
    optimizer = make_torch_optimizer(cfg, ddp.parameters())
    batches = worker_batches(spec, rank)
    progress.mark(rank, READY)
    if not progress.wait_go(rank, startup_timeout_s(cfg.remote_timeout_s)):
        return {}
    signals = torch.zeros(2, dtype=torch.int64)  # [stop, pause], agreed by every rank each step
    step = 0
    while not (cfg.max_steps and step >= cfg.max_steps):
        # Every rank must stop or pause after the same step, or the others would wait in the next all-reduce:
        # agree on the driver's flags with a 2-element all-reduce that overlaps this step's compute.
        signals[0] = int(progress.stop_requested() or not _driver_alive())
        signals[1] = int(progress.pause_requested())
        agreed = dist.all_reduce(signals, op=dist.ReduceOp.MAX, async_op=True)
        x, y = batches.next_batch()
        optimizer.zero_grad(set_to_none=False)
        loss = spec.loss_fn(ddp(x), y)
        loss.backward()  # DDP averages the gradients over the ranks, bucket by bucket, during backward
        optimizer.step()  # the same averaged gradient on every rank: the ranks' parameters stay identical
        step += 1
        progress.count_step(rank, len(y), loss.item(), 0)
        agreed.wait()
        if signals[0]:
            break
        if signals[1]:
            # No break on a stop seen while paused: the ranks agree on it at the next step, all together.
            progress.hold_pause(rank, pause_timeout_s(cfg.remote_timeout_s))
    return {"steps": step, "param_digest": param_digest(model)}


def param_digest(model: torch.nn.Module) -> str:
    """A digest of the exact bits of the model's parameters (compares ranks without moving their vectors)."""
    return hashlib.sha256(flatten(model).numpy().tobytes()).hexdigest()


# ====================================================================== the driver
def _context():
    # forkserver: a worker forks from a server that imported torch once (~0.1 s per worker instead of ~2 s for
    # a fresh interpreter), and unlike fork it is safe when the driver has threads (Ray, gloo, progress bar).
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch._dynamo", __name__])
        return ctx
    return mp.get_context("spawn")


def _check_picklable(job) -> None:
    # Workers start with forkserver/spawn, so what they run travels by (standard) pickle: refuse a lambda or a
    # local function here, naming it, rather than with a traceback from inside Process.start().
    from torch.utils.data import Dataset

    for name, obj in (("model", job.model_fn), ("loss_fn", job.loss_fn), ("train_data", job.train_data)):
        if name == "train_data" and (isinstance(obj, Dataset) or not callable(obj)):
            continue  # a dataset crosses by torch.multiprocessing's pickler (its tensors by shared memory)
        try:
            pickle.dumps(obj)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise ConfigError(name, f"{job.cfg.strategy} workers are separate processes, so this must be "
                                    f"picklable (a module-level function or functools.partial, not a lambda "
                                    f"or a local function): {e}") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class MultiprocessRun:
    """Drives one hogwild or ddp run: starts the workers, evaluates, enforces the stop conditions, handles
    deaths and hangs, writes the metrics. Callbacks ``f(run, record)`` see ``run.worker_pids`` (tests and
    demos)."""

    def __init__(self, job, recorder: RunRecorder, strategy: str, callbacks: list | None = None):
        self.job, self.rec, self.strategy = job, recorder, strategy
        self.cfg = cfg = job.cfg
        self.callbacks = list(callbacks or [])
        self.timeout_s = cfg.remote_timeout_s
        self.ctx = _context()
        self.progress = SharedProgress(cfg.replicas)
        torch.manual_seed(cfg.seed)  # the same initial parameters as --strategy sgd
        self.model = job.model_fn()
        self.model.share_memory()  # the workers (hogwild) or rank 0 (ddp) update these very tensors in place
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        _check_picklable(job)
        self.procs: dict[int, Any] = {}
        self.conns: dict[int, Any] = {}
        self.reports: dict[int, dict] = {}
        self.training: set[int] = set()  # started, neither finished nor lost
        self.lost: dict[int, str] = {}
        self.events: list[dict] = []
        self.clock: Clock | None = None
        self.best, self.time_to_target, self.stop_reason = -1.0, None, ""
        self._killed_once = False

    @property
    def worker_pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items() if r in self.training}

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
            port = _free_port()
            per_rank = [(ddp_worker, port, self.model if r == 0 else None) for r in range(self.cfg.replicas)]
        for rank, (body, *args) in enumerate(per_rank):
            recv, send = self.ctx.Pipe(duplex=False)
            p = self.ctx.Process(target=_worker_main, args=(body, rank, spec, self.progress, send, *args),
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
        # no report: it died before _worker_main could send one (e.g. unpickling its arguments), or was killed
        return report.get("error") or f"{_exit_text(p.exitcode)}, without a report (see its stderr)"

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
            "wall_s": round(wall, 3), "updates": updates, "updates_per_shard": [updates],
            "examples": snap["examples"], "examples_per_s": snap["examples"] / wall if wall > 0 else 0.0,
            "train_loss": snap["train_loss"], "test_accuracy": acc, "train_accuracy": train_acc,
            "test_loss": test_loss,
            "staleness_mean": snap["staleness_mean"], "staleness_max": snap["staleness_max"],
            "replicas_alive": self.cfg.replicas - len(self.lost),
        }
        self.rec.record(rec)
        self.best = max(self.best, acc)
        if self.cfg.target_accuracy and acc >= self.cfg.target_accuracy and self.time_to_target is None:
            self.time_to_target = wall
        for callback in self.callbacks:
            callback(self, rec)
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
        if not self.training:
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

    def _kill_pending(self) -> bool:
        return bool(self.job.faults.kill_replica_at_step) and not self._killed_once

    def _maybe_inject_fault(self) -> None:
        """Kill worker kill_replica_id once the run's steps (every worker's, as the driver sees them) reach
        kill_replica_at_step: a step count, unlike a time, puts the kill at the same point of every run."""
        faults = self.job.faults
        steps = self.progress.total_steps()
        if not self._kill_pending() or steps < faults.kill_replica_at_step:
            return
        self._killed_once = True
        pid = self.worker_pids.get(faults.kill_replica_id)
        if pid is not None:
            self.rec.log(f"fault injection: killing {self.strategy} worker {faults.kill_replica_id} at step "
                         f"{steps}")
            self.events.append({"event": "replica killed", "id": faults.kill_replica_id, "step": steps,
                                "wall_s": self.clock.elapsed()})
            os.kill(pid, signal.SIGKILL)

    # ------------------------------------------------------------------ the run
    def _supervise(self) -> None:
        cfg = self.cfg
        next_eval = cfg.eval_every_seconds
        schedule = EvalSchedule(cfg.eval_every_seconds, self.rec.log)
        last_progress: dict[int, tuple[int, float]] = {}
        while True:
            poll_s = 0.005 if self._kill_pending() else 0.25  # a pending kill watches the step count closely
            self._collect_exits(min(next_eval - self.clock.elapsed(), poll_s))
            if not self.training:  # every worker reached max_steps (the lost ones were counted above)
                self.stop_reason = "step limit reached"
                return
            self._check_hangs(last_progress)
            self._maybe_inject_fault()
            if self.clock.elapsed() >= next_eval:
                t0 = time.monotonic()
                self._evaluate_paused()
                next_eval = self.clock.elapsed() + schedule.interval(time.monotonic() - t0)
                last_progress.clear()  # the workers were paused on purpose: no step then is not a hang
            if self.time_to_target is not None:
                self.stop_reason = "target accuracy reached"
                return
            if cfg.max_seconds and self.clock.elapsed() >= cfg.max_seconds:
                self.stop_reason = "time budget spent"
                return

    def run(self) -> tuple[dict, torch.Tensor]:
        cfg = self.cfg
        torch.set_num_threads(1)  # the driver only evaluates; leave the cores to the workers
        self.rec.log(f"{self.strategy}: starting {cfg.replicas} worker processes "
                     f"({self.ctx.get_start_method()}), {self.job.threads} torch thread(s) each, "
                     f"{cfg.server_optimizer} lr {cfg.lr} ({self.num_parameters:,} parameters)")
        failure: DistBeliefError | None = None
        try:
            self._start_workers()
            self._wait_ready()
            self.clock = Clock()  # like Downpour's: from the moment every worker is ready to train
            self.progress.go()
            try:
                self._supervise()
            except KeyboardInterrupt:
                self.stop_reason = "interrupted"
                self.rec.log("interrupted: stopping the workers, then a final evaluation")
            except DistBeliefError as e:
                failure = e
                self.stop_reason = "failed"
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
        if failure is not None:
            summary["error"] = str(failure)
            self.rec.finish(summary, flat)  # the partial run is still a valid run directory
            raise failure
        return summary, flat

    def _summary(self, final: dict, wall: float) -> dict:
        cfg = self.cfg
        steps = self.progress.steps()
        updates = self._updates(steps)
        summary = {
            "strategy": self.strategy,
            "runtime": "torch.multiprocessing" if self.strategy == "hogwild" else "torch.distributed (gloo)",
            "start_method": self.ctx.get_start_method(),
            "replicas": cfg.replicas, "shards": 1 if self.strategy == "hogwild" else 0,
            "server_optimizer": cfg.server_optimizer, "threads": self.job.threads,
            "num_parameters": self.num_parameters,
            "final_test_accuracy": final["test_accuracy"],
            "best_test_accuracy": max(self.best, final["test_accuracy"]),
            "target_accuracy": cfg.target_accuracy or None, "time_to_target_s": self.time_to_target,
            "examples": final["examples"], "examples_per_s": final["examples"] / wall if wall > 0 else 0.0,
            "updates": updates, "updates_per_shard": [updates], "steps_per_replica": steps,
            "staleness_mean": final["staleness_mean"], "staleness_max": final["staleness_max"],
            "rejected_pushes": 0, "replica_restarts": 0, "replicas_lost": len(self.lost),
            "events": self.events, "stop_reason": self.stop_reason, "wall_s": wall, "partitions": 1,
        }
        if self.strategy == "ddp":
            digests = [self.reports.get(r, {}).get("param_digest") for r in range(cfg.replicas)]
            summary["global_batch_size"] = cfg.replicas * cfg.batch_size
            summary["rank_param_digests"] = digests
            # every rank's final bits, and the driver's view of rank 0's shared parameters, are the same
            summary["ranks_in_sync"] = (None if None in digests
                                        else len(set(digests + [param_digest(self.model)])) == 1)
        return summary


def run_hogwild(job, recorder: RunRecorder, callbacks: list | None = None) -> tuple[dict, torch.Tensor]:
    """Hogwild! over ``job.cfg.replicas`` processes sharing the parameters lock-free. Returns (summary, flat).

    Raises RoleFailedError / RemoteTimeoutError naming the worker when a worker fails to start, or when every
    worker has failed (the run directory is still written). The user's script needs the usual
    ``if __name__ == "__main__":`` guard: workers are started with forkserver or spawn.
    """
    return MultiprocessRun(job, recorder, "hogwild", callbacks).run()


def run_ddp(job, recorder: RunRecorder, callbacks: list | None = None) -> tuple[dict, torch.Tensor]:
    """Synchronous data parallelism with DistributedDataParallel (gloo, CPU) over ``job.cfg.replicas`` ranks
    on this machine. Returns (summary, flat) with rank 0's final parameters.

    Raises RoleFailedError / RemoteTimeoutError naming the rank when any rank fails or hangs (the run
    directory is still written with the partial results).
    """
    return MultiprocessRun(job, recorder, "ddp", callbacks).run()
