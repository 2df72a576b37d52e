"""Embedding-table rows on a parameter shard: the shard's side of sparse fetch and push.

Shard ``k`` of ``K`` holds keys ``k, k + K, k + 2K, ...`` of every row group (the tables of one width, ps/slicer.py
says why), at local indices ``0, 1, 2, ...``, with the server rule's per-row state for them
(``rule.init_row_state``). A replica fetches only the rows its minibatch uses and pushes a row-sparse gradient:
unique local row ids (sorted, as a coalesced sparse gradient gives them) and their summed values. The rule updates those rows and their state in place
(``rule.apply_rows``); every other row and its state stay bit for bit as they were.

A push is checked whole before any of it is applied: a row id outside the table is a ``ValueError`` naming the
table (nothing of that push is applied, on this shard or, since the replica's client checks first, on any other);
a non-finite value makes the whole push a counted rejection, like a non-finite dense gradient.

``ShardTables`` is mixed into ``ParameterShard`` (ps/shard.py), which calls ``_check_rows`` / ``_apply_rows``
from its push under its lock.
"""

from __future__ import annotations

import numpy as np
import torch

from distbelief.ps.arrays import as_tensor
from distbelief.ps.memory import transient_copy
from distbelief.ps.rules import persistent

TABLE_PREFIX = "table."  # a table's arrays in checkpoints and shared memory: table.<t>.weight, table.<t>.opt.<name>


def _rows_shaped(a: np.ndarray, num_rows: int, dim: int) -> np.ndarray:
    """A table array stored flat (shared memory, checkpoints) as ``(num_rows, dim)`` or, for one value per row
    (row-wise rule state), ``(num_rows,)``."""
    return a.reshape(num_rows) if a.size == num_rows and dim != 1 else a.reshape(num_rows, dim)


class TableSlice:
    """This shard's rows of one row group: ``weight`` ``(local_rows, dim)`` and the rule's row state."""

    def __init__(self, slicer, group: int, shard_id: int, weight: np.ndarray, state: dict[str, torch.Tensor]):
        self.slicer, self.group, self.shard_id = slicer, group, shard_id
        self.num_shards, self.dim = slicer.num_shards, slicer.groups[group].dim
        self.weight_np = weight
        self.weight = torch.from_numpy(weight)
        self.state = state

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    def _key(self, local: int) -> int:
        return int(local) * self.num_shards + self.shard_id

    def check(self, local_ids: np.ndarray, values=None) -> None:
        """Raise ValueError (naming the table and the global row id) unless ``local_ids`` are sorted unique ids of
        rows this shard holds and ``values`` is ``(len(ids), dim)`` float32."""
        ids = np.asarray(local_ids)
        where = f"shard {self.shard_id}, row group {self.group}"
        if ids.ndim != 1 or ids.dtype != np.int64:
            raise ValueError(f"{where}: row ids must be a 1-D int64 array, got {ids.dtype} {ids.shape}")
        if ids.size and (ids[0] < 0 or ids[-1] >= self.num_rows):
            bad = ids[(ids < 0) | (ids >= self.num_rows)][0]
            raise ValueError(self.slicer.describe_key(self.group, self._key(bad)))
        if ids.size > 1 and not bool(np.all(ids[1:] > ids[:-1])):
            raise ValueError(f"{where}: row ids must be sorted and unique (sum duplicates before pushing)")
        if values is not None:
            v = np.asarray(values)
            if v.dtype != np.float32 or v.size != ids.size * self.dim:
                raise ValueError(f"{where}: values must be float32 of shape ({ids.size}, {self.dim}), got {v.dtype} "
                                 f"{v.shape}")

    def read(self, local_ids: np.ndarray) -> np.ndarray:
        return self.weight_np[local_ids]  # fancy indexing: a copy

    def apply(self, rule, local_ids: np.ndarray, values, scale: float) -> None:
        ids = np.asarray(local_ids)
        # (arrays from Ray's object store are read-only views: wrapped, not copied; the rule only reads them)
        ids_t = torch.from_numpy(ids) if ids.flags.writeable else torch.frombuffer(
            memoryview(ids).cast("B"), dtype=torch.int64) if ids.size else torch.empty(0, dtype=torch.int64)
        rule.apply_rows(self.weight, ids_t, as_tensor(values).reshape(ids.size, self.dim), self.state, scale)


class ShardTables:
    """The table half of ParameterShard (mixed in)."""

    tables: list[TableSlice]

    def _init_tables(self, slicer, rows: list[np.ndarray] | None, state: list[dict] | None) -> None:
        """This shard's rows of each row group of ``slicer`` (None: a model without tables) from their initial
        values (``rows[g]``: ``(local_rows, dim)``; None: zeros, a blank backup) and, for a restored shard, their
        saved rule state (``state[g]``: name -> array)."""
        self.tables = []
        for g, group in enumerate(slicer.groups if slicer is not None else ()):
            n = group.local_rows(self.shard_id, slicer.num_shards)
            w = (np.zeros((n, group.dim), dtype=np.float32) if rows is None
                 else np.array(rows[g], dtype=np.float32, copy=True).reshape(n, group.dim))
            st = self.optimizer.init_row_state(n, group.dim) if self.optimizer is not None else {}
            for name, value in ((state or [{}] * len(slicer.groups))[g] or {}).items():
                st[name].copy_(torch.as_tensor(np.asarray(value, dtype=np.float32)).reshape(st[name].shape))
            self.tables.append(TableSlice(slicer, g, self.shard_id, w, st))

    def _bind_table_storage(self, slicer, storage: dict[str, np.ndarray]) -> None:
        """Row groups over ``storage``'s arrays, in place (a co-located replica's view of a shared shard)."""
        self.tables = []
        for g, group in enumerate(slicer.groups if slicer is not None else ()):
            prefix = f"{TABLE_PREFIX}{g}.opt."
            n = group.local_rows(self.shard_id, slicer.num_shards)
            state = {k[len(prefix):]: torch.from_numpy(_rows_shaped(v, n, group.dim))
                     for k, v in storage.items() if k.startswith(prefix)}
            weight = _rows_shaped(storage[f"{TABLE_PREFIX}{g}.weight"], n, group.dim)
            self.tables.append(TableSlice(slicer, g, self.shard_id, weight, state))

    def _table_arrays(self) -> dict[str, torch.Tensor]:
        """Every table's weight and persistent rule state, by their checkpoint / shared-memory names."""
        out = {}
        for t, tab in enumerate(self.tables):
            out[f"{TABLE_PREFIX}{t}.weight"] = tab.weight
            out.update({f"{TABLE_PREFIX}{t}.opt.{k}": v for k, v in persistent(self.optimizer, tab.state).items()})
        return out

    def _table_groups(self) -> dict[str, int]:
        """The row group of each of ``_table_arrays``' names."""
        return {name: int(name[len(TABLE_PREFIX):].split(".")[0]) for name in self._table_arrays()}

    def _load_table_arrays(self, arrays: dict) -> None:
        """Copy ``_table_arrays``-named arrays (a primary's, for its backup: ps/replication.py) into our rows and
        row state, in place. Every row group must be there: a backup without its primary's rows is no copy."""
        for t, tab in enumerate(self.tables):
            np.copyto(tab.weight_np, np.asarray(arrays[f"{TABLE_PREFIX}{t}.weight"], dtype=np.float32)
                      .reshape(tab.weight_np.shape))
            for name, value in tab.state.items():
                key = f"{TABLE_PREFIX}{t}.opt.{name}"
                if key in arrays:
                    value.numpy()[:] = np.asarray(arrays[key], dtype=np.float32).reshape(value.shape)

    def _bind_tables(self, storage: dict[str, np.ndarray]) -> None:
        for t, tab in enumerate(self.tables):
            n, dim = tab.weight.shape
            tab.weight_np = _rows_shaped(storage[f"{TABLE_PREFIX}{t}.weight"], n, dim)
            tab.weight = torch.from_numpy(tab.weight_np)
            for name in list(tab.state):
                key = f"{TABLE_PREFIX}{t}.opt.{name}"
                if key in storage:
                    tab.state[name] = torch.from_numpy(_rows_shaped(storage[key], n, dim))

    def fetch_rows(self, requests: list, replica_id: int = -1) -> tuple[list, int]:
        """``requests[g]``: sorted unique local row ids of row group ``g`` (None: none). Returns
        ``(values, version)`` with ``values[g]`` a ``(len(ids), dim)`` float32 copy (None where nothing was
        asked)."""
        for tab, ids in zip(self.tables, requests):
            if ids is not None:
                tab.check(ids)
        with self.lock:
            out = [None if ids is None else tab.read(ids) for tab, ids in zip(self.tables, requests)]
            n = sum(len(ids) for ids in requests if ids is not None)
            self.rows_fetched += n
            # what crossed: each row's values, and its 8-byte id in the request
            self.bytes_fetched += sum(v.nbytes for v in out if v is not None) + 8 * n
            return out, self.version

    def read_table(self, t: int) -> np.ndarray:
        """All of this shard's rows of row group ``t`` (a copy; the driver's evaluation and final read, which
        ``bytes_fetched`` does not count: it measures what the replicas move)."""
        with self.lock:  # a copy that leaves the process no larger once it is dropped (ps/memory.py)
            return transient_copy(self.tables[t].weight_np)

    def _check_rows(self, rows) -> bool:
        """Check a push's rows before anything of it is applied: ValueError for a bad id or shape (nothing
        applied), False for non-finite values (a counted rejection), True when they may be applied."""
        if rows is None:
            return True
        if len(rows) != len(self.tables):
            raise ValueError(f"shard {self.shard_id}: a push carries rows for {len(rows)} row groups, the model "
                             f"has {len(self.tables)}")
        for tab, entry in zip(self.tables, rows):
            if entry is not None:
                tab.check(*entry)
        return all(entry is None or bool(np.isfinite(entry[1]).all()) for entry in rows)

    def _apply_rows(self, rows, scale: float, count: bool = True) -> int:
        """Apply a checked push's rows; returns the bytes they carried (counted in ``rows_pushed`` unless not
        ``count``: a synchronous mean counts the rows that arrived, ``_mean_rows``)."""
        if rows is None:
            return 0
        nbytes = 0
        for t, (tab, entry) in enumerate(zip(self.tables, rows)):
            if entry is None:
                continue
            ids, values = entry
            if self._cow is not None:  # a snapshot is being written: save what these rows were, first
                self._cow.before_write(t, ids)
            tab.apply(self.optimizer, ids, values, scale)
            if count:
                self.rows_pushed += len(ids)
            nbytes += np.asarray(values).nbytes + np.asarray(ids).nbytes
        return nbytes

    def _rows_acceptable(self, rows) -> bool:
        """(One gradient of a synchronous mean) ``_check_rows``, where a bad row id, like a non-finite value,
        refuses that gradient whole and the mean goes on without it."""
        try:
            return self._check_rows(rows)
        except ValueError:
            return False

    def _mean_rows(self, grads_rows: list, count: int) -> list | None:
        """The rows of the mean of ``count`` gradients whose checked rows are ``grads_rows`` (each a push's
        ``rows``, or None), per row group None or ``(local_ids, values)``: the union of their row ids, each row's
        values summed over the gradients in their order and divided by ``count``, a gradient without that row
        counting as zero. This is torch's ``(g_1 + ... + g_count) / count`` on the gradients as coalesced sparse
        tensors, and is computed that way. Counts the rows that arrived (``rows_pushed``, ``bytes_pushed``)."""
        if not self.tables:
            return None
        out = []
        for g, tab in enumerate(self.tables):
            total = None
            for rows in grads_rows:
                entry = None if rows is None else rows[g]
                if entry is None:
                    continue
                ids, values = np.asarray(entry[0]), np.asarray(entry[1])
                self.rows_pushed += ids.size
                self.bytes_pushed += ids.nbytes + values.nbytes
                # (ids from Ray's object store are read-only: wrapped, never written)
                ids_t = torch.from_numpy(ids) if ids.size else torch.empty(0, dtype=torch.int64)
                part = torch.sparse_coo_tensor(ids_t[None], as_tensor(values).reshape(ids.size, tab.dim),
                                               (tab.num_rows, tab.dim), is_coalesced=True, check_invariants=False)
                total = part if total is None else total + part
            if total is None:
                out.append(None)
                continue
            mean = (total / count).coalesce()  # (already coalesced: a sum of coalesced tensors keeps ids sorted)
            out.append((mean.indices()[0].numpy(), mean.values().numpy()))
        return out
