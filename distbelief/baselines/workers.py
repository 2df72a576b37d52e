"""What runs in a hogwild or ddp worker process: the process entry point, each strategy's training loop, and
the timeouts a worker waits for its driver under.

Workers start with forkserver or spawn: everything a worker runs is importable at module level here, and what it
receives (``WorkerSpec``, the shared model and progress block) travels by pickle.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import torch

from distbelief.baselines.progress import DONE, READY, SharedProgress, driver_alive
from distbelief.baselines.single import make_torch_optimizer
from distbelief.data.batches import BatchSource, replica_indices
from distbelief.ps.sharding import flatten

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


def worker_main(body: Callable, rank: int, spec: WorkerSpec, progress: SharedProgress, conn, *args) -> None:
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
            if not driver_alive():
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
    # terminates a rank without progress for remote_timeout_s). No destroy_process_group: see worker_main.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cfg.replicas,
                            timeout=timedelta(seconds=startup_timeout_s(cfg.remote_timeout_s)))
    if model is None:
        model = spec.model_fn()
    # broadcasts rank 0's parameters and buffers to every rank now, and rank 0's buffers again at every forward
    # (broadcast_buffers): rank 0's, in the driver's shared-memory model, are the run's (BatchNorm statistics)
    ddp = DistributedDataParallel(model)
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
        signals[0] = int(progress.stop_requested() or not driver_alive())
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
