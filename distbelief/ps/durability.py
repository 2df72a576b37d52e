"""Shard durability: where and how often a parameter shard saves its state, and how it comes back.

A shard in ``snapshot`` mode copies its state into reused buffers when a snapshot is due (the only cost on its
push path) and a background thread serialises, hashes and fsyncs it; in ``log`` mode it also appends every applied
push to a write-ahead log, so a restarted shard replays what its last snapshot lacks. The file formats are in
:mod:`distbelief.ps.checkpoint`; ``ParameterShard`` inherits the behaviour here.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Self

import torch

from distbelief.ps.arrays import PARAMS
from distbelief.ps.cow import TableSnapshot
from distbelief.ps.rules import persistent


def checkpointed_rows(tensors: dict, meta: dict, slicer, shard_id: int) -> tuple[list, list]:
    """``(rows, state)`` of each row group of embedding tables in shard ``shard_id``'s checkpoint (ps/tables.py
    names them ``table.<g>.weight`` and ``table.<g>.opt.<name>``).

    Raises ValueError when they are not this model's tables over ``slicer``'s shards (a checkpoint of a model
    with other tables, or of another number of shards)."""
    where = f"shard {shard_id}: its checkpoint"
    if "table_layout" in meta and meta["table_layout"] != slicer.layout_id():
        raise ValueError(f"{where} holds embedding tables of other shapes than this model's "
                         f"({', '.join(f'{t.num_rows}x{t.dim}' for t in slicer.tables)} rows x dim); resume with "
                         f"the same model")
    rows, state = [], []
    for g, group in enumerate(slicer.groups):
        want = (group.local_rows(shard_id, slicer.num_shards), group.dim)
        w = tensors.get(f"table.{g}.weight")
        if w is None or tuple(w.shape) != want:
            has = "no rows" if w is None else f"{w.shape[0]} rows of width {w.shape[1]}"
            raise ValueError(f"{where} holds {has} for row group {g}, this model's tables over "
                             f"{slicer.num_shards} shards need {want[0]} rows of width {want[1]} there (a model "
                             f"with other tables?); resume with the same model")
        rows.append(w.numpy())
        prefix = f"table.{g}.opt."
        state.append({k[len(prefix):]: v.numpy() for k, v in tensors.items() if k.startswith(prefix)})
    extra = sum(1 for k in tensors if k.startswith("table.") and k.endswith(".weight")) - len(slicer.groups)
    if extra > 0:
        raise ValueError(f"{where} holds {len(slicer.groups) + extra} row groups of embedding tables, this model "
                         f"has {len(slicer.groups)}; resume with the same model")
    return rows, state


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


class SnapshotWriter:
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


class DurableShard:
    """The durability half of ParameterShard (mixed in): snapshots, the write-ahead log, restore."""

    COUNTERS = ("version", "examples", "rejected_pushes", "staleness_sum", "staleness_max", "staleness_count",
                "bytes_pushed", "bytes_fetched")

    def _state(self, copy_into: dict[str, torch.Tensor] | None = None,
               tables: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
        """``(meta, tensors)`` of a checkpoint of the current state. With ``copy_into`` the tensors are copies
        in those (reused) buffers, so the live state may change while they are written. Without ``tables``
        the table arrays are left out (a copy-on-write snapshot writes them: ps/cow.py)."""
        meta = {"shard_id": self.shard_id, "lo": self.lo, "hi": self.hi, "total": self.total}
        meta.update({k: getattr(self, k) for k in self.COUNTERS})
        if self.tables:
            meta["table_layout"] = self.slicer.layout_id()
        tensors = {PARAMS: self.vectors[PARAMS], **(self._table_arrays() if tables else {})}
        tensors.update({f"opt.{k}": v for k, v in persistent(self.optimizer, self.opt_state).items()})
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

    def _write(self, meta: dict, tensors: dict[str, torch.Tensor], cow: TableSnapshot | None = None) -> None:
        """Save one checkpoint (with ``cow``, the tables from that copy-on-write snapshot, a chunk at a time: it
        has a lock of its own against the pushes); in log mode, then drop the logs no kept checkpoint needs."""
        from distbelief.ps.checkpoint import save_checkpoint, save_checkpoint_streamed, shard_dir

        d = self.durability
        if cow is None and not self.tables:
            save_checkpoint(d.root, self.shard_id, meta, tensors, keep=d.keep)
        else:  # tables: streamed, never a whole copy of the state in memory (safetensors' save builds one)
            def pieces(name: str):
                if name in tensors:
                    yield tensors[name]
                    return
                for c in range(cow.num_chunks(name)):
                    yield cow.take(name, c)

            specs = {n: (t.dtype, tuple(t.shape)) for n, t in {**tensors, **(cow.arrays if cow else {})}.items()}
            try:
                save_checkpoint_streamed(d.root, self.shard_id, meta, specs, pieces, keep=d.keep)
            finally:
                if cow is not None:  # (a push that still saves into it after this costs nothing but the copy)
                    self._cow = None
                    self.cow_bytes_max = max(self.cow_bytes_max, cow.saved_bytes_max)
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
            # Tables are written copy-on-write (ps/cow.py) unless co-located replicas change them from their
            # own processes (a shared state): then everything is copied, as a dense shard's slice is.
            cow = None
            if self.tables and not self._shared:
                cow = TableSnapshot(self._table_arrays(), self._table_groups())
            meta, tensors = self._state(copy_into=self._snap_bufs, tables=cow is None)
            self._cow = cow
            self._mark_snapshot()
        self._writer.submit(lambda: self._write(meta, tensors) if cow is None else self._write(meta, tensors, cow))
        self.snapshot_s += time.perf_counter() - t0

    def _after_update(self, start: int, stop: int, num_examples: int, g: torch.Tensor, session: int = 0,
                      seq: int = 0, rows: list | None = None, scale: float = 1.0) -> None:
        d = self.durability
        if d is None:
            return
        if self._wal is not None:
            # A shard with tables logs its rows and the rate scale with the dense part (a record of its own
            # format); a dense shard's records stay as they always were.
            self._wal.append(self.version, start, stop, num_examples, g.numpy(), session, seq,
                             rows=(rows or []) if self.tables else None, scale=scale)
        if not self._snapshot_due(d.every_updates, d.every_seconds):
            return
        if not d.background:
            self.checkpoint()
        elif not self._writer.busy():  # else: the previous snapshot is still being written; try at the next push
            self._snapshot_in_background()

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

    def _replay(self, rec) -> None:
        """Apply one write-ahead log record (``checkpoint.LogRecord``) as its push was applied."""
        a, b = rec.start, rec.stop
        w = self.vectors[PARAMS]
        self.optimizer.apply(w[a:b], torch.from_numpy(rec.grad.copy()),
                             {k: v[a:b] for k, v in self.opt_state.items()}, rec.scale)
        for g, ids, values in rec.rows or ():
            if g >= len(self.tables) or values.shape[1] != self.tables[g].dim:
                raise ValueError(f"shard {self.shard_id}: its write-ahead log has rows of width {values.shape[1]} "
                                 f"for row group {g}, which this model's tables do not have")
            self.tables[g].check(ids, values)
            self.tables[g].apply(self.optimizer, ids, values, rec.scale)
        self.version += 1
        self.examples += rec.num_examples
        self.replayed_updates += 1
        if rec.session:
            self.last_seq[rec.session] = max(rec.seq, self.last_seq.get(rec.session, 0))

    @classmethod
    def restore(cls, shard_id: int, lo: int, hi: int, optimizer, total: int, durability: Durability,
                fallback_values=None, write_base: bool = True, tables: tuple | None = None) -> Self:
        """A shard rebuilt from its latest good checkpoint plus its write-ahead log.

        With no checkpoint at all, ``fallback_values`` (the initial parameters) are used and the whole log is
        replayed. Damaged checkpoints are skipped and listed in ``corrupt_checkpoints``.
        ``tables``: a model with embedding tables, as ``ParameterShard(tables=...)``; a checkpoint's ``table.*``
        arrays (the rows and their rule state) take the place of the fallback rows it carries.
        """
        from distbelief.ps.checkpoint import WriteAheadLog, latest_good_checkpoint

        ck = latest_good_checkpoint(durability.root, shard_id)
        if ck is not None:
            if (ck.meta["lo"], ck.meta["hi"]) != (lo, hi):
                raise ValueError(f"shard {shard_id}: checkpoint {ck.path} covers [{ck.meta['lo']}, {ck.meta['hi']}) "
                                 f"but this shard owns [{lo}, {hi})")
            state = {k[4:]: v.numpy() for k, v in ck.tensors.items() if k.startswith("opt.")}
            if tables is not None and tables[0] is not None:
                tables = (tables[0], *checkpointed_rows(ck.tensors, ck.meta, tables[0], shard_id))
            shard = cls(shard_id, lo, hi, ck.tensors[PARAMS].numpy(), optimizer, total, None, state, ck.meta,
                        tables=tables)
            shard.corrupt_checkpoints = ck.skipped
            if "dedup.sessions" in ck.tensors:
                shard.last_seq = dict(zip(ck.tensors["dedup.sessions"].tolist(), ck.tensors["dedup.seqs"].tolist()))
        else:
            if fallback_values is None:
                raise FileNotFoundError(f"shard {shard_id}: no usable checkpoint under {durability.root}")
            shard = cls(shard_id, lo, hi, fallback_values, optimizer, total, tables=tables)
        shard.restored_from_version = shard.version
        for rec in WriteAheadLog(durability.root, shard_id).replay(shard.version):
            if rec.version_after != shard.version + 1:
                break  # a gap: later records cannot be applied in order
            shard._replay(rec)
        if not write_base:  # read-only restore (resume assembles state from several shards)
            return shard
        shard.durability = durability
        if durability.wal:
            shard._wal = WriteAheadLog(durability.root, shard_id)
        shard.checkpoint()  # a fresh base: the replayed state is durable before we accept new pushes
        return shard
