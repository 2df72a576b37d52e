"""Process plumbing of the hogwild / ddp driver: the start method, what must pickle to reach a worker, a free
port for DDP's rendezvous, and how a worker's exit reads."""

from __future__ import annotations

import pickle
import signal
import socket

import torch.multiprocessing as mp

from distbelief.exceptions import ConfigError


def context(preload: list[str]):
    """The start method's context; a forkserver imports torch and ``preload`` (the workers' modules) once."""
    # forkserver: a worker forks from a server that imported torch once (~0.1 s per worker instead of ~2 s for
    # a fresh interpreter), and unlike fork it is safe when the driver has threads (Ray, gloo, progress bar).
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch._dynamo", *preload])
        return ctx
    return mp.get_context("spawn")


def check_picklable(job) -> None:
    """Refuse, naming it, a model, loss or data factory that cannot travel to a worker process."""
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for DDP's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_text(code: int | None) -> str:
    """How a process's exit code reads: ``killed by SIGKILL``, ``exit code 1``."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
