"""Resuming a run: rebuild the parameter server's state from the shards' checkpoints and logs, for any K.

Each old shard is restored exactly as a restarted shard would be (latest good checkpoint + write-ahead log), and
the slices are laid side by side into flat vectors. New shards — possibly a different number of them (resharding)
— are then built from ranges of those flat vectors. This runs in the driver, which briefly holds full vectors;
that is fine for a resume (it is the Sandblaster coordinator that must never hold them).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from distbelief.files import atomic_write
from distbelief.ps.checkpoint import latest_good_checkpoint
from distbelief.ps.rules import persistent
from distbelief.ps.shard import PARAMS, Durability, ParameterShard

STATE_FILE = "trainer_state.json"


@dataclass
class ServerState:
    """The whole server's state as flat vectors, plus per-old-shard counters."""

    params: torch.Tensor
    opt_state: dict[str, torch.Tensor]
    versions: list[tuple[int, int, int]]  # (lo, hi, version) per old shard
    examples: int
    corrupt_checkpoints: list[str] = field(default_factory=list)

    def slice_for(self, lo: int, hi: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, int]]:
        """Initial values, optimizer state and counters for a new shard owning ``[lo, hi)``."""
        overlapping = [v for (a, b, v) in self.versions if a < hi and b > lo]
        counters = {"version": max(overlapping, default=0), "examples": self.examples}
        return (self.params[lo:hi].clone(), {k: v[lo:hi].clone() for k, v in self.opt_state.items()}, counters)


def load_server_state(ckpt_root: str | Path, total: int, optimizer) -> ServerState:
    """Restore every shard found under ``ckpt_root`` and assemble flat vectors covering ``[0, total)``."""
    root = Path(ckpt_root)
    dirs = sorted(root.glob("shard-*"))
    if not dirs:
        raise FileNotFoundError(f"no shard checkpoints under {root}")
    params = torch.full((total,), float("nan"))
    opt: dict[str, torch.Tensor] = {}
    versions, examples, corrupt = [], 0, []
    for d in dirs:
        shard_id = int(d.name.split("-")[1])
        ck = latest_good_checkpoint(root, shard_id)
        if ck is None:
            raise FileNotFoundError(f"{d}: no readable checkpoint (all damaged or missing)")
        lo, hi = ck.meta["lo"], ck.meta["hi"]
        if ck.meta.get("total", total) != total:
            raise ValueError(f"{d}: checkpoint is for a model with {ck.meta['total']} parameters, this model has "
                             f"{total}; resume with the same model")
        shard = ParameterShard.restore(shard_id, lo, hi, optimizer, total,
                                       Durability(str(root), wal=False), write_base=False)
        corrupt += shard.corrupt_checkpoints
        params[lo:hi] = shard.vectors[PARAMS]
        for k, v in persistent(optimizer, shard.opt_state).items():
            opt.setdefault(k, torch.zeros(total))[lo:hi] = v
        versions.append((lo, hi, shard.version))
        examples = max(examples, shard.examples)
    if torch.isnan(params).any():
        missing = int(torch.isnan(params).sum())
        raise ValueError(f"the checkpoints under {root} cover only {total - missing} of {total} parameters")
    return ServerState(params, opt, versions, examples, corrupt)


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
