"""Measure the simulator's costs (simulate/costs.py) on this machine, with the project's own code paths.

``calibrate(path, links=..., quick=..., log=...)`` times, in this order:

- a replica's gradient step (``WholeModel.gradient`` with one torch thread, as a replica runs) on shipped
  models of every layer kind at two minibatch sizes, and fits ``step_s``, ``example_s`` and ``macs_per_s`` to
  the step times (``fit_steps``); ``compute_cv`` is their spread, ``thread_efficiency`` what a second thread
  gains on the largest dense one; every step timed is also kept as that model's own (``step_measured``, read
  instead of the fit for those models), with the paper's speech model's step at its default minibatch;
- two replicas' co-located steps at once (gradient, push, copy), each in a thread with a model and shard of its
  own, against one alone: ``contention``;
- a parameter shard's push (``ParameterShard.push``: its checks and the rule's update) per value, for SGD and
  Adagrad, and its answer to a delta fetch (``fetch(since=...)``) per value of its range;
- the same shard under top-k pushes from two replicas in turn, each push followed by that replica's delta fetch
  (``measure_sparse``): per value a push carries, and per value a fetch answers from the shard's change log;
- one copy of a large float32 buffer (what the shared-memory plane does to a push or a fetch);
- a replica's gloo stream to a shard, both ends in this process over loopback: the CPU per byte each end spends;
- every compression scheme on the Fig. 4 model's gradient in two shard ranges: the replica's compression with
  error feedback (``ErrorFeedback.compress``) and the shards' decode, per value;
- Ray actor calls with a tiny argument and a tiny or large reply (the runtime's ``RoleActor.call``, on a local
  Ray): the tiny call's time, and the CPU each costs the machine (the large replies go through the node's object
  store);
- two replicas' top-k pushes answered by delta fetches through two real shard actors and the product's client
  (``measure_compressed``): the replica's CPU to write an answer into its parameters, per value, and what each
  such call costs it beyond a plain call;
- Ray's object store between two nodes of a fake cluster (``local_cluster.fake_cluster``: two raylets on this
  machine, so objects move between two object stores, over loopback): the fetch times of objects of a few
  sizes fitted to ``objstore_call_s + bytes / objstore_bytes_per_s`` (``fit_transfers``), and the CPU that
  the processes at both ends spent per byte;
- with ``links=True`` (root, Linux): the same fetches between the two nodes of a shaped cluster
  (``runtime/netcluster.py``) at 1 Gbit/s, for ``link_efficiency``.

The shard's work, the copy and the codecs are each timed right after a gradient step of the Fig. 4 model
(``cache_evictor``), as a run meets them: in a tight loop their arrays stay in the caches and they look up to
1.7 times faster than in a run.

The actor calls and the compressed calls share one local Ray instance (``probes.local_ray``: starting one costs
several seconds of CPU). Every Ray instance and cluster started here is shut down before ``calibrate`` returns,
on error too. The fits are pure functions (``least_squares``, ``fit_steps``, ``fit_transfers``,
``thread_efficiency``); the medians they read are kept in ``Costs.measurements``, each with what the fitted
costs say beside it, so a reader can check a fit.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import itertools
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from distbelief.simulate.costs import KINDS, Costs

Log = Callable[[str], None]

# (model, task, classes): every layer kind, and three dense models whose output layers (the loss's elementwise
# work) and hidden layers differ in size, so that each kind's rate can be told apart
STEP_MODELS = (("speech-tiny", "speech", 8192), ("speech-small", "speech", 256), ("mlp", "mnist1d", 10),
               ("lc-image-small", "shapes", 8), ("cnn", "mnist1d", 10))
# Timed for their own step too (their time is read directly, not from the fit): the paper's speech model at its
# default minibatch (the smaller models' fit put its step at about half its time)
OWN_STEP_MODELS = (("speech-paper", "speech", 8192, 32),)
STEP_BATCHES = (32, 128, 256)  # Downpour's default minibatch, the Fig. 4 recipe's, one towards Sandblaster's portions
STEP_BLOCK = 5  # steps of one model timed in a row (after one untimed), as a replica repeats its step
RULES = ("sgd", "adagrad")
SCHEMES = ("fp16", "topk", "qsgd", "powersgd")
COPY_BYTES = 32 * 2**20
# Object sizes through the object store: ~200 KB (over the inline limit of the calibration's Ray, its default
# 100 KiB, so it goes through the store) shows the fixed cost, 1 MiB and 8 MiB the rate.
OBJSTORE_SIZES = (200_000, 2**20, 8 * 2**20)
# Replies of Ray actor calls on one node through its object store: a top-k part's size and a Fig. 4 shard's
CALL_SIZES = (240_000, 4 * 2**20)
# From 1 MiB (a Fig. 4 shard's float16 answer) up to 64 MiB, so that the fitted rate covers parts as large as a
# big model's (the paper model's are 84 MB). One object at a time, one way, a 64 MiB one crosses a 1 Gbit/s link
# at about 0.94 Gbit/s; that such parts wait longer in a run is the object plane's doing when a node sends and
# receives at once (simulate/engine.py).
LINK_SIZES = (2**20, 4 * 2**20, 8 * 2**20, 64 * 2**20)
LINK_BANDWIDTH = "1gbit"
LINK_CLUSTER = ("dbcal", "10.78.0")  # name and subnet of the shaped cluster: never a user's (dbnet, 10.77.0)
DELTA_CHANGED = 0.01  # share of a delta fetch's range changed since the fetch it answers (top-k's default)


@dataclass(frozen=True)
class Effort:
    """How many timed runs each measurement takes (after ``warmup`` untimed ones; the median is kept), and the
    size of the shard timed."""

    step: int
    shard: int
    codec: int
    call: int
    objects: int  # objects fetched per size
    warmup: int
    shard_values: int
    layout_s: float = 8.0  # seconds of training per Downpour run of ``measure_layout``
    layout_rounds: int = 2  # runs of each layout, in turns


# a shard of 1 Mi values (4 MiB, about a Fig. 4 shard's 1.14 M): what a shard's update costs depends on whether its
# range stays in the caches, so it is timed at the size shards have in the runs it predicts
FULL = Effort(step=15, shard=15, codec=7, call=200, objects=48, warmup=2, shard_values=2**20)
QUICK = Effort(step=4, shard=4, codec=3, call=50, objects=5, warmup=1, shard_values=2**20, layout_s=2.0,
               layout_rounds=1)


# ------------------------------------------------------------------------------------------------------ fits


@dataclass(frozen=True)
class StepPoint:
    """One measured replica step: ``batch`` examples of a model with forward multiply-adds ``macs`` per
    example by layer kind (``profile_model``), ``seconds`` per step."""

    batch: int
    macs: dict[str, float]
    seconds: float


class NoPositiveFit(ValueError):
    """The measurements admit no fit with every coefficient of the right sign: noise outweighed what they
    measure (timing them again, with more repeats, is the remedy)."""


def least_squares(rows: Sequence[Sequence[float]], seconds: Sequence[float], names: Sequence[str],
                  may_be_zero: Sequence[str] = ()) -> dict[str, float]:
    """The coefficients (by ``names``) that make ``rows @ coefficients`` closest to ``seconds`` in relative
    error (each measurement weighs as much as any other, however short), every one > 0 except those named in
    ``may_be_zero``, which are >= 0.

    The sign constraint is met exactly: every way of holding some of ``may_be_zero`` at 0 is solved and the
    feasible one with the smallest error is kept (a constrained optimum is the unconstrained optimum of the
    coefficients it leaves free).

    Raises:
        ValueError: lengths that do not match, a time not finite and > 0, fewer measurements than
            coefficients, a coefficient the measurements cannot tell from the others (named), or no fit with
            every coefficient of the right sign (NoPositiveFit).
    """
    names = list(names)
    a = np.asarray(rows, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != t.size or a.shape[1] != len(names):
        raise ValueError(f"need one row of {len(names)} values ({', '.join(names)}) per time; got rows of "
                         f"shape {a.shape} for {t.size} times")
    if not (np.isfinite(t).all() and (t > 0).all() and np.isfinite(a).all()):
        raise ValueError("every time must be finite and > 0, and every row finite")
    unknown = [n for n in may_be_zero if n not in names]
    if unknown:
        raise ValueError(f"may_be_zero names {', '.join(unknown)}, not among {', '.join(names)}")
    if t.size < len(names):
        raise ValueError(f"{t.size} measurements cannot fix {len(names)} coefficients ({', '.join(names)})")
    _check_separable(a, names)
    w = a / t[:, None]  # relative error: (rows @ x - t) / t = w @ x - 1
    scale = np.abs(w).max(axis=0)  # columns of one size for the solver
    best: tuple[float, np.ndarray] | None = None
    for k in range(len(may_be_zero) + 1):
        for zeros in itertools.combinations(may_be_zero, k):
            free = [i for i, n in enumerate(names) if n not in zeros]
            x = np.zeros(len(names))
            x[free] = np.linalg.lstsq(w[:, free] / scale[free], np.ones(t.size), rcond=None)[0] / scale[free]
            err = float(np.sum((w @ x - 1) ** 2))
            if (x[free] > 0).all() and (best is None or err < best[0]):  # the others are 0: allowed
                best = (err, x)
    if best is None:
        raise NoPositiveFit(f"no fit of {', '.join(names)} with positive coefficients: the times do not grow "
                         f"with the work (too noisy, or too few repeats)")
    return dict(zip(names, best[1].tolist(), strict=True))


def _check_separable(a: np.ndarray, names: list[str]) -> None:
    """ValueError naming the first coefficient whose column the columns before it already explain."""
    peak = np.abs(a).max(axis=0)
    norm = a / np.where(peak > 0, peak, 1.0)
    for j, name in enumerate(names):
        if peak[j] == 0:
            raise ValueError(f"no measurement exercises {name} (its column is all zero)")
        if np.linalg.matrix_rank(norm[:, : j + 1]) <= j:
            raise ValueError(f"the measurements cannot tell {name} from {', '.join(names[:j])}: vary what "
                             f"they multiply independently")


def fit_steps(points: Sequence[StepPoint]) -> tuple[float, float, dict[str, float]]:
    """``(step_s, example_s, macs_per_s)`` such that a step costs ``step_s + batch * (example_s + 3 *
    sum(macs[kind] / macs_per_s[kind]))`` (simulate/costs.py: forward one multiply-add per weight use,
    backward two), fitted to ``points`` in relative error; ``step_s`` and ``example_s`` may come out 0, the
    rates are finite. Needs each kind's multiply-adds in some point, and points that tell the per-step,
    per-example and per-kind terms apart (two batch sizes; models that mix the kinds differently)."""
    names = ["step_s", "example_s", *KINDS]
    rows = [[1.0, p.batch, *(3.0 * p.batch * p.macs.get(k, 0.0) for k in KINDS)] for p in points]
    x = least_squares(rows, [p.seconds for p in points], names, may_be_zero=("step_s", "example_s"))
    return x["step_s"], x["example_s"], {k: 1.0 / x[k] for k in KINDS}


def step_seconds(step_s: float, example_s: float, macs_per_s: dict[str, float], p: StepPoint) -> float:
    """What the costs say point ``p``'s step takes (the simulator's formula)."""
    return step_s + p.batch * (example_s + 3.0 * sum(m / macs_per_s[k] for k, m in p.macs.items() if m))


def thread_efficiency(one_s: float, many_s: float, threads: int, fixed_s: float) -> float:
    """``thread_efficiency`` (simulate/costs.py: with ``t`` threads the multiply-adds go ``1 + (t - 1) *
    efficiency`` times faster) from a step timed with one thread (``one_s``) and with ``threads``
    (``many_s``), less the part no thread speeds up (``fixed_s``: ``step_s + batch * example_s``); in [0, 1].

    Raises:
        ValueError: fewer than 2 threads, or a step no longer than its fixed part."""
    if threads < 2:
        raise ValueError(f"needs a step timed with 2 threads or more, got {threads}")
    if min(one_s, many_s) <= fixed_s:
        raise ValueError(f"the steps ({one_s:.3g} s with 1 thread, {many_s:.3g} s with {threads}) must be "
                         f"longer than their fixed part ({fixed_s:.3g} s)")
    speedup = (one_s - fixed_s) / (many_s - fixed_s)
    return min(1.0, max(0.0, (speedup - 1) / (threads - 1)))


def fit_transfers(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(call_s, bytes_per_s)`` such that moving ``b`` bytes takes ``call_s + b / bytes_per_s``, fitted to
    ``(bytes, seconds)`` points in relative error (``call_s`` may come out 0). Needs two sizes or more."""
    x = least_squares([[1.0, b] for b, _ in points], [s for _, s in points], ["call_s", "s_per_byte"],
                      may_be_zero=("call_s",))
    return x["call_s"], 1.0 / x["s_per_byte"]


def fit_object_cpu(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(object_cpu_s, bytes_per_s)`` such that a call whose reply of ``b`` bytes goes through the object store
    costs ``object_cpu_s + b / bytes_per_s`` of CPU more than a tiny call, from ``(bytes, CPU seconds)`` of whole
    calls: the first a tiny one (inline with its reply), the others through the object store. Fitted to the
    whole calls' CPU in relative error (``object_cpu_s`` may come out 0), not to the differences: a small reply
    costs about what the tiny call does, so its difference is noise, even below 0, and in relative error it
    outweighed the large reply that fixes the rate (a calibration here got 4e-15 s a byte from a 4 MiB reply
    that cost 6.5 ms more than the tiny call). Replies that cost no more than the tiny call (a noisy quick
    calibration) give 0 and an infinite rate: nothing more, rather than no calibration."""
    rows = [[1.0, 0.0, 0.0] if i == 0 else [1.0, 1.0, float(b)] for i, (b, _) in enumerate(points)]
    x = least_squares(rows, [max(c, 1e-6) for _, c in points], ["call_cpu_s", "object_cpu_s", "s_per_byte"],
                      may_be_zero=("object_cpu_s", "s_per_byte"))
    return x["object_cpu_s"], (1.0 / x["s_per_byte"] if x["s_per_byte"] > 0 else math.inf)


# --------------------------------------------------------------------------------------------------- timing


def run_times(fn: Callable[[], Any], repeats: int, warmup: int, before: Callable[[], Any] | None = None
              ) -> list[float]:
    """Wall seconds of each of ``repeats`` runs of ``fn()``, after ``warmup`` untimed ones; ``before()`` runs
    untimed ahead of each timed one (``cache_evictor``: what a run does between two of them)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def interleaved_times(fns: Sequence[Callable[[], Any]], repeats: int, warmup: int, block: int = 1,
                      before: Callable[[], Any] | None = None) -> list[list[float]]:
    """Wall seconds of ``repeats`` runs of each of ``fns`` (after ``warmup`` untimed ones each), taken in
    rounds: a stretch when the machine runs slower (a virtual machine's neighbours, a background job) falls on
    every function alike instead of on whichever was being timed. In each round each function runs ``block``
    times in a row after one untimed run, so that it finds the caches as a replica repeating its step does, not
    as the previous function left them (a replica runs one model's step over and over: a block of 5 times what
    it does, one timed run after a switch is up to 40 % slower here). ``before``: as ``run_times``."""
    for fn in fns:
        run_times(fn, 0, warmup)
    times: list[list[float]] = [[] for _ in fns]
    rounds = -(-repeats // block)
    for _ in range(rounds):
        for fn, out in zip(fns, times, strict=True):
            out.extend(run_times(fn, block, 1, before))
    return times


def median_time(fn: Callable[[], Any], repeats: int, warmup: int, before: Callable[[], Any] | None = None
                ) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` runs after ``warmup`` untimed ones (``before``: as
    ``run_times``)."""
    return statistics.median(run_times(fn, repeats, warmup, before))


def cache_evictor() -> Callable[[], Any]:
    """One gradient step of the Fig. 4 model (one torch thread, 128 examples): run before each timed shard update,
    copy, fetch answer and compression, it leaves the caches as a run does, where the replicas' steps come
    between them and evict their arrays (timed in a tight loop instead, a push and a copy of the Fig. 4 model's
    values took 2.7 ms here, and 4.5 ms right after a gradient step)."""
    src, x, y = _step_source("speech-tiny", "speech", 8192, 128)
    return partial(src.gradient, x, y)


def busy_seconds() -> float:
    """CPU seconds this machine has been busy since boot, every core and process (/proc/stat: user, nice,
    system, irq and softirq time)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pids: Sequence[int]) -> float:
    """CPU seconds that processes ``pids`` have spent so far, their kernel work on their sockets (loopback
    included) too, every thread's (exited ones too): each process's CPU-time clock (``clock_getcpuclockid``,
    nanoseconds), or, where that is not available, its user and system time in clock ticks (/proc/PID/stat:
    10 ms, which over a few objects' worth of work rounds a cost per object by a third or more)."""
    total = 0.0
    for pid in pids:
        clock = _cpu_clock(pid)
        if clock is not None:
            total += time.clock_gettime(clock)
            continue
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime and stime
    return total


def _cpu_clock(pid: int) -> int | None:
    """The id of process ``pid``'s CPU-time clock (POSIX ``clock_getcpuclockid``), or None where there is none."""
    import ctypes

    try:
        clock = ctypes.c_int()
        if _libc().clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
            return None
        return clock.value
    except (OSError, AttributeError):
        return None


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def busy_cores(window_s: float) -> float:
    """How many cores this machine keeps busy, on average over the next ``window_s`` seconds."""
    before, t0 = busy_seconds(), time.perf_counter()
    time.sleep(window_s)
    return (busy_seconds() - before) / (time.perf_counter() - t0)


def wait_quiet(background: float, max_s: float = 15.0, margin: float = 0.25, window_s: float = 0.25) -> float:
    """Wait until this machine keeps less than ``background + margin`` cores busy over a ``window_s`` window
    (``background``: what it kept busy before we started Ray), at most ``max_s``; returns the seconds waited.
    Ray starts and imports worker processes in the background for seconds after it is up: timings taken
    meanwhile would count their work too (on two cores, a lot)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_s and busy_cores(window_s) >= background + margin:
        pass
    return time.perf_counter() - t0


def machine_name() -> str:
    """The CPU model (/proc/cpuinfo's "model name"; the platform's processor where it has none)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# ----------------------------------------------------------------------------------------- replica compute


def _step_source(model: str, task: str, classes: int, batch: int, seed: int = 0):
    """A replica's gradient source for ``model`` and a random minibatch of ``batch`` inputs of the task's
    shape: ``(source, x, y)``."""
    import torch
    import torch.nn.functional as F

    from distbelief.downpour.replica import WholeModel
    from distbelief.models import build_model
    from distbelief.simulate.profile import TASK_INPUT

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *TASK_INPUT[task], generator=gen)
    y = torch.randint(0, classes, (batch,), generator=gen)
    return WholeModel(0, build_model(model, TASK_INPUT[task], classes), F.cross_entropy), x, y


def measure_steps(rep: Effort, log: Log) -> list[tuple[str, StepPoint, float]]:
    """Median seconds of ``WholeModel.gradient`` (zero the gradient, forward, cross-entropy, backward: the
    replica's step without its fetch and push) for each of ``STEP_MODELS`` at each of ``STEP_BATCHES``, on
    random inputs of the task's shape, timed in rounds (``interleaved_times``); with the model's
    multiply-adds from ``profile_model``, and the step times' coefficient of variation (standard deviation /
    mean: ``compute_cv``)."""
    from distbelief.simulate.profile import profile_model

    cases = [(model, task, classes, batch) for model, task, classes in STEP_MODELS for batch in STEP_BATCHES]
    steps = [partial(source.gradient, x, y) for source, x, y in (_step_source(*case) for case in cases)]
    runs = interleaved_times(steps, rep.step, rep.warmup, block=STEP_BLOCK)
    out = []
    for (model, task, classes, batch), times in zip(cases, runs, strict=True):
        seconds, cv = statistics.median(times), statistics.stdev(times) / statistics.fmean(times)
        log(f"step {model} ({task}, {classes} classes) batch {batch}: {seconds * 1e3:.2f} ms (variation "
            f"{cv:.1%})")
        out.append((model, StepPoint(batch, dict(profile_model(model, task, classes).macs), seconds), cv))
    return out


def measure_fitted_steps(rep: Effort, log: Log, tries: int = 3) -> list[tuple[str, StepPoint, float]]:
    """``measure_steps``, timed again with three times the repeats while noise leaves their fit (``fit_steps``)
    no solution with every rate positive (a busy machine did that to the quick calibration's 4 repeats);
    NoPositiveFit after ``tries`` timings."""
    for attempt in range(tries):
        steps = measure_steps(rep, log)
        try:
            fit_steps([p for _, p, _ in steps])
            return steps
        except NoPositiveFit as e:
            if attempt == tries - 1:
                raise
            rep = dataclasses.replace(rep, step=3 * rep.step)
            log(f"the steps do not fit ({e}); timing them again with {rep.step} repeats")
    raise AssertionError("unreachable")


def measure_own_steps(rep: Effort, log: Log) -> list[tuple[str, str, int, int, float]]:
    """Median seconds of the step of each of ``OWN_STEP_MODELS`` (models the fit of ``measure_steps`` does not
    cover well, timed at their default minibatch): ``(model, task, classes, batch, seconds)``."""
    out = []
    for model, task, classes, batch in OWN_STEP_MODELS:
        source, x, y = _step_source(model, task, classes, batch)
        seconds = median_time(partial(source.gradient, x, y), max(3, rep.step // 3), rep.warmup)
        log(f"step {model} ({task}, {classes} classes) batch {batch}: {seconds * 1e3:.2f} ms")
        out.append((model, task, classes, batch, seconds))
    return out


def step_table(steps: list[tuple[str, StepPoint, float]], own: list[tuple[str, str, int, int, float]]
               ) -> dict[str, dict[str, float]]:
    """``Costs.step_measured``: every step timed, by ``model:parameters`` and batch size."""
    from distbelief.simulate.profile import profile_model

    table: dict[str, dict[str, float]] = {}
    cases = [(m, t, c, p.batch, p.seconds) for (m, p, _), (t, c) in
             zip(steps, ((t, c) for m, t, c in STEP_MODELS for _ in STEP_BATCHES), strict=True)]
    for model, task, classes, batch, seconds in [*cases, *own]:
        key = f"{model}:{profile_model(model, task, classes).params}"
        table.setdefault(key, {})[str(batch)] = seconds
    return table


def measure_threads(rep: Effort, log: Log) -> dict[str, Any] | None:
    """Median seconds of the Fig. 4 model's step (speech-tiny, 8192 classes, 128 examples) with one torch thread
    and with two, in interleaved blocks (``interleaved_times``: a slow stretch of the machine falls on both
    alike): how much a second thread speeds a replica's multiply-adds (``thread_efficiency``). None on a
    machine with one core."""
    import torch

    threads = 2
    if (os.cpu_count() or 1) < threads:
        return None
    batch = 128
    source, x, y = _step_source("speech-tiny", "speech", 8192, batch)

    def step(t):
        torch.set_num_threads(t)
        source.gradient(x, y)

    one, many = interleaved_times([partial(step, 1), partial(step, threads)], 2 * rep.step, rep.warmup,
                                  block=STEP_BLOCK)
    torch.set_num_threads(1)
    out = {"model": "speech-tiny", "classes": 8192, "batch": batch, "threads": threads,
           "macs": dict(_profile("speech-tiny", "speech", 8192).macs),
           "one_s": statistics.median(one), "many_s": statistics.median(many)}
    log(f"step speech-tiny batch {batch}: {out['one_s'] * 1e3:.2f} ms with 1 thread, "
        f"{out['many_s'] * 1e3:.2f} ms with {threads}")
    return out


def measure_contention(rep: Effort, log: Log, rounds: int = 3) -> dict[str, Any] | None:
    """How much slower a replica's work runs when every core runs a replica at the same time, against one alone:
    replicas beside each other share the memory bus and the caches. Each replica (a thread of its own, with a
    model and a parameter shard of its own: the kernels release the GIL) runs the co-located Downpour step: the
    Fig. 4 model's gradient (one torch thread, 128 examples), then its push to the shard
    (``ParameterShard.push``, Adagrad) and its fetch copied out (``read_into``). ``contention``: the gradient's
    time together over alone; ``memory_contention``: the same for the push and the copy, which stream through
    memory and suffer more. Timed in ``rounds`` turns of alone then together, each ratio taken within its turn
    and the median kept: this machine's speed drifts within seconds, and a ratio of two timings far apart holds
    that drift (one alone then one together gave 1.01 to 1.15 on one machine within hours). None on one core."""
    import threading

    cores = os.cpu_count() or 1
    if cores < 2:
        return None
    steps = [_step_source("speech-tiny", "speech", 8192, 128, seed=i) for i in range(cores)]
    n = steps[0][0].grads.numel()
    shards = [_shard(n, "adagrad") for _ in range(cores)]
    buffers = [np.zeros(n, np.float32) for _ in range(cores)]

    def loop(i: int, times: list[tuple[float, float]], count: int) -> None:
        src, x, y = steps[i]
        shard, out = shards[i], buffers[i]
        for _ in range(count):
            t0 = time.perf_counter()
            src.gradient(x, y)
            t1 = time.perf_counter()
            shard.push(0, src.grads.numpy(), 0, shard.version, 128)
            shard.read_into(out)
            times.append((t1 - t0, time.perf_counter() - t1))

    def together(count: int) -> list[tuple[float, float]]:
        start = threading.Barrier(cores)
        times: list[list[tuple[float, float]]] = [[] for _ in range(cores)]

        def run(i):
            start.wait()
            loop(i, [], rep.warmup)
            loop(i, times[i], count)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(cores)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [t for ts in times for t in ts]

    def medians(times: list[tuple[float, float]]) -> tuple[float, float]:
        return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)

    loop(0, [], rep.warmup)
    turns = []  # (alone compute, alone memory, together compute, together memory)
    for _ in range(rounds):
        alone: list[tuple[float, float]] = []
        loop(0, alone, rep.step)
        turns.append((*medians(alone), *medians(together(rep.step))))
    alone_c, alone_m, both_c, both_m = (statistics.median(t[j] for t in turns) for j in range(4))
    ratio_c = statistics.median(t[2] / t[0] for t in turns)
    ratio_m = statistics.median(t[3] / t[1] for t in turns)
    out = {"model": "speech-tiny", "classes": 8192, "batch": 128, "cores": cores, "values": n,
           "alone_s": alone_c, "together_s": both_c, "contention": max(1.0, ratio_c),
           "memory_alone_s": alone_m, "memory_together_s": both_m, "memory_contention": max(1.0, ratio_m),
           "turns": [{"alone_s": a, "together_s": b, "memory_alone_s": c, "memory_together_s": d}
                     for a, c, b, d in turns]}
    log(f"co-located step, speech-tiny batch 128: gradient {alone_c * 1e3:.2f} ms alone, {both_c * 1e3:.2f} ms "
        f"with all {cores} cores stepping (contention {out['contention']:.2f}: the median of "
        + ", ".join(f"{t[2] / t[0]:.2f}" for t in turns) + f" in {rounds} turns); push and copy of {n:,} values "
        f"{alone_m * 1e3:.2f} ms alone, {both_m * 1e3:.2f} ms together ({out['memory_contention']:.2f})")
    return out


# The Fig. 4 model's Downpour run of ``measure_layout``: its task with fewer examples (the data's size does not
# change a step) and one evaluation, at the end, of a few hundred
LAYOUT_RUN = {"task": "speech", "model": "speech-tiny", "num_classes": 8192, "class_prior": 1.0,
              "num_samples": 20000, "batch_size": 128, "replicas": 2, "shards": 2, "eval_every_seconds": 3600.0,
              "eval_samples": 500, "train_eval_samples": 0, "durability": "off", "seed": 0}


def _train_on_ray(cfg, **runtime_options):
    """``train_task`` of ``cfg`` on a Ray runtime of its own (``runtime_options``: RayRuntime's), quietly; the
    runtime is shut down after, whatever happened."""
    from distbelief.api import train_task
    from distbelief.runtime.ray_runtime import RayRuntime

    runtime = RayRuntime(remote_timeout_s=cfg.remote_timeout_s, **runtime_options)
    try:
        return train_task(cfg.normalized(), quiet=True, runtime=runtime)
    finally:
        runtime.shutdown()


def measure_layout(rep: Effort, log: Log) -> dict[str, Any] | None:
    """How much slower a replica's step is when the shards run in processes of their own beside it, every push
    and fetch a Ray call (compressed runs; runs whose shards are on other nodes sharing these cores), than when
    the replicas apply their pushes to the shards' memory themselves (the one-node default: co-located). Real
    Downpour runs of the Fig. 4 model (``LAYOUT_RUN``: 2 replicas x 2 shards on a local Ray instance, for
    ``layout_s`` seconds each), the two layouts in turns, ``layout_rounds`` each; a run's step is its replicas'
    compute time (the minibatch and the gradient) over their steps. ``separate_process_slowdown``: the median
    step apart over the median step co-located (at least 1). Both layouts have the replicas beside each other,
    so the ratio leaves ``contention`` out. Measured here (2 cores): 1.2 to 1.35; the cause is not known (the
    machine is not saturated, and no process beside a step alone slows it as much: benchmarks/RESULTS.md). None
    on one core."""
    import tempfile

    from distbelief.config import config_from
    from distbelief.runtime.probes import on_local_ray

    if (os.cpu_count() or 1) < 2:
        return None
    steps: dict[str, list[float]] = {"colocated": [], "separate": []}

    def runs(tmp: str) -> None:
        for i in range(rep.layout_rounds):
            for layout in steps:
                cfg = config_from({**LAYOUT_RUN, "max_seconds": rep.layout_s, "out": f"{tmp}/{layout}{i}"})
                together = layout == "colocated"
                res = _train_on_ray(cfg, use_shm=together, colocate=together)
                got = res.summary.get("replicas_colocated", 0)
                if got != (LAYOUT_RUN["replicas"] if together else 0):
                    raise RuntimeError(f"the {layout} layout run had {got} co-located replicas")
                step = res.metrics[-1]["replica_compute_s"] / max(1, sum(res.summary["steps_per_replica"]))
                steps[layout].append(step)
                log(f"Downpour 2 x 2, speech-tiny batch 128, shards {layout}: a step {step * 1e3:.2f} ms in the run")

    with tempfile.TemporaryDirectory(prefix="distbelief-layout-") as tmp:
        on_local_ray(lambda: runs(tmp))
    apart, together = (statistics.median(steps[k]) for k in ("separate", "colocated"))
    out = {"run": LAYOUT_RUN, "seconds": rep.layout_s, "steps_s": steps,
           "separate_process_slowdown": max(1.0, apart / together)}
    log(f"shards in processes of their own: a replica's step {apart / together:.2f} times its co-located time")
    return out


PARTITION_RUN = {**LAYOUT_RUN, "strategy": "sgd", "replicas": 1, "shards": 1, "partitions": 2}


def measure_partition_messages(rep: Effort, costs: Costs, log: Log) -> dict[str, Any] | None:
    """``partition_message_s``: what a boundary message between two partitions on one machine takes beyond its
    bytes, from real model-parallel steps: one replica of the Fig. 4 model over 2 partitions (``PARTITION_RUN``,
    the sgd strategy: no parameter shards, so no other process on the cores) on a local Ray instance, for
    ``layout_s`` seconds, ``layout_rounds`` runs; a run's step is its minibatch over its examples per second. The
    step the simulator makes of the same model with ``costs`` (its compute at the timed step's pace, the bytes'
    CPU) and no time per message is subtracted, and the rest divided by the messages on the step's path (one
    per exchange with two partitions). Measured here (2 cores): 5.6 to 7.3 ms a message, against 1.1 ms for a
    tiny call's round trip between idle actors (``call_s``). The record keeps each run's CPU per partition process
    and step (``cpu_s_per_step``: the run's ``partition_cpu_s_per_step``): here 51-54 of a 71-75 ms step, so
    that 59 % of the message time kept a partition's core busy; charging only that share as CPU, the rest as
    waiting, predicted two such replicas 16 % and 31 % too fast in two of three validations' records (9 % in the
    third; benchmarks/RESULTS.md, 2026-12-07), so the simulator still charges all of it. None on one core."""
    import tempfile

    from distbelief.config import config_from
    from distbelief.runtime.probes import on_local_ray
    from distbelief.simulate.machines import Machines
    from distbelief.simulate.partition import partition_step

    if (os.cpu_count() or 1) < 2:
        return None
    steps: list[float] = []
    cpus: list[float] = []

    def runs(tmp: str) -> None:
        for i in range(rep.layout_rounds):
            cfg = config_from({**PARTITION_RUN, "max_seconds": rep.layout_s, "out": f"{tmp}/partitions{i}"})
            res = _train_on_ray(cfg)
            steps.append(PARTITION_RUN["batch_size"] / res.summary["examples_per_s"])
            cpus.append(statistics.fmean(res.summary["partition_cpu_s_per_step"]))
            log(f"speech-tiny batch 128 over 2 partitions on Ray: a step {steps[-1] * 1e3:.2f} ms, each partition's "
                f"process busy {cpus[-1] * 1e3:.2f} ms of it")

    with tempfile.TemporaryDirectory(prefix="distbelief-partitions-") as tmp:
        on_local_ray(lambda: runs(tmp))
    step = statistics.median(steps)
    profile = _profile(PARTITION_RUN["model"], PARTITION_RUN["task"], PARTITION_RUN["num_classes"])
    batch, parts = PARTITION_RUN["batch_size"], PARTITION_RUN["partitions"]

    def step_with(c: Costs):  # the run's step as simulate/downpour.py makes it: the partitions on one machine
        return partition_step(profile, parts, batch, c, Machines(nodes=parts, cores_per_node=1), one_machine=True)

    silent = step_with(dataclasses.replace(costs, partition_message_s=0.0))
    # the messages on the step's path: its message time at one second per message and nothing per byte
    on_path = step_with(dataclasses.replace(costs, partition_message_s=1.0, local_object_cpu_s_per_byte=0.0)
                        ).message_path_s
    per_message = max(0.0, step - silent.seconds) / on_path
    log(f"a message between partitions on one machine: {per_message * 1e3:.2f} ms beyond its bytes ({on_path:g} on "
        f"a step's path; the step without them {silent.seconds * 1e3:.2f} ms)")
    return {"run": PARTITION_RUN, "seconds": rep.layout_s, "steps_s": steps, "cpu_s_per_step": cpus,
            "modelled_without_messages_s": silent.seconds, "messages_on_path": on_path,
            "partition_message_s": per_message}


def _profile(model: str, task: str, classes: int):
    from distbelief.simulate.profile import profile_model

    return profile_model(model, task, classes)


# ----------------------------------------------------------------------------------------- parameter shards


def _shard(n: int, rule: str):
    from distbelief.ps.rules import make_rule
    from distbelief.ps.shard import ParameterShard

    return ParameterShard(0, 0, n, np.zeros(n, np.float32), make_rule(rule, lr=1e-3), n)


def measure_updates(rep: Effort, log: Log, before: Callable[[], Any] | None = None) -> dict[str, float]:
    """Median seconds of ``ParameterShard.push`` of a dense gradient covering the shard's ``n`` values (the
    finiteness check, the staleness bookkeeping, the rule's update in place), per rule; ``before()`` untimed
    ahead of each (``cache_evictor``)."""
    n = rep.shard_values
    g = np.random.default_rng(0).standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    shards = [_shard(n, rule) for rule in RULES]
    runs = interleaved_times([lambda s=shard: s.push(0, g, 0, s.version, 32) for shard in shards], rep.shard,
                             rep.warmup, block=STEP_BLOCK, before=before)
    out = {}
    for rule, times in zip(RULES, runs, strict=True):
        out[rule] = statistics.median(times)
        log(f"shard update {rule}: {out[rule] * 1e3:.2f} ms for {n:,} values = {out[rule] / n * 1e9:.3f} "
            f"ns/value")
    return out


def measure_delta(rep: Effort, log: Log, before: Callable[[], Any] | None = None) -> float:
    """Median seconds for ``ParameterShard.fetch(since=...)`` to answer a delta fetch (``--compress-fetch
    delta``) from a shard of ``n`` values: scan each value's last-changed version, gather those changed since
    the caller's last fetch; here ``DELTA_CHANGED`` of them, changed by one sparse push (as top-k sends).
    ``before()`` untimed ahead of each (``cache_evictor``)."""
    n = rep.shard_values
    shard = _shard(n, "sgd")
    shard.fetch(since=("", -1))  # the first delta fetch: the shard starts tracking changes
    since = (shard.token, shard.version)
    g = np.zeros(n, np.float32)
    changed = np.random.default_rng(1).choice(n, int(n * DELTA_CHANGED), replace=False)
    g[changed] = 1e-3
    shard.push(0, g, 0, shard.version)
    fetched, _ = shard.fetch(since=since)
    if fetched.idx is None or fetched.idx.size != changed.size:
        raise RuntimeError(f"the delta fetch sent {fetched.values.size} values, not the {changed.size} "
                           f"changed")
    seconds = median_time(lambda: shard.fetch(since=since), rep.shard, rep.warmup, before)
    log(f"delta fetch: {seconds * 1e3:.2f} ms for {n:,} values ({DELTA_CHANGED:.0%} changed) = "
        f"{seconds / n * 1e9:.3f} ns/value")
    return seconds


def measure_sparse(rep: Effort, log: Log, before: Callable[[], Any] | None = None
                   ) -> tuple[float, float, dict[str, Any]]:
    """A shard's work for top-k pushes answered by delta fetches, as two replicas make them: each in turn pushes
    a top-k part (``ErrorFeedback`` over a random gradient, ``DELTA_CHANGED`` of the range) to an Adagrad shard
    (``ParameterShard.push``: the positions checked, the rule over the values carried, the changes logged) and
    fetches the values changed since its last fetch (``fetch(since=...)``: the log's positions since then,
    merged, and their values). Returns the median seconds per value carried by a push and per value answered by
    a fetch, and the record. ``before()`` untimed ahead of each push (``cache_evictor``)."""
    import torch

    from distbelief.compression import EncodedPush, ErrorFeedback, make_codec

    n = rep.shard_values
    shard = _shard(n, "adagrad")
    rng = np.random.default_rng(2)
    feedback = [ErrorFeedback(make_codec("topk", [(0, n)], None, ratio=DELTA_CHANGED), n) for _ in range(2)]
    since = []
    for _ in range(2):
        answer, version = shard.fetch(since=("", -1))
        since.append((answer.token, version))
    push_s, fetch_s, carried, answered = [], [], [], []
    for i in range(2 * (rep.shard + rep.warmup)):
        r = i % 2
        parts = feedback[r].compress(torch.from_numpy(rng.standard_normal(n, dtype=np.float32) * 1e-3))
        push = EncodedPush("topk", parts, [(0, n)])
        if before is not None:
            before()
        t = time.perf_counter()
        shard.push(r, push, 0, since[r][1], 32)
        t1 = time.perf_counter()
        answer, version = shard.fetch(since=since[r])
        t2 = time.perf_counter()
        if answer.idx is None:
            raise RuntimeError("the delta fetch answered whole where a few top-k pushes changed its range")
        since[r] = (answer.token, version)
        if i >= 2 * rep.warmup:
            push_s.append(t1 - t)
            fetch_s.append(t2 - t1)
            carried.append(parts[0][0].size)
            answered.append(answer.idx.size)
    per_carried = statistics.median(s / k for s, k in zip(push_s, carried))
    per_answered = statistics.median(s / k for s, k in zip(fetch_s, answered))
    log(f"sparse push: {statistics.median(push_s) * 1e3:.2f} ms for {statistics.median(carried):,.0f} values = "
        f"{per_carried * 1e9:.1f} ns/value; delta fetch from the log: {statistics.median(fetch_s) * 1e3:.2f} ms "
        f"for {statistics.median(answered):,.0f} values = {per_answered * 1e9:.1f} ns/value")
    return per_carried, per_answered, {"push_s": statistics.median(push_s), "carried": statistics.median(carried),
                                       "fetch_s": statistics.median(fetch_s),
                                       "answered": statistics.median(answered)}


def measure_copy(rep: Effort, log: Log, before: Callable[[], Any] | None = None) -> float:
    """Median seconds of one copy of a ``COPY_BYTES`` float32 buffer into another (``np.copyto``): what the
    shared-memory plane does to a push or a fetch between two processes of one node. ``before()`` untimed ahead
    of each (``cache_evictor``)."""
    src = np.ones(COPY_BYTES // 4, np.float32)
    dst = np.zeros_like(src)
    seconds = median_time(lambda: np.copyto(dst, src), rep.shard, rep.warmup, before)
    log(f"copy: {COPY_BYTES / 2**20:.0f} MiB in {seconds * 1e3:.2f} ms = {COPY_BYTES / seconds / 1e9:.2f} "
        f"GB/s")
    return seconds


def measure_streams(rep: Effort, log: Log) -> dict[str, float]:
    """A replica's gloo stream to a shard (runtime/probes.py ``stream_cpu``: the product's two ends in this
    process over loopback, a shard's range each way): ``stream_cpu_s_per_byte`` is half the CPU per byte of both
    ends together, what each end costs its node."""
    from distbelief.runtime.probes import stream_cpu

    r = stream_cpu(rep.shard_values, 2 * rep.shard)
    log(f"stream: {r['bytes_per_s'] / 1e9:.2f} GB/s over loopback, {r['cpu_s_per_byte'] * 1e9:.2f} ns of CPU per byte "
        f"for both ends")
    return r


# -------------------------------------------------------------------------------------------- compression


def measure_codecs(rep: Effort, log: Log, before: Callable[[], Any] | None = None
                   ) -> tuple[dict[str, float], dict[str, float], int]:
    """Median seconds, per scheme with its defaults, to compress a real gradient of the Fig. 4 model
    (speech-tiny, 8192 classes; 2 shard ranges) as a replica does before each push
    (``ErrorFeedback.compress``: add the residual, the codec's ``encode``, keep the new residual) and to
    decode every shard's part as the shards do (``codec_class(name).decode``). Returns (compress, decode, the
    gradient's values)."""
    from distbelief.compression import ErrorFeedback, codec_class, make_codec
    from distbelief.compression.powersgd import tensor_layout
    from distbelief.ps.sharding import ShardLayout

    source, x, y = _step_source("speech-tiny", "speech", 8192, 32)
    source.gradient(x, y)
    g, model = source.grads.clone(), source.model
    n = g.numel()
    layout = ShardLayout.balanced(n, 2)
    ranges = [layout.range(k) for k in range(layout.num_shards)]
    encode, decode = {}, {}
    for name in SCHEMES:
        feedback = ErrorFeedback(make_codec(name, ranges, tensor_layout(model)), n)
        encode[name] = median_time(partial(feedback.compress, g), rep.codec, rep.warmup, before)
        parts = feedback.last_parts
        decode[name] = median_time(partial(_decode_all, codec_class(name).decode, parts, ranges), rep.codec,
                                   rep.warmup, before)
        log(f"compression {name}: encode {encode[name] * 1e3:.2f} ms, decode {decode[name] * 1e3:.2f} ms for "
            f"{n:,} values = {encode[name] / n * 1e9:.2f} / {decode[name] / n * 1e9:.2f} ns/value")
    return encode, decode, n


def _decode_all(decode: Callable, parts: list, ranges: list[tuple[int, int]]) -> list:
    return [decode(part, lo, hi) for part, (lo, hi) in zip(parts, ranges, strict=True)]


# ---------------------------------------------------------------------------------------------------- Ray


def measure_call(rep: Effort, background: float, log: Log) -> dict[str, Any]:
    """Ray actor calls on one node (runtime/probes.py ``actor_call_costs``), through the runtime's own actor: a
    parameter shard's ``fetch`` whose reply is tiny (16 values: inline with the reply) or large (``CALL_SIZES``:
    through the node's object store). ``call_s``: the median seconds of the tiny call; ``call_cpu_s``: the CPU
    it costs the machine (caller, callee and raylet together, less Ray's idle load); ``local_object_cpu_s`` and
    ``local_object_cpu_s_per_byte``: what a large reply costs beyond that, fitted over its sizes. Also the
    cores that a local Ray keeps busy when nothing runs on it (raylet, GCS, agents: ``ray_idle_cores``), over
    what was busy before it started."""
    from distbelief.ps.rules import make_rule
    from distbelief.ps.shard import ParameterShard
    from distbelief.runtime.probes import actor_call_costs

    idle: list[float] = []

    def settle():
        wait_quiet(background)
        # Ray's own processes, nothing else running: over 3 s (its periodic work comes in bursts)
        idle.append(max(0.0, busy_cores(3.0) - background))

    def shard(n):
        return ParameterShard, (0, 0, n, np.zeros(n, np.float32), make_rule("sgd", lr=0.1), n), "fetch", (0,)

    sizes = (16, *(b // 4 for b in CALL_SIZES))
    runs = actor_call_costs([shard(n) for n in sizes], rep.call, rep.call // 10, settle, busy_seconds)
    ray_idle = idle[0]
    cpu = [max(0.0, r["cpu_s"] - (background + ray_idle) * r["wall_s"]) / rep.call for r in runs]
    seconds = statistics.median(runs[0]["times"])
    extra = [(4 * n, c - cpu[0]) for n, c in zip(sizes[1:], cpu[1:])]
    object_s, object_rate = fit_object_cpu([(4 * n, c) for n, c in zip(sizes, cpu)])
    log(f"Ray actor call: {seconds * 1e3:.3f} ms, {cpu[0] * 1e3:.2f} ms of CPU; a reply through the object "
        f"store: " + ", ".join(f"{b / 1e6:.2f} MB {c * 1e3:.2f} ms of CPU more" for b, c in extra)
        + f" = {object_s * 1e3:.2f} ms + {1e9 / object_rate:.2f} ns/byte; Ray idle keeps {ray_idle:.2f} cores "
        f"busy")
    return {"call_s": seconds, "call_cpu_s": cpu[0], "local_object_cpu_s": object_s,
            "local_object_cpu_s_per_byte": 1.0 / object_rate, "ray_idle_cores": ray_idle,
            "record": [{"bytes": 4 * n, "seconds": statistics.median(r["times"]), "cpu_s": c}
                       for n, r, c in zip(sizes, runs, cpu)]}


def compressed_rounds(shard_values: int, ratio: float, rounds: int, warmup: int, settle: Callable[[], Any]
                      ) -> dict[str, Any]:
    """Top-k pushes answered by delta fetches, as the replicas of a one-node run make them (the object-store
    transport): two real parameter shard actors (Adagrad) of ``shard_values`` values each, and two replicas'
    clients in this process taking turns, each round one push of a top-k part (``ErrorFeedback``, ``ratio`` of
    the values) fused with its fetch of the values changed since its last (``push_fetch_async``), then the
    answer written into its parameters (``Fetched.load_into``). ``settle()`` runs before the timed rounds.

    Returns, per round, this process's CPU seconds (every thread: the caller's whole side of the calls), the
    seconds spent encoding and loading, the values loaded, the bytes of the push and of the answers, and the
    wall seconds; ``calls`` per round (one per shard)."""
    import torch

    from distbelief.compression import EncodedPush, ErrorFeedback, make_codec
    from distbelief.ps.rules import make_rule
    from distbelief.ps.shard import ParameterShard
    from distbelief.ps.sharding import ShardLayout
    from distbelief.runtime.probes import shard_client, with_actors

    total, shards = 2 * shard_values, 2
    layout = ShardLayout.balanced(total, shards)
    ranges = [layout.range(k) for k in range(shards)]
    rng = np.random.default_rng(3)
    grads = [torch.from_numpy(rng.standard_normal(total, dtype=np.float32) * np.float32(1e-3)) for _ in range(4)]
    roles = [(ParameterShard, (k, lo, hi, np.zeros(hi - lo, np.float32), make_rule("adagrad", lr=1e-3), total))
             for k, (lo, hi) in enumerate(ranges)]

    def body(handles) -> dict[str, Any]:
        clients = [shard_client(handles, layout, r) for r in range(2)]
        feedback = [ErrorFeedback(make_codec("topk", ranges, None, ratio=ratio), total) for _ in range(2)]
        flats = [torch.zeros(total) for _ in range(2)]
        versions: list[list[int]] = [[0] * shards for _ in range(2)]

        def load(r: int, parts, vs) -> int:
            n = 0
            for k, (lo, answer) in enumerate(parts):
                clients[r].fetch_since[k] = (answer.token, vs[k])
                answer.load_into(flats[r], lo)
                n += len(answer.values)
            versions[r] = vs
            return n

        for r in range(2):
            clients[r].fetch_since = [("", -1)] * shards
            load(r, *clients[r].fetch_async().result(60.0))

        def one(i: int, r: int) -> tuple[float, float, int, int, int]:
            t0 = time.perf_counter()
            push = EncodedPush("topk", feedback[r].compress(grads[i % len(grads)]), ranges)
            t1 = time.perf_counter()
            parts, vs = clients[r].push_fetch_async(push, versions[r], 128).result(60.0)
            t2 = time.perf_counter()
            n = load(r, parts, vs)
            t3 = time.perf_counter()
            return (t1 - t0, t3 - t2, n, sum(idx.nbytes + v.nbytes for idx, v in push.parts),
                    sum(a.nbytes for _, a in parts))

        for i in range(warmup):
            one(i, i % 2)
        settle()
        cpu0, t0 = time.process_time(), time.perf_counter()  # (this process's CPU, every thread's)
        rows = [one(i, i % 2) for i in range(2 * rounds)]
        spent, wall, n = time.process_time() - cpu0, time.perf_counter() - t0, len(rows)
        return {"cpu_s": spent / n, "wall_s": wall / n, "encode_s": sum(r[0] for r in rows) / n,
                "load_s": sum(r[1] for r in rows) / n, "loaded": sum(r[2] for r in rows) / n,
                "push_bytes": sum(r[3] for r in rows) / n, "answer_bytes": sum(r[4] for r in rows) / n,
                "calls": shards, "rounds": n}

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a replica with a core to itself
    try:
        return with_actors(roles, body)
    finally:
        torch.set_num_threads(threads)


def measure_compressed(rep: Effort, background: float, call: dict[str, Any], log: Log) -> dict[str, Any]:
    """The replica's side of top-k pushes answered by delta fetches, through real shards on one node and the
    product's client (``compressed_rounds``): ``delta_load_s_per_value``, writing an answer's
    values into the parameters, per value; and ``encoded_call_cpu_s``, what each call (one per shard) costs the
    caller beyond encoding, loading, a plain call's half (``call_cpu_s``) and the halves of its objects that the
    simulator charges (``local_object_cpu_s``: the part and the answer when over Ray's inline limit)."""
    from distbelief.simulate.engine import local_object_cpu

    r = compressed_rounds(rep.shard_values, DELTA_CHANGED, max(10, rep.call // 2), 2 * rep.warmup + 4,
                          lambda: wait_quiet(background))
    calls = r["calls"]

    def half(nbytes: float) -> float:  # the caller's half of one object, as the simulator charges it
        return local_object_cpu(nbytes, call["local_object_cpu_s"], call["local_object_cpu_s_per_byte"]) / 2

    per_call = (r["cpu_s"] - r["encode_s"] - r["load_s"]) / calls
    charged = call["call_cpu_s"] / 2 + half(r["push_bytes"] / calls) + half(r["answer_bytes"] / calls)
    load = r["load_s"] / max(1.0, r["loaded"])
    log(f"compressed calls (top-k push, delta answer; {calls} shards): the caller's CPU {r['cpu_s'] * 1e3:.2f} ms "
        f"a round, encoding {r['encode_s'] * 1e3:.2f} ms, loading {r['loaded']:,.0f} values {r['load_s'] * 1e3:.2f} "
        f"ms = {load * 1e9:.1f} ns/value; each call {per_call * 1e3:.2f} ms of it, {charged * 1e3:.2f} ms as a "
        f"plain call's half and its objects")
    return {"delta_load_s_per_value": load, "encoded_call_cpu_s": max(0.0, per_call - charged),
            "record": {**r, "per_call_cpu_s": per_call, "charged_s": charged}}


def _median_by_size(points: Sequence[Sequence[float]]) -> list[tuple[int, float]]:
    sizes = sorted({int(b) for b, _ in points})
    return [(b, statistics.median(s for bb, s in points if bb == b)) for b in sizes]


def measure_objstore(rep: Effort, background: float, log: Log) -> dict[str, Any]:
    """Ray's object store between two raylets (runtime/probes.py ``objstore_fetches``): ``call_s`` and
    ``bytes_per_s`` fitted to the median time of each size; ``cpu_s`` and ``cpu_s_per_byte`` fitted to the CPU
    per object of each size that the two raylets, the driver and the actor spent during the fetches, less what
    they spend idle in as long: both ends' work together, per object and per byte."""
    from distbelief.runtime.probes import objstore_fetches

    r = objstore_fetches(OBJSTORE_SIZES, rep.objects, rep.warmup, lambda: wait_quiet(background),
                         process_cpu_seconds)
    medians = _median_by_size(r["points"])
    call_s, rate = fit_transfers(medians)
    per_object = [(c["bytes"], max(1e-9, (c["cpu_s"] - r["idle_cpu_per_s"] * c["wall_s"]) / c["objects"]))
                  for c in r["cpu"]]
    cpu_s, cpu_rate = fit_transfers(per_object)
    for (b, s), (_, c) in zip(medians, per_object):
        log(f"object store fetch {b / 1e6:.2f} MB: {s * 1e3:.2f} ms, {c * 1e3:.2f} ms of CPU")
    log(f"object store: {call_s * 1e3:.2f} ms per object + {rate / 1e9:.3f} GB/s; CPU {cpu_s * 1e3:.2f} ms per "
        f"object + {1e9 / cpu_rate:.3f} ns/byte")
    return {"call_s": call_s, "bytes_per_s": rate, "cpu_s": cpu_s, "cpu_s_per_byte": 1.0 / cpu_rate,
            "medians": medians,
            "cpu": {"per_object": [{"bytes": b, "cpu_s": c} for b, c in per_object],
                    "idle_cpu_per_s": r["idle_cpu_per_s"],
                    "waited_quiet_s": r["waited_quiet_s"]}}


# ------------------------------------------------------------------------------------------- shaped links


def measure_links(rep: Effort, log: Log) -> dict[str, Any]:
    """``link_efficiency``: the object store's rate between the two nodes of a shaped cluster (runtime/probes.py
    ``link_fetches``, each link ``LINK_BANDWIDTH``), fitted as the object store's is, over the shaped rate (at
    most 1). Needs root on Linux."""
    from distbelief.runtime.probes import link_fetches

    name, subnet = LINK_CLUSTER
    points, bandwidth_bps = link_fetches(LINK_SIZES, rep.objects, LINK_BANDWIDTH, name, subnet, log)
    medians = _median_by_size(points)
    call_s, rate = fit_transfers(medians)
    efficiency = min(1.0, rate / (bandwidth_bps / 8))
    for b, s in medians:
        log(f"shaped link fetch {b / 1e6:.2f} MB: {s * 1e3:.2f} ms")
    log(f"shaped link ({LINK_BANDWIDTH}): {call_s * 1e3:.2f} ms per object + {rate * 8 / 1e9:.3f} Gbit/s = "
        f"{efficiency:.0%} of the shaped rate")
    return {"bandwidth": LINK_BANDWIDTH, "call_s": call_s, "bytes_per_s": rate, "efficiency": efficiency,
            "medians": medians}


# ------------------------------------------------------------------------------------------------ calibrate


def _sized(medians: Sequence[tuple[int, float]], call_s: float, bytes_per_s: float) -> list[dict]:
    return [{"bytes": b, "seconds": s, "fit_seconds": call_s + b / bytes_per_s} for b, s in medians]


def _refuse_unless_ready(links: bool) -> None:
    """RuntimeError (or netcluster's error for ``links``) where calibrating cannot work, before any timing."""
    from distbelief.runtime.probes import ray_connected

    if not Path("/proc/stat").is_file():
        raise RuntimeError("calibrate reads CPU times from /proc (Linux); on this system write a costs file "
                           "by hand (see distbelief/simulate/costs.py)")
    if ray_connected():
        raise RuntimeError("calibrate starts and stops Ray instances of its own: call it in a process that "
                           "is not connected to Ray (ray.shutdown() first)")
    if links:
        from distbelief.runtime.netcluster import require_root_linux

        require_root_linux()


def _fit_compute(steps: list[tuple[str, StepPoint, float]], scaling: dict | None, log: Log
                 ) -> tuple[dict[str, Any], list[dict]]:
    """The replica compute costs from ``measure_steps`` and ``measure_threads`` (whose record gains its
    ``efficiency``): ``step_s``, ``example_s``, ``macs_per_s``, ``compute_cv`` (the median over the steps
    timed) and, with two cores or more, ``thread_efficiency``; and the record of each step timed, with what
    the fit says it takes."""
    step_s, example_s, macs_per_s = fit_steps([p for _, p, _ in steps])
    out = {"step_s": step_s, "example_s": example_s, "macs_per_s": macs_per_s,
           "compute_cv": statistics.median(cv for _, _, cv in steps)}
    log(f"step fit: {step_s * 1e3:.3f} ms per step + {example_s * 1e6:.2f} us per example; "
        + ", ".join(f"{k} {macs_per_s[k] / 1e9:.2f} GMAC/s" for k in KINDS)
        + f"; variation {out['compute_cv']:.1%}")
    if scaling is not None:
        scaling["efficiency"] = out["thread_efficiency"] = thread_efficiency(
            scaling["one_s"], scaling["many_s"], scaling["threads"], step_s + scaling["batch"] * example_s)
        log(f"thread efficiency: a second thread adds {scaling['efficiency']:.0%} of one")
    record = [{"model": m, "batch": p.batch, "macs": p.macs, "seconds": p.seconds, "cv": cv,
               "fit_seconds": step_seconds(step_s, example_s, macs_per_s, p)} for m, p, cv in steps]
    return out, record


def calibrate(path: str | Path | None = None, *, links: bool = False, quick: bool = False,
              log: Log = print) -> Costs:
    """Measure every field of ``Costs`` on this machine (see the module's docstring), log one line per
    measurement, and return them; saved to ``path`` (``Costs.save``) when given. ``links``: also
    ``link_efficiency``, on a shaped cluster (root on Linux; without it the dataclass's default stays).
    ``quick``: fewer repeats and a smaller shard (for tests). Runs with one torch thread, as replicas and
    shards do, in a process not connected to Ray. Linux only (CPU times come from /proc): elsewhere, write a
    costs file by hand (simulate/costs.py)."""
    import torch

    from distbelief.runtime.probes import local_ray, ray_version

    _refuse_unless_ready(links)
    rep = QUICK if quick else FULL
    n = rep.shard_values
    started, threads = time.perf_counter(), torch.get_num_threads()
    background = busy_cores(0.5)
    if background > 0.25:
        log(f"note: {background:.1f} of this machine's {os.cpu_count()} cores are busy with other work: the "
            f"timings will be slower than on a quiet machine")
    torch.set_num_threads(1)
    try:
        steps = measure_fitted_steps(rep, log)
        own = measure_own_steps(rep, log)
        scaling = measure_threads(rep, log)
        sharing = measure_contention(rep, log)
        evict = cache_evictor()  # each of these timed as a run meets it: right after a replica's step
        updates = measure_updates(rep, log, evict)
        delta = measure_delta(rep, log, evict)
        sparse_push, delta_log, sparse = measure_sparse(rep, log, evict)
        copy = measure_copy(rep, log, evict)
        stream = measure_streams(rep, log)
        encode, decode, codec_values = measure_codecs(rep, log, evict)
    finally:
        torch.set_num_threads(threads)
    compute, steps_record = _fit_compute(steps, scaling, log)
    with local_ray():  # one local Ray instance for both (a start costs several seconds of CPU)
        call = measure_call(rep, background, log)
        compressed = measure_compressed(rep, background, call, log)
    objstore = measure_objstore(rep, background, log)
    # Its runs start a Ray instance of their own. Tried on the probes' instance, right after their actors were
    # killed: the co-located step came out 1.25-1.44 times its time on a fresh instance (one try).
    layout = measure_layout(rep, log)
    costs = Costs(
        machine=machine_name(), date=dt.date.today().isoformat(), cpus=os.cpu_count() or 1, **compute,
        step_measured=step_table(steps, own),
        update_s_per_value={r: s / n for r, s in updates.items()}, call_s=call["call_s"],
        call_cpu_s=call["call_cpu_s"], local_object_cpu_s=call["local_object_cpu_s"],
        local_object_cpu_s_per_byte=call["local_object_cpu_s_per_byte"], ray_idle_cores=call["ray_idle_cores"],
        contention=sharing["contention"] if sharing else 1.0,
        separate_process_slowdown=layout["separate_process_slowdown"] if layout else 1.0,
        copy_bytes_per_s=COPY_BYTES / copy, objstore_call_s=objstore["call_s"],
        objstore_bytes_per_s=objstore["bytes_per_s"], objstore_cpu_s_per_byte=objstore["cpu_s_per_byte"],
        objstore_cpu_s=objstore["cpu_s"],
        link_object_s=objstore["call_s"],  # (the shaped link's own, with links=True)
        encode_s_per_value={k: s / codec_values for k, s in encode.items()},
        decode_s_per_value={k: s / codec_values for k, s in decode.items()}, delta_s_per_value=delta / n,
        sparse_push_s_per_value=sparse_push, delta_log_s_per_value=delta_log,
        delta_load_s_per_value=compressed["delta_load_s_per_value"],
        encoded_call_cpu_s=compressed["encoded_call_cpu_s"],
        stream_cpu_s_per_byte=stream["cpu_s_per_byte"] / 2)
    measurements: dict[str, Any] = {
        "steps": steps_record,
        "threads": scaling,  # None: one core, thread_efficiency is the default
        "contention": sharing,  # None: one core
        "layout": layout,  # None: one core
        "shard_values": n, "update_s": updates, "delta_s": delta, "delta_changed": DELTA_CHANGED,
        "sparse": sparse,
        "copy": {"bytes": COPY_BYTES, "seconds": copy},
        "stream": stream,
        "codec_values": codec_values, "compress_s": encode, "decode_s": decode,
        "call": call["record"],
        "compressed": compressed["record"],
        "objstore": _sized(objstore["medians"], objstore["call_s"], objstore["bytes_per_s"]),
        "objstore_cpu": objstore["cpu"],
    }
    partitions = measure_partition_messages(rep, costs, log)  # (reads the compute costs measured above)
    if partitions:
        costs.partition_message_s = partitions["partition_message_s"]
    measurements["partitions"] = partitions  # None: one core, a message costs call_s
    if links:
        link = measure_links(rep, log)
        costs.link_efficiency = link["efficiency"]
        costs.link_object_s = link["call_s"]
        measurements["links"] = {**link,
                                 "medians": _sized(link["medians"], link["call_s"], link["bytes_per_s"])}
    measurements.update(quick=quick, seconds=time.perf_counter() - started, background_cores=background,
                        torch=torch.__version__, ray=ray_version(), python=platform.python_version())
    costs.measurements = measurements
    costs.check("calibration")
    log(f"calibrated in {measurements['seconds']:.0f} s")
    if path is not None:
        costs.save(path)
        log(f"wrote {path}")
    return costs
