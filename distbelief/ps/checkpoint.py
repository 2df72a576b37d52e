"""Durable shard state: checkpoints (atomic, checksummed safetensors) and a write-ahead log of applied pushes.

A shard checkpoint is one safetensors file holding the shard's parameter slice and optimizer state, with metadata
(shard id, range, version, SHA-256 of the tensor bytes). It is written to a temporary file, fsynced, and renamed
into place, so a reader sees either the old or the new file, never a torn one; a file damaged later is detected
by its checksum and skipped in favour of the previous good one.

The write-ahead log records every push a shard applies after its last checkpoint (the gradient slice and where it
went). A shard restarted after its process died loads the latest good checkpoint and replays the log, so the
updates it had acknowledged are not lost. Nothing here uses pickle.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from distbelief.files import atomic_write


class CorruptCheckpoint(Exception):
    """A checkpoint file that cannot be read or whose checksum does not match."""


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().numpy().reshape(-1).view(np.uint8))  # hashed in place, no copy
    return h.hexdigest()


def shard_dir(root: str | Path, shard_id: int) -> Path:
    return Path(root) / f"shard-{shard_id:03d}"


def save_checkpoint(root: str | Path, shard_id: int, meta: dict[str, int], tensors: dict[str, torch.Tensor],
                    keep: int = 3) -> Path:
    """Atomically write ``tensors`` + ``meta`` (must include ``version``); keep the newest ``keep`` files."""
    d = shard_dir(root, shard_id)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    metadata = {k: str(v) for k, v in meta.items()}
    metadata["sha256"] = _digest(tensors)
    blob = st_save(tensors, metadata=metadata)
    final = atomic_write(d / f"ckpt-{int(meta['version']):012d}.safetensors", blob)
    for old in sorted(d.glob("ckpt-*.safetensors"))[:-keep]:
        old.unlink(missing_ok=True)
    return final


def load_checkpoint(path: str | Path) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    """Read and verify one checkpoint file; raises CorruptCheckpoint on any damage."""
    p = Path(path)
    try:
        blob = p.read_bytes()
        tensors = st_load(blob)
        from safetensors import safe_open

        with safe_open(str(p), framework="pt") as f:
            metadata = dict(f.metadata() or {})
    except Exception as e:  # noqa: BLE001 - any failure to parse is corruption
        raise CorruptCheckpoint(f"{p}: unreadable ({type(e).__name__}: {e})") from None
    expected = metadata.pop("sha256", None)
    if expected is None or _digest(tensors) != expected:
        raise CorruptCheckpoint(f"{p}: checksum mismatch")
    return {k: int(v) for k, v in metadata.items()}, tensors


@dataclass
class LoadedCheckpoint:
    path: Path
    meta: dict[str, int]
    tensors: dict[str, torch.Tensor]
    skipped: list[str]  # damaged newer checkpoints that were passed over, with the reason


def latest_good_checkpoint(root: str | Path, shard_id: int) -> LoadedCheckpoint | None:
    """The newest checkpoint of shard ``shard_id`` that verifies, or None if there is none."""
    d = shard_dir(root, shard_id)
    skipped: list[str] = []
    for p in sorted(d.glob("ckpt-*.safetensors"), reverse=True):
        try:
            meta, tensors = load_checkpoint(p)
        except CorruptCheckpoint as e:
            skipped.append(str(e))
            continue
        return LoadedCheckpoint(p, meta, tensors, skipped)
    return None


# ---------------------------------------------------------------------------------------------- write-ahead log
# magic, version_after, start, stop, num_examples, session, seq, crc32 of data
_HEADER = struct.Struct("<IQQQQQQI")
_MAGIC = 0xD15B_E11F


class WriteAheadLog:
    """Append-only log of applied pushes: ``(version_after, [start, stop) within the shard, gradient)``.

    Records are written with a plain ``write`` (no fsync): they survive the death of the shard's process, which
    is the failure this log is for; a torn last record (the process died mid-write) fails its CRC and is ignored.
    """

    def __init__(self, root: str | Path, shard_id: int):
        self.dir = shard_dir(root, shard_id)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._f = None
        self.bytes_since_start = 0  # bytes appended to the current log file (the shard caps it: log_max_mb)

    def _path(self, base_version: int) -> Path:
        return self.dir / f"wal-{base_version:012d}.log"

    def start(self, base_version: int) -> None:
        """Begin a new log for pushes after ``base_version`` (the checkpoint just written)."""
        if self._f is not None:
            self._f.close()
        self._f = open(self._path(base_version), "ab", buffering=0)
        self.bytes_since_start = 0

    def append(self, version_after: int, start: int, stop: int, num_examples: int, grad: np.ndarray,
               session: int = 0, seq: int = 0) -> None:
        data = np.ascontiguousarray(grad, dtype=np.float32).reshape(-1).view(np.uint8)  # written in place
        header = _HEADER.pack(_MAGIC, version_after, start, stop, num_examples, session, seq, zlib.crc32(data))
        self._f.write(header)
        self._f.write(data)
        self.bytes_since_start += _HEADER.size + data.size

    def drop_before(self, base_version: int) -> None:
        """Delete logs made obsolete by a checkpoint at ``base_version``."""
        for p in self.dir.glob("wal-*.log"):
            if int(p.stem.split("-")[1]) < base_version:
                p.unlink(missing_ok=True)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def replay(self, after_version: int):
        """Yield ``(version_after, start, stop, num_examples, session, seq, grad)`` for records newer than
        ``after_version``."""
        for p in sorted(self.dir.glob("wal-*.log")):
            blob = p.read_bytes()
            pos = 0
            while pos + _HEADER.size <= len(blob):
                magic, version_after, start, stop, n_ex, session, seq, crc = _HEADER.unpack_from(blob, pos)
                size = (stop - start) * 4
                data = blob[pos + _HEADER.size : pos + _HEADER.size + size]
                if magic != _MAGIC or len(data) != size or zlib.crc32(data) != crc:
                    break  # a torn tail: the process died while writing this record
                pos += _HEADER.size + size
                if version_after > after_version:
                    yield version_after, start, stop, n_ex, session, seq, np.frombuffer(data, dtype=np.float32)
