"""The slicer: which shard holds which key of a model.

A key is either an element range of the model's **dense** parameters or a **row** of one of its embedding tables
(every ``nn.Embedding`` / ``nn.EmbeddingBag`` found in the model):

- dense parameters (all but the tables' weights), concatenated in ``named_parameters()`` order, are cut into
  balanced contiguous ranges exactly as ``ShardLayout.balanced`` does for a model without tables (a tensor may
  span shards; shard sizes differ by at most one element);
- table rows are sharded by **modulo**: row ``r`` of every table lives on shard ``r % K``, at local index
  ``r // K``.

Why modulo and not contiguous blocks or a hash: categorical ids are usually ranked by frequency (id 0 the most
frequent value of a field, as in a frequency-sorted vocabulary), so a contiguous split would put every hot row on
shard 0 and make it the bottleneck; modulo deals the hottest rows round-robin over all shards and keeps row counts
balanced to one row, where a hash is only balanced on average. It needs no table of its own, and resharding a
checkpoint from K to K' shards is the same arithmetic with K'.

``Slicer`` is a ``ShardLayout`` (over the dense part) with the tables added, so code that only moves dense ranges
takes it unchanged; for a model without tables it is exactly ``ShardLayout.balanced(total, K)``.

The model's **full** flat vector (``flatten(model)``: every parameter in ``named_parameters()`` order, tables
included) stays the driver's and the checkpoint's view of the whole model; ``to_dense`` / ``table_values`` /
``assemble`` convert between it and the shards' keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from distbelief.exceptions import ConfigError
from distbelief.ps.sharding import ShardLayout


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: the module's name in the model, its shape, and where its weight sits in the model's
    full flat vector (``flat[offset : offset + num_rows * dim]``, row-major)."""

    module: str
    kind: str  # "Embedding" or "EmbeddingBag"
    num_rows: int
    dim: int
    offset: int

    @property
    def param(self) -> str:
        return f"{self.module}.weight" if self.module else "weight"

    @property
    def numel(self) -> int:
        return self.num_rows * self.dim

    def local_rows(self, shard_id: int, num_shards: int) -> int:
        """How many of this table's rows shard ``shard_id`` holds (rows ``shard_id, shard_id + K, ...``)."""
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

    @classmethod
    def for_model(cls, model: nn.Module, num_shards: int) -> "Slicer":
        table_params = {(f"{n}.weight" if n else "weight"): (n, m) for n, m in find_tables(model)}
        tables, pieces, offset = [], [], 0
        seen: dict[int, str] = {}
        for pname, p in model.named_parameters():
            if id(p) in seen:  # named_parameters() yields a shared tensor once; be explicit anyway
                continue
            seen[id(p)] = pname
            if pname in table_params:
                mname, m = table_params[pname]
                tables.append(TableSpec(mname, type(m).__name__, int(p.shape[0]), int(p.shape[1]), offset))
            else:
                pieces.append((offset, p.numel()))
            offset += p.numel()
        dense_total = sum(n for _, n in pieces)
        if tables and dense_total < num_shards:
            raise ConfigError("shards", f"{num_shards} shards for a model whose dense part has only {dense_total} "
                                        f"parameters; use at most {max(1, dense_total)} shards")
        base = ShardLayout.balanced(dense_total, num_shards) if dense_total else ShardLayout(0, (0,) * (num_shards + 1))
        return cls(total=base.total, bounds=base.bounds, full_total=offset, tables=tuple(tables),
                   dense_pieces=tuple(pieces))

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

    def split_rows(self, rows: list) -> list[list]:
        """``rows``: per table None or ``(global_ids, values)``; returns, per shard, the same list with each entry
        ``(local_ids, values)`` restricted to that shard (None where the shard gets none of that table)."""
        per_shard: list[list] = [[None] * len(self.tables) for _ in range(self.num_shards)]
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

    def shard_rows(self, full: torch.Tensor, shard_id: int) -> list[np.ndarray]:
        """Shard ``shard_id``'s rows of every table (copies, float32 ``(local_rows, dim)``)."""
        return [self.table_values(full, t)[shard_id:: self.num_shards].numpy().copy()
                for t in range(len(self.tables))]

    def assemble(self, dense: torch.Tensor, shard_tables: list[list[np.ndarray]]) -> torch.Tensor:
        """The full flat vector from the dense vector and every shard's table rows (``shard_tables[k][t]``)."""
        if not self.tables:
            return dense
        full = torch.empty(self.full_total, dtype=torch.float32)
        at = 0
        for o, n in self.dense_pieces:
            full[o: o + n] = dense[at: at + n]
            at += n
        for t in range(len(self.tables)):
            w = self.table_values(full, t)
            for k, rows in enumerate(shard_tables):
                w[k:: self.num_shards] = torch.from_numpy(np.array(rows[t], dtype=np.float32))
        return full

    def bytes_per_row(self, t: int) -> int:
        """What one row costs on the wire: its values plus its 8-byte id."""
        return self.tables[t].dim * 4 + 8
