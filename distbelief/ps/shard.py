"""ParameterShard: owns one contiguous slice of the flat parameter vector and the server optimizer's state for it.

Plain Python, no engine: the runtime decides whether a shard lives in this process or in a Ray actor. A shard is
called by one thread at a time (a Ray actor executes calls sequentially; the in-process runtime holds a lock);
a shard shared with co-located replicas (ps/colocated.py) is also changed by their processes, under its lock.

Its jobs, one module each: Downpour's fetch/push and the server update (here), durability (ps/durability.py),
replication to a backup shard (ps/replication.py), and Sandblaster's vector algebra on named slice-vectors
(ps/vectors.py).
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
import uuid

import numpy as np
import torch

from distbelief.compression.wire import Fetched, dense_push, sparse_push
from distbelief.ps.arrays import PARAMS, all_finite, as_tensor
from distbelief.ps.durability import Durability, DurableShard, SnapshotWriter
from distbelief.ps.memory import process_memory, tensor_bytes
from distbelief.ps.replication import ReplicatedShard
from distbelief.ps.rules import persistent, steps_pushed_values_alone
from distbelief.ps.tables import ShardTables
from distbelief.ps.vectors import VECTOR_OPS, VectorAlgebra

__all__ = ["PARAMS", "VECTOR_OPS", "Durability", "ParameterShard"]

# A shard's counters live in one int64 array, so that a shared shard (ps/colocated.py) keeps them in shared
# memory with its parameters: co-located replicas update them under the shard's lock.
_COUNTER_SLOTS = ("version", "examples", "rejected_pushes", "staleness_sum", "staleness_max", "staleness_count",
                  "bytes_pushed", "bytes_fetched", "_last_ckpt_version", "_last_ckpt_time_ns", "_snapshot_claimed",
                  "rows_pushed", "rows_fetched")
# The applied pushes by staleness, in the buckets STALENESS_BUCKETS names (after the counters, same array).
STALENESS_BUCKETS = ("0", "1", "2", "3", "4-7", "8-15", "16-31", "32+")
_HIST0 = len(_COUNTER_SLOTS)


def staleness_bucket(staleness: int) -> int:
    """The index in STALENESS_BUCKETS of a push ``staleness`` updates old."""
    return staleness if staleness < 4 else min(7, staleness.bit_length() + 1)


def _counter(slot: int) -> property:
    def get(self) -> int:
        return int(self._ctr[slot])

    def set(self, value: int) -> None:
        self._ctr[slot] = value

    return property(get, set)


class ParameterShard(DurableShard, ReplicatedShard, VectorAlgebra, ShardTables):
    """A slice ``[lo, hi)`` of the flat parameters plus the server optimizer state for it.

    Args:
        shard_id: index of this shard.
        lo, hi: the flat range owned.
        init_values: float32 array of length ``hi - lo`` with the initial parameter values.
        optimizer: a server rule from :mod:`distbelief.ps.optimizers`, or None for a shard used only for vectors.
        total: total number of model parameters (used to validate pushes).
        storage, lock: (ps/colocated.py) arrays to use as the state, in place — ``params``, ``opt.<name>``,
            ``table.<t>.*`` and ``counters`` — and the lock that guards them; a replica's view of a shared shard is
            built this way.
        tables: ``(slicer, rows, state)`` for a model with embedding tables (ps/slicer.py): this shard holds keys
            ``shard_id, shard_id + K, ...`` of each of the slicer's row groups; ``rows[g]`` their initial values
            (None: zeros), ``state[g]`` a restored shard's rule state for them (None: fresh).
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
    # Embedding-table rows (ps/tables.py) written by pushes and read by fetches.
    rows_pushed = _counter(11)
    rows_fetched = _counter(12)

    def __init__(self, shard_id: int, lo: int, hi: int, init_values, optimizer, total: int,
                 durability: Durability | None = None, init_state: dict | None = None,
                 counters: dict | None = None, storage: dict[str, np.ndarray] | None = None, lock=None,
                 tables: tuple | None = None):
        if hi <= lo:
            raise ValueError(f"shard {shard_id}: empty range [{lo}, {hi})")
        # This process's memory before the shard allocates anything of its own: the runtime's base (ps/memory.py;
        # None for a co-located replica's view of a shared shard, and where it cannot be measured).
        self.base_memory = process_memory() if storage is None else None
        self.shard_id, self.lo, self.hi, self.total = shard_id, lo, hi, total
        self.optimizer = optimizer
        # Held while the state changes or is read as a whole. A no-op unless the state is shared with
        # co-located replicas (share()), whose processes then take the same lock.
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self._shared: dict | None = None
        self.opt_state = optimizer.init_state(hi - lo) if optimizer is not None else {}
        slicer, rows, rows_state = tables or (None, None, None)
        self.slicer = slicer
        if storage is not None:
            self._bind_table_storage(slicer, storage)
            self._bind(storage)
        else:
            values = np.array(init_values, dtype=np.float32, copy=True).reshape(-1)
            if values.size != hi - lo:
                raise ValueError(f"shard {shard_id}: init_values has {values.size} elements, range needs "
                                 f"{hi - lo}")
            self._params_np = values
            self.vectors: dict[str, torch.Tensor] = {PARAMS: torch.from_numpy(values)}
            for name, value in (init_state or {}).items():
                self.opt_state[name].copy_(as_tensor(np.asarray(value, dtype=np.float32)).reshape(-1))
            self._ctr = np.zeros(_HIST0 + len(STALENESS_BUCKETS), dtype=np.int64)
            for name in self.COUNTERS:
                setattr(self, name, int((counters or {}).get(name, 0)))
            self._last_ckpt_version = self.version
            self._last_ckpt_time_ns = time.monotonic_ns()
            self._init_tables(slicer, rows, rows_state)
        # Delta fetches (--compress-fetch delta): this process's token, and per value the version at which it last
        # changed (allocated at the first delta fetch). Sparse pushes also log what they changed (``_changes``:
        # (version, positions), every change after version ``_changes_base``), so that a delta fetch after them
        # reads the log instead of scanning the range.
        self.token = uuid.uuid4().hex[:16]
        self._modified: np.ndarray | None = None
        self._changes: collections.deque = collections.deque()
        self._changes_size = 0
        self._changes_base = 0
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
        self._writer = SnapshotWriter()
        self._snap_bufs: dict[str, torch.Tensor] = {}  # reused by every background snapshot
        self._cow = None  # the copy-on-write snapshot of the tables being written (ps/cow.py), if one is
        self.cow_bytes_max = 0  # the most table chunks a snapshot had to save from pushes at once
        self.snapshot_s = 0.0  # time the push path spent copying state for background snapshots
        if durability is not None:
            from distbelief.ps.checkpoint import WriteAheadLog

            if durability.wal:
                self._wal = WriteAheadLog(durability.root, shard_id)
                self._wal.start(self.version)

    # ------------------------------------------------------------------ sharing with co-located replicas
    def _bind(self, storage: dict[str, np.ndarray]) -> None:
        """Use ``storage``'s arrays as this shard's state, in place (ps/colocated.py)."""
        self._params_np = storage[PARAMS]
        self.vectors = {PARAMS: torch.from_numpy(self._params_np)}
        for name in list(self.opt_state):
            if f"opt.{name}" in storage:
                self.opt_state[name] = torch.from_numpy(storage[f"opt.{name}"])
        self._ctr = storage["counters"]
        self._bind_tables(storage)

    def share(self, base: str, timeout_s: float = 120.0) -> dict | None:
        """Move this shard's state into shared memory (files ``<base>-s<id>-...``, ``base`` a path prefix in
        /dev/shm) so that replicas on this machine apply their pushes to it themselves (ps/colocated.py);
        returns what they need to map it, the same on every call. None when this shard cannot be shared: a
        vector-only shard, one that logs every push (``--durability log``), or one that forwards every push to a
        backup (``--durability replicate``)."""
        if self.optimizer is None or self._wal is not None or self.replicated:
            return None
        if self._shared is None:
            from distbelief.ps.sharedmem import COUNTERS_FILE, ShardLock, create_storage, remove_older

            self._writer.wait()  # a snapshot in flight reads our buffers, not the state: safe, but keep it simple
            mine = f"{base}-s{self.shard_id}-{time.monotonic_ns():x}"
            arrays = {PARAMS: self._params_np, COUNTERS_FILE: self._ctr}
            arrays.update({f"opt.{k}": v.numpy() for k, v in persistent(self.optimizer, self.opt_state).items()})
            arrays.update({k: v.numpy() for k, v in self._table_arrays().items()})
            files, maps = create_storage(mine, arrays)
            # The state a dead predecessor of this shard left behind is garbage now (what replicas applied to it
            # after its last snapshot is counted lost): unlink it, so that repeated restarts do not fill
            # /dev/shm. Replicas still mapping it keep their mapping until they switch to us.
            remove_older(f"{base}-s{self.shard_id}-", keep=mine)
            self._bind(maps)
            lock_path = files[COUNTERS_FILE][0]
            self.lock = ShardLock(lock_path, timeout_s)
            d = self.durability
            self._shared = {
                "shard_id": self.shard_id, "lo": self.lo, "hi": self.hi, "total": self.total,
                "optimizer": self.optimizer, "files": files, "lock": lock_path, "tables": self.slicer,
                "every_updates": d.every_updates if d else 0, "every_seconds": d.every_seconds if d else 0.0,
            }
        return self._shared

    def read_into(self, out: np.ndarray) -> int:
        """Copy the parameter slice into ``out[lo:hi]`` (a flat, full-length buffer); returns its version."""
        with self.lock:
            out[self.lo : self.hi] = self._params_np
            self.bytes_fetched += self._params_np.nbytes
            return self.version

    # ------------------------------------------------------------------ Downpour
    def fetch(self, replica_id: int = -1, half: bool = False, since: tuple[str, int] | None = None
              ) -> tuple[np.ndarray | Fetched, int]:
        """The live parameter slice and its version. Callers in the same process must copy it. ``half``: as
        float16 (a copy; half the bytes on the wire, ``--compress-fetch fp16``). ``since``: a delta fetch
        (``--compress-fetch delta``): ``(token, version)`` of the caller's last fetch from this shard, or
        ``("", -1)`` for none; the answer is a ``Fetched`` with only the values changed since then when that is
        smaller than the whole range (the same token: this process served that fetch), else the whole range."""
        with self.lock:  # shared: co-located replicas write it meanwhile, so a copy taken under the lock
            if since is not None:
                return self._fetch_delta(*since), self.version
            if half:  # torch's conversion: the same bits as numpy's astype, ten times faster
                values = torch.from_numpy(self._params_np).to(torch.float16).numpy()
            else:
                values = self._params_np.copy() if self._shared else self._params_np
            self.bytes_fetched += values.nbytes
            return values, self.version

    def _fetch_delta(self, token: str, version: int) -> Fetched:
        if self._modified is None:  # the first delta fetch: every value counts as changed now
            self._modified = np.full(self.hi - self.lo, self.version, dtype=np.int64)
            self._reset_changes()
        if token == self.token and 0 <= version <= self.version:
            idx = self._changed_since(version)
            if idx.size * 8 < self._params_np.nbytes:  # 4 bytes of position + 4 of value, against 4 each
                out = Fetched(self.token, idx, self._params_np[idx])
                self.bytes_fetched += out.nbytes
                return out
        out = Fetched(self.token, None, self._params_np.copy())
        self.bytes_fetched += out.nbytes
        return out

    def _mark_changed(self, a: int, b: int, g) -> None:
        """Record the version at which ``[a, b)`` (local) changed, for delta fetches: where the gradient was not 0
        if the rule keeps such values bit for bit, else all of it."""
        if self._modified is None:
            return
        m = self._modified[a:b]
        if getattr(self.optimizer, "zero_gradient_keeps", False):
            m[np.asarray(g) != 0] = self.version
        else:
            m[:] = self.version
        self._reset_changes()

    def _mark_changed_at(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Record that the values at ``positions`` (local, increasing) whose pushed ``values`` are not 0 changed at
        this version, and log them."""
        if self._modified is None:
            return
        at = positions.numpy()  # (numpy's mask and scatter: several times torch's on tens of thousands of values)
        nonzero = values.numpy() != 0
        if not nonzero.all():
            at = at[nonzero]
        self._modified[at] = self.version
        positions = at.astype(np.int32)
        self._changes.append((self.version, positions))
        self._changes_size += positions.size
        while self._changes_size > (self.hi - self.lo) // 8:  # older changes: a fetch from before them scans
            self._changes_base, dropped = self._changes.popleft()
            self._changes_size -= dropped.size

    def _reset_changes(self) -> None:
        """Forget the log: the changes up to this version are in ``_modified`` alone."""
        self._changes.clear()
        self._changes_size, self._changes_base = 0, self.version

    def _changed_since(self, version: int) -> np.ndarray:
        """Positions (local, int32, increasing) of the values changed after ``version``: from the log when it
        reaches back that far, else by scanning ``_modified``."""
        if version < self._changes_base:
            return np.flatnonzero(self._modified > version).astype(np.int32)
        newer = [p for v, p in self._changes if v > version]
        if not newer:
            return np.empty(0, dtype=np.int32)
        if len(newer) == 1:
            return newer[0].copy()  # the log's own array stays the log's
        # The union of the logged positions. Not np.unique: a stable sort of int32 is a radix sort, 10-20x faster
        # on the tens of thousands of positions a top-k push logs (this runs on every delta fetch).
        merged = np.concatenate(newer)
        merged.sort(kind="stable")
        keep = np.empty(merged.size, dtype=bool)
        keep[0] = True
        np.not_equal(merged[1:], merged[:-1], out=keep[1:])
        return merged[keep]

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
             session: int = 0, seq: int = 0, rows: list | None = None) -> int:
        """Apply an accumulated gradient covering flat ``[offset, offset + len(grad))`` to our intersection.

        ``based_on_version`` is the version of this shard the replica's parameters came from; the difference to
        our current version is the push's staleness. Returns our version after the push. A push with a
        non-finite value or a range outside the model is rejected and counted, never applied.

        ``rows`` (a model with embedding tables): per row group None or ``(local_ids, values)``, this shard's rows
        of the push's row-sparse gradient (ps/tables.py); applied with the dense part as one update. A row id
        outside its table raises ValueError before anything of the push is applied.
        """
        with self.lock:
            return self._push(grad, offset, based_on_version, num_examples, session, seq, rows)

    def _push(self, grad, offset: int, based_on_version: int, num_examples: int, session: int, seq: int,
              rows: list | None = None) -> int:
        if session and seq <= self.last_seq.get(session, 0):
            self.duplicate_pushes += 1
            return self.version
        rows_ok = self._check_rows(rows)  # raises for a bad row id: nothing of this push is applied
        sparse = self._sparse(grad, rows)
        if sparse is not None:
            return self._push_values(*sparse, based_on_version, num_examples, session, seq)
        grad, offset, wire = dense_push(grad, offset, self.lo, self.hi)  # a compressed push: decoded here
        g_all = as_tensor(grad)
        n = g_all.numel()
        if offset < 0 or offset + n > self.total or g_all.dtype != torch.float32:
            self.rejected_pushes += 1
            return self.version
        lo, hi = max(self.lo, offset), min(self.hi, offset + n)
        if hi <= lo:
            return self.version
        g = g_all[lo - offset : hi - offset]
        # what arrived, read even if rejected below as non-finite (a compressed push: its payload)
        self.bytes_pushed += g.numel() * g.element_size() if wire is None else wire
        if not all_finite(g) or not rows_ok:
            self.rejected_pushes += 1
            return self.version
        a, b = lo - self.lo, hi - self.lo
        w = self.vectors[PARAMS]
        staleness = max(0, self.version - int(based_on_version))
        scale = self.optimizer.rate_scale(staleness)
        if a == 0 and b == self.hi - self.lo:
            self.optimizer.apply(w, g, self.opt_state, scale)
        else:
            self.optimizer.apply(w[a:b], g, {k: v[a:b] for k, v in self.opt_state.items()}, scale)
        self.bytes_pushed += self._apply_rows(rows, scale)
        self._count_push(staleness, num_examples, session, seq)
        self._mark_changed(a, b, g)
        self._after_update(a, b, int(num_examples), g, session, seq, rows, scale)
        if self._backup is not None:  # --durability replicate (co-located pushes never come here with one)
            self._forward(g.numpy(), lo, based_on_version, num_examples, session, seq, grad if offset == 0 else None,
                          rows=rows)
        return self.version

    def _count_push(self, staleness: int, num_examples: int, session: int, seq: int) -> None:
        """An applied push: its staleness, the new version, its examples and sequence number."""
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)
        self.staleness_count += 1
        self._ctr[_HIST0 + staleness_bucket(staleness)] += 1
        self.version += 1
        self.examples += int(num_examples)
        if session:
            self.last_seq[session] = seq

    def _sparse(self, grad, rows) -> tuple | None:
        """``(positions, values, wire bytes)`` when this push may step only the values it carries: a sparse
        scheme's part of our whole range (``--compress topk``), no table rows, a rule that is elementwise and
        keeps values whose gradient is 0, and nothing that needs the dense gradient (a write-ahead log, a
        backup). None otherwise: the push is decoded and applied densely, with the same result."""
        if (rows is not None or self._wal is not None or self._backup is not None
                or not steps_pushed_values_alone(self.optimizer)):
            return None
        return sparse_push(grad, self.lo, self.hi)

    def _push_values(self, positions: torch.Tensor, values: torch.Tensor, wire: int, based_on_version: int,
                     num_examples: int, session: int, seq: int) -> int:
        """A sparse push (``_sparse``): the rule's step on the values it carries and their state, gathered and
        written back; every other value and its state stay as they are, as the dense step would leave them."""
        self.bytes_pushed += wire
        if not all_finite(values):
            self.rejected_pushes += 1
            return self.version
        staleness = max(0, self.version - int(based_on_version))
        scale = self.optimizer.rate_scale(staleness)
        w = self.vectors[PARAMS]
        state = {k: v.index_select(0, positions) for k, v in persistent(self.optimizer, self.opt_state).items()}
        stepped = w.index_select(0, positions)
        self.optimizer.apply(stepped, values.contiguous(), state, scale)
        w.index_copy_(0, positions, stepped)
        for k, v in state.items():
            self.opt_state[k].index_copy_(0, positions, v)
        self._count_push(staleness, num_examples, session, seq)
        self._mark_changed_at(positions, values)
        self._after_update(0, self.hi - self.lo, int(num_examples), None, session, seq, None, scale)
        return self.version

    def apply_mean(self, *grads, offset: int = 0) -> int:
        """Synchronous data parallelism: average gradients, apply one update. Returns the version. Each gradient
        covers flat ``[offset, offset + its length)``: the whole vector (``offset`` 0), or the range of it that the
        runtime sent this shard (``Runtime.call_with_parts``: no full-length vector is built for it).

        With embedding tables each gradient is ``(vector, rows)``, ``rows`` this shard's rows of it as a push
        carries them (ps/tables.py): the mean's rows are the union of the gradients' rows, each summed over the
        gradients and divided by their number (a gradient without a row counts as zero there), applied with the
        dense mean as one update (``_mean_rows``); rows no gradient carries, and their rule state, stay bit for
        bit as they were. A gradient with a non-finite value, a range of the wrong length or a row id outside its
        table is refused whole (counted in ``rejected_pushes``) and the mean is over the others."""
        with self.lock:
            return self._apply_mean(grads, offset)

    def _apply_mean(self, grads, base: int) -> int:
        acc, accepted, taken = None, 0, []
        for grad in grads:
            grad, rows = grad if isinstance(grad, tuple) else (grad, None)
            grad, offset, wire = dense_push(grad, base, self.lo, self.hi)  # a compressed part: its range, decoded
            start = self.lo - offset  # (negative: the gradient starts after our range begins, so it is not ours)
            g = as_tensor(grad)[start : start + self.hi - self.lo] if start >= 0 else as_tensor(grad)[:0]
            if g.numel() == self.hi - self.lo:
                self.bytes_pushed += g.numel() * g.element_size() if wire is None else wire
            if g.numel() != self.hi - self.lo or not all_finite(g) or not self._rows_acceptable(rows):
                self.rejected_pushes += 1
                continue
            acc = g.clone() if acc is None else acc.add_(g)
            accepted += 1
            taken.append(rows)
        if acc is None:
            return self.version
        acc.div_(accepted)
        rows = self._mean_rows(taken, accepted)  # None for a model without tables
        self.optimizer.apply(self.vectors[PARAMS], acc, self.opt_state)
        self._apply_rows(rows, 1.0, count=False)
        self.staleness_count += 1  # a synchronous update is never stale
        self._ctr[_HIST0] += 1
        self.version += 1
        self._mark_changed(0, self.hi - self.lo, acc)
        self._after_update(0, self.hi - self.lo, 0, acc, rows=rows)  # logged with its rows, as a push
        # the backup applies the mean as a push of staleness 0: the same update (rows too), the same counters
        self._forward(acc.numpy(), self.lo, self.version - 1, 0, 0, 0, wait=True, rows=rows)
        return self.version

    def set_params(self, values) -> int:
        """Overwrite the parameter slice (used by warmstart from a checkpoint)."""
        with self.lock:
            self.vectors[PARAMS].copy_(as_tensor(values).reshape(-1))
            if self._modified is not None:
                self._modified[:] = self.version + 1  # every value changed: the next delta fetch is whole
                self._reset_changes()
                self._changes_base = self.version + 1
            return self.version

    def memory(self) -> dict:
        """What this shard holds and what its process measures (ps/memory.py; docs/tables.md, "Tables larger than
        one process"): ``table_bytes`` (its rows of every table and their rule state), ``dense_bytes`` (its dense
        range and the rule's state for it), ``snapshot_bytes`` (the reused copy a background snapshot takes: of
        the dense part; of the tables too only when they are shared with co-located replicas, else they are
        written copy-on-write, ps/cow.py), ``snapshot_cow_bytes_max`` (the most table chunks a snapshot saved
        from pushes at once), ``process`` (``process_memory()`` now) and ``base`` (the same, taken
        before the shard allocated anything). ``shared``: the state lives in /dev/shm for co-located replicas
        (then it is not in this process's USS)."""
        with self.lock:
            table = tensor_bytes(t.weight for t in self.tables)
            table += tensor_bytes(v for t in self.tables for v in t.state.values())
            dense = self._params_np.nbytes + tensor_bytes(self.opt_state.values())
        return {"shard_id": self.shard_id, "pid": os.getpid(), "table_rows": sum(t.num_rows for t in self.tables),
                "table_bytes": table, "dense_bytes": dense, "snapshot_bytes": tensor_bytes(self._snap_bufs.values()),
                "snapshot_cow_bytes_max": self.cow_bytes_max,
                "checkpoints_written": self.checkpoints_written, "shared": self._shared is not None, "process": process_memory(), "base": self.base_memory}

    def stats(self) -> dict:
        return {
            "shard_id": self.shard_id,
            "updates": self.version,
            "examples": self.examples,
            "rejected_pushes": self.rejected_pushes,
            "staleness_sum": self.staleness_sum,
            "staleness_max": self.staleness_max,
            "staleness_count": self.staleness_count,
            "staleness_histogram": [int(c) for c in self._ctr[_HIST0:]],
            "bytes_pushed": self.bytes_pushed,
            "bytes_fetched": self.bytes_fetched,
            "rows_pushed": self.rows_pushed,
            "rows_fetched": self.rows_fetched,
            "table_rows": sum(t.num_rows for t in self.tables),
            "restored_from_version": self.restored_from_version,
            "replayed_updates": self.replayed_updates,
            "corrupt_checkpoints": list(self.corrupt_checkpoints),
            "checkpoints_written": self.checkpoints_written,
            "snapshot_version": self._last_ckpt_version,
            "snapshot_s": self.snapshot_s,
            "duplicate_pushes": self.duplicate_pushes,
            **self.replication_stats(),
        }
