"""ParameterShard: owns one contiguous slice of the flat parameter vector and the server optimizer's state for it.

Plain Python, no engine: the runtime decides whether a shard lives in this process or in a Ray actor. A shard is
called by one thread at a time (a Ray actor executes calls sequentially; the in-process runtime holds a lock).

Besides Downpour's fetch/push, a shard keeps *named slice-vectors* and executes a small set of vector operations
on them (dot -> partial scalar, axpy, scale, copy, zero, lincomb, a fused multi-dot, and ``execute`` to run a short
program of them in one call). Sandblaster's coordinator drives L-BFGS through these without ever holding a
parameter-sized vector.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

PARAMS = "params"

# Buffers fetched zero-copy from Ray's object store are read-only; we only ever read them, so torch's warning
# about wrapping non-writable memory is noise here.
warnings.filterwarnings("ignore", message="The given (NumPy array|buffer) is not writable")


def _all_finite(g: torch.Tensor) -> bool:
    """True iff no element is NaN or +-Inf.

    A NaN or Inf element makes the sum non-finite, so a finite float32 sum proves every element finite: one
    vectorised pass (0.15 ms for 2.3M floats here, vs 2.3 ms for a float64 sum and ~15 ms for
    ``isfinite(g).all()``). Only a non-finite sum — a bad push, or finite values so large that their float32 sum
    overflows — pays for the exact element-wise check."""
    if bool(torch.isfinite(g.sum())):
        return True
    return bool(torch.isfinite(g).all())


def _as_tensor(a) -> torch.Tensor:
    """A float32 torch view of ``a`` (numpy arrays fetched zero-copy from Ray are read-only; we never write them)."""
    if isinstance(a, torch.Tensor):
        return a
    arr = np.asarray(a)
    if not arr.flags.writeable:
        # torch.from_numpy warns on read-only arrays; frombuffer on the same memory is zero-copy and silent.
        return torch.frombuffer(memoryview(arr).cast("B"), dtype=torch.float32) if arr.size else torch.empty(0)
    return torch.from_numpy(arr)


@dataclass(frozen=True)
class Durability:
    """Where and how often a shard saves its state (see distbelief.ps.checkpoint).

    ``wal`` False is the ``snapshot`` mode (a restarted shard loses the updates since its last snapshot, and
    says how many), True the ``log`` mode (a write-ahead log of every applied push: it loses none)."""

    root: str
    every_updates: int = 0  # 0 = not by count
    every_seconds: float = 30.0  # 0 = not by time
    wal: bool = True
    keep: int = 3
    log_max_bytes: int = 1 << 30  # a log this large triggers a snapshot, which starts a new log
    background: bool = True  # periodic snapshots are written by a thread, off the push path


class _SnapshotWriter:
    """Writes one snapshot at a time in a background thread.

    The shard copies its state into reusable buffers on its own thread (a memcpy, the only cost on the push
    path) and hands them here; serialising, hashing and fsyncing happen in this thread, which mostly runs with
    the GIL released. While a write is in flight the shard takes no new snapshot (it tries again at the next
    push), so the buffers are never overwritten mid-write."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, write: Callable[[], None]) -> None:
        self._thread = threading.Thread(target=self._run, args=(write,), name="distbelief-snapshot", daemon=True)
        self._thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as e:  # noqa: BLE001 - reported by the next snapshot or stats()
            self.error = e

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"a background snapshot failed: {err}") from err


# A shard's counters live in one int64 array, so that a shared shard (ps/colocated.py) keeps them in shared
# memory with its parameters: co-located replicas update them under the shard's lock.
_COUNTER_SLOTS = ("version", "examples", "rejected_pushes", "staleness_sum", "staleness_max", "staleness_count",
                  "bytes_pushed", "bytes_fetched", "_last_ckpt_version", "_last_ckpt_time_ns", "_snapshot_claimed")


def _counter(slot: int) -> property:
    def get(self) -> int:
        return int(self._ctr[slot])

    def set(self, value: int) -> None:
        self._ctr[slot] = value

    return property(get, set)


class ParameterShard:
    """A slice ``[lo, hi)`` of the flat parameters plus the server optimizer state for it.

    Args:
        shard_id: index of this shard.
        lo, hi: the flat range owned.
        init_values: float32 array of length ``hi - lo`` with the initial parameter values.
        optimizer: a server rule from :mod:`distbelief.ps.optimizers`, or None for a shard used only for vectors.
        total: total number of model parameters (used to validate pushes).
        storage, lock: (ps/colocated.py) arrays to use as the state, in place — ``params``, ``opt.<name>`` and
            ``counters`` — and the lock that guards them; a replica's view of a shared shard is built this way.
    """

    # Updates applied to this shard; examples represented by the applied pushes; pushes refused; staleness of
    # the applied pushes; traffic through this shard: gradient bytes read from pushes (only our range, even when
    # a push maps the whole vector) and parameter bytes served by fetches (the driver's evaluation reads included).
    version = _counter(0)
    examples = _counter(1)
    rejected_pushes = _counter(2)
    staleness_sum = _counter(3)
    staleness_max = _counter(4)
    staleness_count = _counter(5)
    bytes_pushed = _counter(6)
    bytes_fetched = _counter(7)
    # The version and time (monotonic ns: one clock for all processes of a machine) of the last snapshot, and
    # whether a co-located replica has asked for the next one (so that only one asks).
    _last_ckpt_version = _counter(8)
    _last_ckpt_time_ns = _counter(9)
    _snapshot_claimed = _counter(10)

    def __init__(self, shard_id: int, lo: int, hi: int, init_values, optimizer, total: int,
                 durability: Durability | None = None, init_state: dict | None = None,
                 counters: dict | None = None, storage: dict[str, np.ndarray] | None = None, lock=None):
        if hi <= lo:
            raise ValueError(f"shard {shard_id}: empty range [{lo}, {hi})")
        self.shard_id, self.lo, self.hi, self.total = shard_id, lo, hi, total
        self.optimizer = optimizer
        # Held while the state changes or is read as a whole. A no-op unless the state is shared with
        # co-located replicas (share()), whose processes then take the same lock.
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self._shared: dict | None = None
        self.opt_state = optimizer.init_state(hi - lo) if optimizer is not None else {}
        if storage is not None:
            self._bind(storage)
        else:
            values = np.array(init_values, dtype=np.float32, copy=True).reshape(-1)
            if values.size != hi - lo:
                raise ValueError(f"shard {shard_id}: init_values has {values.size} elements, range needs "
                                 f"{hi - lo}")
            self._params_np = values
            self.vectors: dict[str, torch.Tensor] = {PARAMS: torch.from_numpy(values)}
            for name, value in (init_state or {}).items():
                self.opt_state[name].copy_(_as_tensor(np.asarray(value, dtype=np.float32)).reshape(-1))
            self._ctr = np.zeros(len(_COUNTER_SLOTS), dtype=np.int64)
            for name in self.COUNTERS:
                setattr(self, name, int((counters or {}).get(name, 0)))
        self.restored_from_version = -1
        self.replayed_updates = 0
        self.corrupt_checkpoints: list[str] = []
        self.checkpoints_written = 0
        # Exactly-once pushes: the highest sequence number applied per client session. A push re-sent to a
        # restarted shard (because its acknowledgement was lost with the old process) is recognised and skipped.
        self.last_seq: dict[int, int] = {}
        self.duplicate_pushes = 0
        self.durability = durability
        self._wal = None
        if storage is None:
            self._last_ckpt_version = self.version
            self._last_ckpt_time_ns = time.monotonic_ns()
        self._writer = _SnapshotWriter()
        self._snap_bufs: dict[str, torch.Tensor] = {}  # reused by every background snapshot
        self.snapshot_s = 0.0  # time the push path spent copying state for background snapshots
        if durability is not None:
            from distbelief.ps.checkpoint import WriteAheadLog

            if durability.wal:
                self._wal = WriteAheadLog(durability.root, shard_id)
                self._wal.start(self.version)

    # ------------------------------------------------------------------ durability
    COUNTERS = ("version", "examples", "rejected_pushes", "staleness_sum", "staleness_max", "staleness_count",
                "bytes_pushed", "bytes_fetched")

    def _state(self, copy_into: dict[str, torch.Tensor] | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
        """``(meta, tensors)`` of a checkpoint of the current state. With ``copy_into`` the tensors are copies
        in those (reused) buffers, so the live state may change while they are written."""
        meta = {"shard_id": self.shard_id, "lo": self.lo, "hi": self.hi, "total": self.total}
        meta.update({k: getattr(self, k) for k in self.COUNTERS})
        tensors = {PARAMS: self.vectors[PARAMS]}
        tensors.update({f"opt.{k}": v for k, v in self.opt_state.items() if not k.startswith("tmp")})
        if copy_into is not None:
            for name, v in tensors.items():
                buf = copy_into.get(name)
                if buf is None or buf.shape != v.shape:
                    buf = copy_into[name] = torch.empty_like(v)
                tensors[name] = buf.copy_(v)
        if self.last_seq:
            tensors["dedup.sessions"] = torch.tensor(list(self.last_seq), dtype=torch.int64)
            tensors["dedup.seqs"] = torch.tensor(list(self.last_seq.values()), dtype=torch.int64)
        return meta, tensors

    def _write(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Save one checkpoint; in log mode, then drop the logs no kept checkpoint needs."""
        from distbelief.ps.checkpoint import save_checkpoint, shard_dir

        d = self.durability
        save_checkpoint(d.root, self.shard_id, meta, tensors, keep=d.keep)
        self.checkpoints_written += 1
        if self._wal is not None:
            kept = sorted(shard_dir(d.root, self.shard_id).glob("ckpt-*.safetensors"))
            # Keep the log back to the oldest kept checkpoint, so falling back to it still loses nothing.
            self._wal.drop_before(int(kept[0].stem.split("-")[1]) if kept else meta["version"])

    def _mark_snapshot(self) -> None:
        """The state as of now is (being) saved: later pushes go to a new log, the cadence restarts."""
        self._last_ckpt_version, self._last_ckpt_time_ns = self.version, time.monotonic_ns()
        self._snapshot_claimed = 0
        if self._wal is not None:
            self._wal.start(self.version)

    def _snapshot_due(self, every_updates: int, every_seconds: float) -> bool:
        return bool((every_updates and self.version - self._last_ckpt_version >= every_updates) or (
            every_seconds and time.monotonic_ns() - self._last_ckpt_time_ns >= every_seconds * 1e9) or (
            self._wal is not None and self._wal.bytes_since_start >= self.durability.log_max_bytes))

    def checkpoint(self) -> int:
        """Write a checkpoint now, in this thread (atomic, checksummed); waits for a background snapshot in
        flight first. Returns the version saved."""
        if self.durability is None:
            raise RuntimeError(f"shard {self.shard_id} has no checkpoint directory configured")
        self._writer.wait()
        with self.lock:
            # A shared state changes under co-located replicas' hands: save a copy taken under the lock.
            meta, tensors = self._state(copy_into=self._snap_bufs if self._shared else None)
            self._mark_snapshot()
        self._write(meta, tensors)
        return meta["version"]

    def _snapshot_in_background(self) -> None:
        """Copy the state (the only work on the push path) and let the writer thread save it."""
        t0 = time.perf_counter()
        if self._writer.error is not None:
            self._writer.wait()  # raises: a shard that cannot save its state must say so, not go on silently
        with self.lock:
            meta, tensors = self._state(copy_into=self._snap_bufs)
            self._mark_snapshot()
        self._writer.submit(lambda: self._write(meta, tensors))
        self.snapshot_s += time.perf_counter() - t0

    def _after_update(self, start: int, stop: int, num_examples: int, g: torch.Tensor, session: int = 0,
                      seq: int = 0) -> None:
        d = self.durability
        if d is None:
            return
        if self._wal is not None:
            self._wal.append(self.version, start, stop, num_examples, g.numpy(), session, seq)
        if not self._snapshot_due(d.every_updates, d.every_seconds):
            return
        if not d.background:
            self.checkpoint()
        elif not self._writer.busy():  # else: the previous snapshot is still being written; try at the next push
            self._snapshot_in_background()

    # ------------------------------------------------------------------ sharing with co-located replicas
    def _bind(self, storage: dict[str, np.ndarray]) -> None:
        """Use ``storage``'s arrays as this shard's state, in place (ps/colocated.py)."""
        self._params_np = storage[PARAMS]
        self.vectors = {PARAMS: torch.from_numpy(self._params_np)}
        for name in list(self.opt_state):
            if f"opt.{name}" in storage:
                self.opt_state[name] = torch.from_numpy(storage[f"opt.{name}"])
        self._ctr = storage["counters"]

    def share(self, base: str, timeout_s: float = 120.0) -> dict | None:
        """Move this shard's state into shared memory (files ``<base>-s<id>-...``, ``base`` a path prefix in
        /dev/shm) so that replicas
        on this machine apply their pushes to it themselves (ps/colocated.py); returns what they need to map
        it, the same on every call. None when this shard cannot be shared: a vector-only shard, or one that
        logs every push (``--durability log``)."""
        if self.optimizer is None or self._wal is not None:
            return None
        if self._shared is None:
            from distbelief.ps.colocated import COUNTERS_FILE, ShardLock, create_storage

            self._writer.wait()  # a snapshot in flight reads our buffers, not the state: safe, but keep it simple
            base = f"{base}-s{self.shard_id}-{time.monotonic_ns():x}"
            arrays = {PARAMS: self._params_np, COUNTERS_FILE: self._ctr}
            arrays.update({f"opt.{k}": v.numpy() for k, v in self.opt_state.items() if not k.startswith("tmp")})
            files, maps = create_storage(base, arrays)
            self._bind(maps)
            lock_path = files[COUNTERS_FILE][0]
            self.lock = ShardLock(lock_path, timeout_s)
            d = self.durability
            self._shared = {
                "shard_id": self.shard_id, "lo": self.lo, "hi": self.hi, "total": self.total,
                "optimizer": self.optimizer, "files": files, "lock": lock_path,
                "every_updates": d.every_updates if d else 0, "every_seconds": d.every_seconds if d else 0.0,
            }
        return self._shared

    def claim_snapshot(self, every_updates: int, every_seconds: float) -> bool:
        """(Under the lock, by a co-located replica) True, once, when a snapshot is due: the caller then asks the
        shard's process to write it (request_snapshot)."""
        if self._snapshot_claimed or not self._snapshot_due(every_updates, every_seconds):
            return False
        self._snapshot_claimed = 1
        return True

    def request_snapshot(self) -> bool:
        """A co-located replica found a snapshot due: take it in the background now (or, if one is still being
        written, let the next due push ask again). True if one was started."""
        if self.durability is None:
            return False
        if self._writer.busy():
            with self.lock:
                self._snapshot_claimed = 0
            return False
        self._snapshot_in_background()
        return True

    def read_into(self, out: np.ndarray) -> int:
        """Copy the parameter slice into ``out[lo:hi]`` (a flat, full-length buffer); returns its version."""
        with self.lock:
            out[self.lo : self.hi] = self._params_np
            self.bytes_fetched += self._params_np.nbytes
            return self.version

    def kill(self) -> None:
        """The in-process runtime's simulated process death: a snapshot being written lands (or not) before a
        replacement reads the directory, as with a real death, where the write either was renamed into place
        or is a stray temporary file."""
        try:
            self._writer.wait()
        except RuntimeError:
            pass

    def flush(self) -> int:
        """Wait for a background snapshot in flight. Returns the checkpoints written so far."""
        self._writer.wait()
        return self.checkpoints_written

    @classmethod
    def restore(cls, shard_id: int, lo: int, hi: int, optimizer, total: int, durability: Durability,
                fallback_values=None, write_base: bool = True) -> "ParameterShard":
        """A shard rebuilt from its latest good checkpoint plus its write-ahead log.

        With no checkpoint at all, ``fallback_values`` (the initial parameters) are used and the whole log is
        replayed. Damaged checkpoints are skipped and listed in ``corrupt_checkpoints``.
        """
        from distbelief.ps.checkpoint import WriteAheadLog, latest_good_checkpoint

        ck = latest_good_checkpoint(durability.root, shard_id)
        if ck is not None:
            if (ck.meta["lo"], ck.meta["hi"]) != (lo, hi):
                raise ValueError(f"shard {shard_id}: checkpoint {ck.path} covers [{ck.meta['lo']}, {ck.meta['hi']}) "
                                 f"but this shard owns [{lo}, {hi})")
            state = {k[4:]: v.numpy() for k, v in ck.tensors.items() if k.startswith("opt.")}
            shard = cls(shard_id, lo, hi, ck.tensors[PARAMS].numpy(), optimizer, total, None, state, ck.meta)
            shard.corrupt_checkpoints = ck.skipped
            if "dedup.sessions" in ck.tensors:
                shard.last_seq = dict(zip(ck.tensors["dedup.sessions"].tolist(), ck.tensors["dedup.seqs"].tolist()))
        else:
            if fallback_values is None:
                raise FileNotFoundError(f"shard {shard_id}: no usable checkpoint under {durability.root}")
            shard = cls(shard_id, lo, hi, fallback_values, optimizer, total)
        shard.restored_from_version = shard.version
        for version_after, a, b, n_ex, session, seq, g in WriteAheadLog(durability.root, shard_id).replay(
                shard.version):
            if version_after != shard.version + 1:
                break  # a gap: later records cannot be applied in order
            gt = torch.from_numpy(g.copy())
            w = shard.vectors[PARAMS]
            shard.optimizer.apply(w[a:b], gt, {k: v[a:b] for k, v in shard.opt_state.items()})
            shard.version += 1
            shard.examples += n_ex
            shard.replayed_updates += 1
            if session:
                shard.last_seq[session] = max(seq, shard.last_seq.get(session, 0))
        if not write_base:  # read-only restore (resume assembles state from several shards)
            return shard
        shard.durability = durability
        if durability.wal:
            shard._wal = WriteAheadLog(durability.root, shard_id)
        shard.checkpoint()  # a fresh base: the replayed state is durable before we accept new pushes
        return shard

    # ------------------------------------------------------------------ Sandblaster iteration checkpoints
    VECTOR_CKPT_DIR = "sandblaster"

    def checkpoint_vectors(self, root: str, tag: int, keep: int = 3) -> int:
        """Save every named vector (params, x, d, gradients, the (s, y) ring, temporaries) as checkpoint ``tag``
        under ``root/sandblaster`` (atomic, checksummed; the newest ``keep`` are kept). Returns ``tag``."""
        from distbelief.ps.checkpoint import save_checkpoint

        meta = {"shard_id": self.shard_id, "lo": self.lo, "hi": self.hi, "total": self.total, "version": tag}
        save_checkpoint(f"{root}/{self.VECTOR_CKPT_DIR}", self.shard_id, meta,
                        {f"vec.{name}": v for name, v in self.vectors.items()}, keep=keep)
        self.checkpoints_written += 1
        return tag

    @classmethod
    def _vector_checkpoint(cls, root: str, shard_id: int, tag: int):
        from distbelief.ps.checkpoint import load_checkpoint, shard_dir

        path = shard_dir(f"{root}/{cls.VECTOR_CKPT_DIR}", shard_id) / f"ckpt-{int(tag):012d}.safetensors"
        meta, tensors = load_checkpoint(path)  # CorruptCheckpoint if damaged (checksum)
        if meta["shard_id"] != shard_id or meta["version"] != tag:
            raise ValueError(f"shard {shard_id}: {path} belongs to shard {meta['shard_id']}, tag {meta['version']}")
        return meta, {k[4:]: v for k, v in tensors.items() if k.startswith("vec.")}

    def load_vectors(self, root: str, tag: int) -> int:
        """Roll every named vector back to checkpoint ``tag`` (written by ``checkpoint_vectors``); vectors made
        since are dropped. Returns ``tag``."""
        meta, vecs = self._vector_checkpoint(root, self.shard_id, tag)
        if (meta["lo"], meta["hi"]) != (self.lo, self.hi):
            raise ValueError(f"shard {self.shard_id}: checkpoint covers [{meta['lo']}, {meta['hi']}) but this shard "
                             f"owns [{self.lo}, {self.hi})")
        params = self.vectors[PARAMS]
        params.copy_(vecs.pop(PARAMS))  # in place: params shares memory with what fetch() returns
        self.vectors = {PARAMS: params, **{k: v.clone() for k, v in vecs.items()}}
        return tag

    @classmethod
    def from_vectors(cls, root: str, shard_id: int, tag: int) -> "ParameterShard":
        """A vector-only shard (no server optimizer) rebuilt from Sandblaster iteration checkpoint ``tag``."""
        meta, vecs = cls._vector_checkpoint(root, shard_id, tag)
        shard = cls(shard_id, meta["lo"], meta["hi"], vecs[PARAMS].numpy(), None, meta["total"])
        shard.load_vectors(root, tag)
        shard.restored_from_version = tag
        return shard

    # ------------------------------------------------------------------ Downpour
    def fetch(self, replica_id: int = -1) -> tuple[np.ndarray, int]:
        """The live parameter slice and its version. Callers in the same process must copy it."""
        if self._shared:  # co-located replicas write it meanwhile: a copy taken under the lock
            with self.lock:
                self.bytes_fetched += self._params_np.nbytes
                return self._params_np.copy(), self.version
        self.bytes_fetched += self._params_np.nbytes
        return self._params_np, self.version

    def fetch_range(self, lo: int, hi: int, replica_id: int = -1) -> tuple[int, np.ndarray, int]:
        """Our part of the flat range ``[lo, hi)``: ``(start, values, version)``, ``values`` covering
        ``[start, start + len(values))`` (live; same-process callers copy). A model partition fetches only its
        own parameters this way."""
        a, b = max(self.lo, lo), min(self.hi, hi)
        if b <= a:
            return a, self._params_np[:0], self.version
        with self.lock:
            self.bytes_fetched += (b - a) * self._params_np.itemsize
            values = self._params_np[a - self.lo : b - self.lo]
            return a, values.copy() if self._shared else values, self.version

    def push(self, replica_id: int, grad, offset: int, based_on_version: int, num_examples: int = 0,
             session: int = 0, seq: int = 0) -> int:
        """Apply an accumulated gradient covering flat ``[offset, offset + len(grad))`` to our intersection.

        ``based_on_version`` is the version of this shard the replica's parameters came from; the difference to
        our current version is the push's staleness. Returns our version after the push. A push with a
        non-finite value or a range outside the model is rejected and counted, never applied.
        """
        with self.lock:
            return self._push(grad, offset, based_on_version, num_examples, session, seq)

    def _push(self, grad, offset: int, based_on_version: int, num_examples: int, session: int, seq: int) -> int:
        if session and seq <= self.last_seq.get(session, 0):
            self.duplicate_pushes += 1
            return self.version
        g_all = _as_tensor(grad)
        n = g_all.numel()
        if offset < 0 or offset + n > self.total or g_all.dtype != torch.float32:
            self.rejected_pushes += 1
            return self.version
        lo, hi = max(self.lo, offset), min(self.hi, offset + n)
        if hi <= lo:
            return self.version
        g = g_all[lo - offset : hi - offset]
        self.bytes_pushed += g.numel() * g.element_size()  # read even if rejected below as non-finite
        if not _all_finite(g):
            self.rejected_pushes += 1
            return self.version
        a, b = lo - self.lo, hi - self.lo
        w = self.vectors[PARAMS]
        if a == 0 and b == self.hi - self.lo:
            self.optimizer.apply(w, g, self.opt_state)
        else:
            self.optimizer.apply(w[a:b], g, {k: v[a:b] for k, v in self.opt_state.items()})
        staleness = max(0, self.version - int(based_on_version))
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)
        self.staleness_count += 1
        self.version += 1
        self.examples += int(num_examples)
        if session:
            self.last_seq[session] = seq
        self._after_update(a, b, int(num_examples), g, session, seq)
        return self.version

    def apply_mean(self, *grads) -> int:
        """Synchronous data parallelism: average full-vector gradients, apply one update. Returns the version."""
        with self.lock:
            return self._apply_mean(grads)

    def _apply_mean(self, grads) -> int:
        acc, accepted = None, 0
        for grad in grads:
            g = _as_tensor(grad)[self.lo : self.hi]
            if g.numel() == self.hi - self.lo:
                self.bytes_pushed += g.numel() * g.element_size()
            if g.numel() != self.hi - self.lo or not _all_finite(g):
                self.rejected_pushes += 1
                continue
            acc = g.clone() if acc is None else acc.add_(g)
            accepted += 1
        if acc is None:
            return self.version
        acc.div_(accepted)
        self.optimizer.apply(self.vectors[PARAMS], acc, self.opt_state)
        self.staleness_count += 1  # a synchronous update is never stale
        self.version += 1
        self._after_update(0, self.hi - self.lo, 0, acc)
        return self.version

    def set_params(self, values) -> int:
        """Overwrite the parameter slice (used by warmstart from a checkpoint)."""
        with self.lock:
            self.vectors[PARAMS].copy_(_as_tensor(values).reshape(-1))
            return self.version

    def stats(self) -> dict:
        return {
            "shard_id": self.shard_id,
            "updates": self.version,
            "examples": self.examples,
            "rejected_pushes": self.rejected_pushes,
            "staleness_sum": self.staleness_sum,
            "staleness_max": self.staleness_max,
            "staleness_count": self.staleness_count,
            "bytes_pushed": self.bytes_pushed,
            "bytes_fetched": self.bytes_fetched,
            "restored_from_version": self.restored_from_version,
            "replayed_updates": self.replayed_updates,
            "corrupt_checkpoints": list(self.corrupt_checkpoints),
            "checkpoints_written": self.checkpoints_written,
            "snapshot_version": self._last_ckpt_version,
            "snapshot_s": self.snapshot_s,
            "duplicate_pushes": self.duplicate_pushes,
        }

    # ------------------------------------------------------------------ vector operations (Sandblaster)
    def _vec(self, name: str) -> torch.Tensor:
        v = self.vectors.get(name)
        if v is None:
            v = self.vectors[name] = torch.zeros(self.hi - self.lo, dtype=torch.float32)
        return v

    def zero(self, x: str) -> None:
        self._vec(x).zero_()

    def copy(self, src: str, dst: str) -> None:
        self._vec(dst).copy_(self._vec(src))

    def scale(self, x: str, c: float) -> None:
        self._vec(x).mul_(c)

    def axpy(self, alpha: float, x: str, y: str) -> None:
        """``y += alpha * x``."""
        self._vec(y).add_(self._vec(x), alpha=alpha)

    def dot(self, x: str, y: str) -> float:
        """This shard's partial of ``<x, y>`` (the coordinator sums the partials), in float64."""
        return float(torch.dot(self._vec(x).double(), self._vec(y).double()))

    def delete(self, x: str) -> None:
        if x != PARAMS:
            self.vectors.pop(x, None)

    def accumulate(self, x: str, grad, offset: int = 0) -> None:
        """``x += grad`` on our intersection with ``[offset, offset + len(grad))`` (gradient accumulator)."""
        g = _as_tensor(grad)
        lo, hi = max(self.lo, offset), min(self.hi, offset + g.numel())
        if hi > lo:
            self._vec(x)[lo - self.lo : hi - self.lo].add_(g[lo - offset : hi - offset])

    def lincomb(self, dst: str, terms: list[tuple[float, str]]) -> None:
        """``dst = sum(c * v for c, v in terms)``; ``dst`` may appear among the terms.

        One op instead of copy + scale + axpys: a line-search trial point is ``lincomb(params, [(1, x), (t, d)])``.
        """
        out = self._vec(dst)
        # Written in place (never rebinding the tensor): ``params`` shares memory with what fetch() returns.
        acc = torch.zeros_like(out) if any(name == dst for _, name in terms) else out.zero_()
        for c, name in terms:
            acc.add_(self._vec(name), alpha=float(c))
        if acc is not out:
            out.copy_(acc)

    def dots(self, pairs: list[tuple[str, str]]) -> list[float]:
        """This shard's partials of several inner products at once, in float64 (one round trip, not many)."""
        cache: dict[str, torch.Tensor] = {}

        def v64(name: str) -> torch.Tensor:
            if name not in cache:
                cache[name] = self._vec(name).double()
            return cache[name]

        return [float(torch.dot(v64(a), v64(b))) for a, b in pairs]

    def execute(self, program: list[tuple]) -> list:
        """Run a short program of vector ops, e.g. ``[("lincomb", "d", [...]), ("dots", [...])]``, in order, in
        one call; returns each op's result (None for ops without one). Only the vector ops may be named."""
        out = []
        for op, *args in program:
            if op not in VECTOR_OPS:
                raise ValueError(f"shard {self.shard_id}: {op!r} is not a vector op; choose from "
                                 f"{', '.join(sorted(VECTOR_OPS))}")
            out.append(getattr(self, op)(*args))
        return out


VECTOR_OPS = frozenset({"zero", "copy", "scale", "axpy", "dot", "dots", "lincomb", "accumulate", "delete"})
