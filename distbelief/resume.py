"""Resuming a run: rebuild the parameter server's state from the shards' checkpoints and logs, for any K.

Each old shard is restored exactly as a restarted shard would be (latest good checkpoint + write-ahead log), and
the slices are laid side by side into flat vectors. New shards — possibly a different number of them (resharding)
— are then built from ranges of those flat vectors. This runs in the driver, which briefly holds full vectors;
that is fine for a resume (it is the Sandblaster coordinator that must never hold them).

A model with embedding tables (ps/slicer.py) has its dense part resharded as above and its rows by their keys:
old shard k of K holds keys k, k + K, ... of each row group, with the rule's row state; they are gathered into
whole per-group arrays, and new shard j of K' takes keys j, j + K', ... of them (``ServerState.rows_for``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from distbelief.files import atomic_write
from distbelief.ps.checkpoint import latest_good_checkpoint
from distbelief.ps.rules import persistent
from distbelief.ps.shard import PARAMS, Durability, ParameterShard

STATE_FILE = "trainer_state.json"


@dataclass
class ServerState:
    """The whole server's state as flat vectors, plus per-old-shard counters.

    ``tables`` (a model with embedding tables): per row group, its rows in key order (``"weight"``,
    ``(num_rows, dim)``) and the rule's row state (``"opt.<name>"``, ``(num_rows, ...)``); ``params`` and
    ``opt_state`` are then over the dense part only."""

    params: torch.Tensor
    opt_state: dict[str, torch.Tensor]
    versions: list[tuple[int, int, int]]  # (lo, hi, version) per old shard
    examples: int
    corrupt_checkpoints: list[str] = field(default_factory=list)
    tables: list[dict[str, np.ndarray]] | None = None

    def slice_for(self, lo: int, hi: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, int]]:
        """Initial values, optimizer state and counters for a new shard owning ``[lo, hi)``."""
        overlapping = [v for (a, b, v) in self.versions if a < hi and b > lo]
        counters = {"version": max(overlapping, default=0), "examples": self.examples}
        return (self.params[lo:hi].clone(), {k: v[lo:hi].clone() for k, v in self.opt_state.items()}, counters)

    def rows_for(self, shard_id: int, num_shards: int) -> tuple[list[np.ndarray], list[dict[str, np.ndarray]]]:
        """``(rows, state)`` of new shard ``shard_id`` of ``num_shards``, as ``ParameterShard(tables=(slicer, rows,
        state))`` takes them: per row group its keys ``shard_id, shard_id + num_shards, ...`` (copies)."""
        assert self.tables is not None, "a model without embedding tables has no rows"
        rows = [t["weight"][shard_id::num_shards].copy() for t in self.tables]
        state = [{k[4:]: v[shard_id::num_shards].copy() for k, v in t.items() if k.startswith("opt.")}
                 for t in self.tables]
        return rows, state


def load_server_state(ckpt_root: str | Path, total: int, optimizer, slicer=None) -> ServerState:
    """Restore every shard found under ``ckpt_root`` and assemble flat vectors covering ``[0, total)``.

    ``slicer``: the model's ``Slicer`` when it has embedding tables (any number of shards: the checkpoints'
    own is used to read them); ``total`` is then its dense part's size (``slicer.total``), and the rows and their
    row state are gathered into ``ServerState.tables``.

    Raises:
        FileNotFoundError: no readable checkpoint for a shard.
        ValueError: the checkpoints are of another model (other parameter count or other tables), or do not
            cover it."""
    root = Path(ckpt_root)
    dirs = sorted(root.glob("shard-*"))
    if not dirs:
        raise FileNotFoundError(f"no shard checkpoints under {root}")
    ids = [int(d.name.split("-")[1]) for d in dirs]
    old = None  # the tables over the checkpoints' shards
    if slicer is not None and slicer.has_tables:
        if ids != list(range(len(ids))):
            raise ValueError(f"the checkpoints under {root} are of shards {ids}: a run's shards are 0..K-1")
        old = slicer.with_shards(len(ids))
    params = torch.full((total,), float("nan"))
    opt: dict[str, torch.Tensor] = {}
    tables: list[dict[str, np.ndarray]] | None = None if old is None else [{} for _ in old.groups]
    versions, examples, corrupt = [], 0, []
    for d, shard_id in zip(dirs, ids):
        ck = latest_good_checkpoint(root, shard_id)
        if ck is None:
            raise FileNotFoundError(f"{d}: no readable checkpoint (all damaged or missing)")
        lo, hi = ck.meta["lo"], ck.meta["hi"]
        if ck.meta.get("total", total) != total:
            what = "dense parameters (besides its embedding tables)" if old is not None else "parameters"
            raise ValueError(f"{d}: checkpoint is for a model with {ck.meta['total']} {what}, this model has "
                             f"{total}; resume with the same model")
        shard = ParameterShard.restore(shard_id, lo, hi, optimizer, total, Durability(str(root), wal=False),
                                       write_base=False, tables=None if old is None else (old, None, None))
        corrupt += shard.corrupt_checkpoints
        params[lo:hi] = shard.vectors[PARAMS]
        for k, v in persistent(optimizer, shard.opt_state).items():
            opt.setdefault(k, torch.zeros(total))[lo:hi] = v
        for group, whole, tab in zip(old.groups if old else (), tables or (), shard.tables):
            # old shard k of K holds keys k, k + K, ...: its local row i is key i * K + k
            arrays = {"weight": tab.weight.numpy(), **{f"opt.{n}": v.numpy() for n, v in
                                                      persistent(optimizer, tab.state).items()}}
            for name, a in arrays.items():
                if name not in whole:
                    whole[name] = np.zeros((group.num_rows, *a.shape[1:]), dtype=np.float32)
                whole[name][shard_id:: len(ids)] = a
        versions.append((lo, hi, shard.version))
        examples = max(examples, shard.examples)
    if torch.isnan(params).any():
        missing = int(torch.isnan(params).sum())
        raise ValueError(f"the checkpoints under {root} cover only {total - missing} of {total} parameters")
    return ServerState(params, opt, versions, examples, corrupt, tables)


def retire_checkpoints(ckpt_root: str | Path) -> Path | None:
    """Move the old shards' files aside (the new shards may own other ranges); returns where they went."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return None
    dest = root.with_name(f"{root.name}.before-resume-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    root.rename(dest)
    return dest


def drop_retired(path: Path | None) -> None:
    if path is not None and path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def write_trainer_state(run_dir: str | Path, state: dict) -> None:
    atomic_write(Path(run_dir) / STATE_FILE, json.dumps(state))


def read_trainer_state(run_dir: str | Path) -> dict:
    p = Path(run_dir) / STATE_FILE
    return json.loads(p.read_text()) if p.is_file() else {}
