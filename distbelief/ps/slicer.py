"""The slicer: which shard holds which key of a model.

A key is either an element range of the model's **dense** parameters or a **row** of one of its embedding tables
(every ``nn.Embedding`` / ``nn.EmbeddingBag`` found in the model):

- dense parameters (all but the tables' weights), concatenated in ``named_parameters()`` order, are cut into
  balanced contiguous ranges exactly as ``ShardLayout.balanced`` does for a model without tables (a tensor may
  span shards; shard sizes differ by at most one element);
- table rows are sharded by **modulo** over their keys. Tables of the same width form a **row group** (a model's
  26 fields of dim 16 are one group), in which row ``r`` of table ``t`` has the key ``base_t + r`` (``base_t``:
  the rows of the group's tables before ``t``). Key ``q`` lives on shard ``q % K``, at local index ``q // K``.

Why modulo and not contiguous blocks or a hash: categorical ids are usually ranked by frequency (id 0 the most
frequent value of a field, as in a frequency-sorted vocabulary), so a contiguous split would put every hot row on
shard 0 and make it the bottleneck; modulo deals the hottest rows round-robin over all shards and keeps row counts
balanced to one row, where a hash is only balanced on average. It needs no table of its own, and resharding a
checkpoint from K to K' shards is the same arithmetic with K'.

Why row groups: a minibatch touches a few rows of each of many tables; moving them per table would cost one
small operation (and, across processes, one message) per table per step, which dominates at CTR scale. Within a
group every fetch and push is one array of keys and one of rows, whatever the number of tables.

``Slicer`` is a ``ShardLayout`` (over the dense part) with the tables added, so code that only moves dense ranges
takes it unchanged; for a model without tables it is exactly ``ShardLayout.balanced(total, K)``.

The model's **full** flat vector (``flatten(model)``: every parameter in ``named_parameters()`` order, tables
included) stays the driver's and the checkpoint's view of the whole model; ``to_dense`` / ``table_values`` /
``assemble`` convert between it and the shards' keys.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from distbelief.exceptions import ConfigError
from distbelief.ps.sharding import ShardLayout


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: the module's name in the model, its shape, where its weight sits in the model's
    full flat vector (``flat[offset : offset + num_rows * dim]``, row-major), and its place among the keys:
    row ``r`` is key ``base + r`` of row group ``group``."""

    module: str
    kind: str  # "Embedding" or "EmbeddingBag"
    num_rows: int
    dim: int
    offset: int
    group: int = 0
    base: int = 0

    @property
    def param(self) -> str:
        return f"{self.module}.weight" if self.module else "weight"

    @property
    def numel(self) -> int:
        return self.num_rows * self.dim

    def name(self) -> str:
        return f"table {self.module!r} ({self.kind}, {self.num_rows:,} rows)"


@dataclass(frozen=True)
class RowGroup:
    """The tables of one width, as one key space: ``tables`` (indices into ``Slicer.tables``) in key order."""

    dim: int
    num_rows: int
    tables: tuple[int, ...]
    bases: tuple[int, ...]  # each table's first key

    def local_rows(self, shard_id: int, num_shards: int) -> int:
        """How many of this group's keys shard ``shard_id`` holds (keys ``shard_id, shard_id + K, ...``)."""
        return len(range(shard_id, self.num_rows, num_shards))


def find_tables(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every embedding table in ``model``, in ``named_modules()`` order.

    Raises ConfigError for a table whose forward changes its own weight (``max_norm``) or that cannot produce a
    row-sparse gradient (``EmbeddingBag(mode="max")``), and for a table whose weight is shared with another
    parameter name (tied weights): the shards could not keep its rows apart."""
    found = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            continue
        label = f"{type(m).__name__} {name or '(the model)'!r}"
        if m.max_norm is not None:
            raise ConfigError("model", f"{label} has max_norm set: its forward renormalises rows in place, which a "
                                       f"parameter server cannot replay; remove max_norm")
        if isinstance(m, nn.EmbeddingBag) and m.mode == "max":
            raise ConfigError("model", f"{label} uses mode='max', which has no row-sparse gradient; use 'sum' or "
                                       f"'mean'")
        found.append((name, m))
    return found


@dataclass(frozen=True)
class Slicer(ShardLayout):
    """Dense ranges (the ``ShardLayout`` fields, over the dense part only) plus row-sharded tables.

    ``full_total``: elements of the model's full flat vector; ``tables``: the embedding tables; ``dense_pieces``:
    ``(full_offset, numel)`` of each dense parameter tensor, in order (their concatenation is the dense vector)."""

    full_total: int = 0
    tables: tuple[TableSpec, ...] = ()
    dense_pieces: tuple[tuple[int, int], ...] = field(default=())
    groups: tuple[RowGroup, ...] = ()

    @classmethod
    def for_model(cls, model: nn.Module, num_shards: int) -> Slicer:
        table_params = {(f"{n}.weight" if n else "weight"): (n, m) for n, m in find_tables(model)}
        tables, pieces, offset = [], [], 0
        dims: list[int] = []  # one row group per table width, in order of first appearance
        group_rows: list[int] = []
        seen: dict[int, str] = {}
        for pname, p in model.named_parameters():
            if id(p) in seen:  # named_parameters() yields a shared tensor once; be explicit anyway
                continue
            seen[id(p)] = pname
            if pname in table_params:
                mname, m = table_params[pname]
                rows, dim = int(p.shape[0]), int(p.shape[1])
                if dim not in dims:
                    dims.append(dim)
                    group_rows.append(0)
                g = dims.index(dim)
                tables.append(TableSpec(mname, type(m).__name__, rows, dim, offset, g, group_rows[g]))
                group_rows[g] += rows
            else:
                pieces.append((offset, p.numel()))
            offset += p.numel()
        dense_total = sum(n for _, n in pieces)
        if tables and dense_total < num_shards:
            raise ConfigError("shards", f"{num_shards} shards for a model whose dense part has only {dense_total} "
                                        f"parameters; use at most {max(1, dense_total)} shards")
        base = ShardLayout.balanced(dense_total, num_shards) if dense_total else ShardLayout(0, (0,) * (num_shards + 1))
        groups = tuple(RowGroup(dim, group_rows[g], tuple(i for i, t in enumerate(tables) if t.group == g),
                                tuple(t.base for t in tables if t.group == g)) for g, dim in enumerate(dims))
        return cls(total=base.total, bounds=base.bounds, full_total=offset, tables=tuple(tables),
                   dense_pieces=tuple(pieces), groups=groups)

    def with_shards(self, num_shards: int) -> Slicer:
        """The same model's keys over ``num_shards`` shards (a checkpoint written by another number of shards)."""
        total = self.total
        base = ShardLayout.balanced(total, num_shards) if total else ShardLayout(0, (0,) * (num_shards + 1))
        return replace(self, bounds=base.bounds)

    def layout_id(self) -> int:
        """A checksum of the tables' shapes, in key order: a checkpoint carries it, so that a model whose tables
        differ (other row counts, say) is refused instead of being handed rows that are not its own."""
        return zlib.crc32(";".join(f"{t.num_rows}x{t.dim}" for t in self.tables).encode())

    # ------------------------------------------------------------------ rows
    @property
    def has_tables(self) -> bool:
        return bool(self.tables)

    def owner(self, ids: np.ndarray) -> np.ndarray:
        return ids % self.num_shards

    def split_ids(self, ids: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each shard, ``(positions, local_ids)``: which entries of ``ids`` (global row ids) it holds, and
        their local row indices there."""
        k_of = self.owner(ids)
        out = []
        for k in range(self.num_shards):
            pos = np.flatnonzero(k_of == k)
            out.append((pos, ids[pos] // self.num_shards))
        return out

    def table_of(self, group: int, key: int) -> TableSpec:
        """The table that key ``key`` of row group ``group`` belongs to."""
        g = self.groups[group]
        i = int(np.searchsorted(np.asarray(g.bases), key, side="right")) - 1
        return self.tables[g.tables[max(0, i)]]

    def describe_key(self, group: int, key: int) -> str:
        """A row key, in the user's words: its table and row id (or why it is no key of the group)."""
        g = self.groups[group]
        if key < 0 or key >= g.num_rows:
            t = self.table_of(group, min(max(key, 0), g.num_rows - 1))
            return f"{t.name()}: row id {key - t.base} is out of range [0, {t.num_rows})"
        t = self.table_of(group, key)
        return f"{t.name()}: row id {key - t.base}"

    def split_rows(self, rows: list) -> list[list]:
        """``rows``: per row group None or ``(keys, values)``; returns, per shard, the same list with each entry
        ``(local_ids, values)`` restricted to that shard (None where the shard gets none of that group)."""
        per_shard: list[list] = [[None] * len(self.groups) for _ in range(self.num_shards)]
        for t, entry in enumerate(rows):
            if entry is None:
                continue
            ids, values = entry
            for k, (pos, local) in enumerate(self.split_ids(ids)):
                if pos.size:
                    per_shard[k][t] = (local, values[pos])
        return per_shard

    # ------------------------------------------------------------------ the full flat vector
    def to_dense(self, full: torch.Tensor) -> torch.Tensor:
        """The dense vector (a new tensor) of a full flat vector."""
        if not self.tables:
            return full
        return torch.cat([full[o: o + n] for o, n in self.dense_pieces]) if self.dense_pieces else full[:0].clone()

    def table_values(self, full: torch.Tensor, t: int) -> torch.Tensor:
        """Table ``t``'s weight, ``(num_rows, dim)``, as a view of a full flat vector."""
        spec = self.tables[t]
        return full[spec.offset: spec.offset + spec.numel].view(spec.num_rows, spec.dim)

    def group_values(self, full: torch.Tensor, g: int) -> torch.Tensor:
        """Row group ``g``'s rows in key order, ``(num_rows, dim)`` (a new tensor)."""
        return torch.cat([self.table_values(full, t) for t in self.groups[g].tables])

    def shard_rows(self, full: torch.Tensor, shard_id: int) -> list[np.ndarray]:
        """Shard ``shard_id``'s rows of every row group (copies, float32 ``(local_rows, dim)``)."""
        return [self.group_values(full, g)[shard_id:: self.num_shards].numpy().copy()
                for g in range(len(self.groups))]

    def assemble(self, dense: torch.Tensor, shard_rows: list[list[np.ndarray]]) -> torch.Tensor:
        """The full flat vector from the dense vector and every shard's rows (``shard_rows[k][g]``)."""
        if not self.tables:
            return dense
        full = torch.empty(self.full_total, dtype=torch.float32)
        at = 0
        for o, n in self.dense_pieces:
            full[o: o + n] = dense[at: at + n]
            at += n
        for g, group in enumerate(self.groups):
            w = torch.empty(group.num_rows, group.dim, dtype=torch.float32)
            for k, rows in enumerate(shard_rows):
                w[k:: self.num_shards] = torch.from_numpy(np.array(rows[g], dtype=np.float32))
            for t in group.tables:
                spec = self.tables[t]
                self.table_values(full, t).copy_(w[spec.base: spec.base + spec.num_rows])
        return full
