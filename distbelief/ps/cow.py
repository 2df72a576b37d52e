"""Copy-on-write snapshots of a shard's embedding tables: a background snapshot that does not double the shard.

Why: a snapshot must be the state at one version (the write-ahead log starts there; ``snapshot`` mode counts the
updates since it exactly), and the shard keeps serving pushes while it is written. For a dense slice the shard
copies it into a reused buffer under its lock (a memcpy). For tables that copy would double the shard's memory for
good — the rows and their rule state are almost all of it (docs/tables.md). Instead the writer thread copies the
tables a chunk of rows at a time, under the shard's lock, in order; a push that is about to change rows the
writer has not taken yet first saves those rows as they were (``before_write``), and the writer puts them back
into its copy of their chunk. What the writer gets for each chunk is therefore the chunk at the snapshot's version,
and the extra memory is one chunk, a byte per row (which rows are saved), and the rows pushes changed before the
writer reached them. Rows, not chunks: a minibatch's rows fall all over a table (a Zipf tail is spread evenly),
so saving whole chunks touched was measured to copy most of the table within a few pushes.

Not for a shard whose state is shared with co-located replicas (ps/colocated.py): their pushes change the memory
from another process, which cannot save chunks here; such a shard copies everything, as a dense one.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

CHUNK_BYTES = 1 << 20  # rows copied at a time, per array (~1 MiB)


def _row_bytes(a: torch.Tensor) -> int:
    return max(1, a[:1].numel() * a.element_size())


class TableSnapshot:
    """The snapshot's view of the table arrays (``arrays``: name -> live tensor, rows along dim 0; ``group_of``:
    name -> its row group). ``take(name, c)`` (by the writer thread, chunks of one array in order) and
    ``before_write(group, rows)`` (by a push, on the shard's thread, before it changes those rows) exclude each
    other with a lock of their own: the shard's lock is no lock at all unless its state is shared (ps/shard.py),
    and a take between a push's check and its save would miss the rows it saves."""

    def __init__(self, arrays: dict[str, torch.Tensor], group_of: dict[str, int]):
        self.arrays, self.group_of = arrays, group_of
        self.rows_per_chunk = {name: max(1, CHUNK_BYTES // _row_bytes(a)) for name, a in arrays.items()}
        self.next_chunk = {name: 0 for name in arrays}  # chunks below this one are written
        # rows saved as they were at the snapshot, per array: a mask (one byte a row, so that a row is saved
        # once) and the saved (ids, values) blocks, given back as the writer passes them
        self._mask = {name: np.zeros(a.shape[0], dtype=np.bool_) for name, a in arrays.items()}
        self._saved: dict[str, list[tuple[np.ndarray, torch.Tensor]]] = {name: [] for name in arrays}
        self.saved_bytes = 0
        self.saved_bytes_max = 0  # the most saved rows held at once (what copy-on-write cost, beyond the masks)
        self._lock = threading.Lock()
        # One buffer every chunk is copied into, allocated here, on the shard's thread: the writer thread then
        # allocates nothing large. (Measured: a fresh 4 MiB copy per chunk, freed in the writer thread's own
        # malloc arena, left ~100 MiB resident per shard after a few snapshots.)
        self._buf = torch.empty(max(self.rows_per_chunk[n] * _row_bytes(a) for n, a in arrays.items()) if arrays
                                else 0, dtype=torch.uint8)

    def num_chunks(self, name: str) -> int:
        n, r = self.arrays[name].shape[0], self.rows_per_chunk[name]
        return (n + r - 1) // r

    def before_write(self, group: int, local_rows) -> None:
        """Rows ``local_rows`` of row group ``group`` are about to change: save those the writer has not taken
        yet and that are not saved already, as they are now."""
        rows = np.asarray(local_rows, dtype=np.int64).reshape(-1)
        if not rows.size:
            return
        with self._lock:
            self._save(group, rows)

    def _save(self, group: int, rows: np.ndarray) -> None:
        for name, g in self.group_of.items():
            if g != group:
                continue
            new = rows[rows >= self.next_chunk[name] * self.rows_per_chunk[name]]
            new = np.unique(new[~self._mask[name][new]])
            if not new.size:
                continue
            self._mask[name][new] = True
            values = self.arrays[name][torch.from_numpy(new)]  # (a copy: indexing gathers)
            self._saved[name].append((new, values))
            self.saved_bytes += new.nbytes + values.numel() * values.element_size()
        self.saved_bytes_max = max(self.saved_bytes_max, self.saved_bytes)

    def take(self, name: str, c: int) -> torch.Tensor:
        """Chunk ``c`` of ``name`` as it was at the snapshot: the live rows, with the rows pushes changed since
        put back as they were. A copy in the snapshot's one buffer: valid until the next ``take``."""
        with self._lock:
            return self._take(name, c)

    def _take(self, name: str, c: int) -> torch.Tensor:
        r = self.rows_per_chunk[name]
        live = self.arrays[name]
        lo, hi = c * r, min((c + 1) * r, live.shape[0])
        chunk = live[lo:hi]
        piece = self._buf[: chunk.numel() * chunk.element_size()].view(live.dtype).view(chunk.shape)
        piece.copy_(chunk)
        self.next_chunk[name] = c + 1
        later = []
        for ids, values in self._saved[name]:
            here = ids < hi  # (ids below lo were given back with an earlier chunk)
            if here.any():
                sel = torch.from_numpy(here)
                piece[torch.from_numpy(ids[here] - lo)] = values[sel]
                self.saved_bytes -= int(here.sum()) * (8 + values[:1].numel() * values.element_size())
            if not here.all():
                later.append((ids[~here], values[torch.from_numpy(~here)]))
        self._saved[name] = later
        return piece
