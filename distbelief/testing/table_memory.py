"""Tables larger than one process: the model, data and verdicts of benchmarks/table_memory.py and
tests/integration/test_tables_cluster.py (docs/tables.md, "Tables larger than one process"). Test and benchmark
tooling, not a user setting; the Ray side (a fake multi-node cluster, one shard per node) is
benchmarks/table_memory.py's ``run_on_cluster``, since only the runtime layer of the package imports Ray.

Per shard: ``held`` = its rows of every table and their server-rule state, plus its dense range and its state
(tiny here); ``base`` = the same process's memory measured before the shard allocated anything (the interpreter,
torch, Ray's worker); ``measured`` = its memory after training (``ParameterShard.memory()``, ps/memory.py). The
bound is ``measured <= slack * held + base``. Memory is USS (pages only that process maps: what its exit would
free) by default; RSS and anonymous memory are reported too.

The model: ``tables`` EmbeddingBags of ``rows // tables`` rows each, all ``dim`` wide (one row group), and a linear
head on their concatenated outputs giving one click logit. The data: ids log-uniform over each table (id ``r``
drawn with probability ~ 1/(r+1): a few hot rows, a long tail), exact integers in float32; each row of each table
carries a hidden sign, and an example is positive when the signs of its ids (plus Gaussian noise) sum above 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

MiB = 2**20
MAX_ROWS_PER_TABLE = 2**24  # ids travel as float32, exact up to 2^24


class WideTables(nn.Module):
    """``tables`` EmbeddingBags of ``rows // tables`` rows x ``dim`` (the first take the remainder) and a linear
    head; ``x[:, t]`` is the id of table ``t`` (an exact integer in float32)."""

    def __init__(self, rows: int, dim: int, tables: int = 4):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for n in table_rows(rows, tables))
        for bag in self.bags:  # small initial rows: the head starts near a logit of 0 whatever dim is
            nn.init.normal_(bag.weight, std=0.1)
        self.head = nn.Linear(tables * dim, 1)

    def embedding_ids(self, x):  # every table's rows in one fetch per shard
        return [x[:, t].long() for t in range(len(self.bags))]

    def forward(self, x):
        ids = self.embedding_ids(x)
        return self.head(torch.cat([bag(i[:, None]) for bag, i in zip(self.bags, ids)], 1)).squeeze(1)


def table_rows(rows: int, tables: int) -> list[int]:
    """How ``rows`` rows are split over ``tables`` tables."""
    per, extra = divmod(rows, tables)
    out = [per + (t < extra) for t in range(tables)]
    if min(out) < 1 or max(out) > MAX_ROWS_PER_TABLE:
        raise ValueError(f"{rows} rows over {tables} tables: each table needs 1 to {MAX_ROWS_PER_TABLE} rows")
    return out


def _sign(ids: torch.Tensor, t: int) -> torch.Tensor:
    """Row ``ids`` of table ``t``'s hidden sign, +1 or -1 (a fixed hash of the row and table)."""
    h = (ids * 2654435761 + 40503 * (t + 1)) % (2**32)
    return 1.0 - 2.0 * ((h >> 13) & 1).float()


def planted_data(rows: int, tables: int, n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    xs, score = [], torch.zeros(n)
    for t, nt in enumerate(table_rows(rows, tables)):
        ids = torch.clamp(torch.exp(torch.rand(n, generator=g, dtype=torch.float64) * math.log(nt + 1)).long() - 1,
                          0, nt - 1)
        xs.append(ids.float())
        score += _sign(ids, t)
    y = (score + 0.5 * torch.randn(n, generator=g) > 0).float()
    return TensorDataset(torch.stack(xs, 1), y)


def bce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, y.float())


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float(((logits > 0).float() == y.float()).float().mean())


def check(report: dict, slack: float = 1.15, metric: str = "uss") -> list[dict]:
    """Per shard: its rows, bytes held, base, measured memory (``metric`` of ps/memory.py), ratio
    ``(measured - base) / held`` and whether ``measured <= slack * held + base``."""
    out = []
    for sh in report["shards"]:
        held = sh["table_bytes"] + sh["dense_bytes"]
        measured, base = sh["process"][metric], sh["base"][metric]
        out.append({"shard": sh["shard_id"], "node": sh["node"], "table_rows": sh["table_rows"],
                    "held_bytes": held, "base_bytes": base, "measured_bytes": measured,
                    "ratio": (measured - base) / held if held else math.inf,
                    "bound_bytes": slack * held + base, "ok": measured <= slack * held + base})
    return out
