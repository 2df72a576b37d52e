"""Durable shard state: checkpoints (atomic, checksummed safetensors) and a write-ahead log of applied pushes.

A shard checkpoint is one safetensors file holding the shard's parameter slice and optimizer state, with metadata
(shard id, range, version, SHA-256 of the tensor bytes). It is written to a temporary file, fsynced, and renamed
into place, so a reader sees either the old or the new file, never a torn one; a file damaged later is detected
by its checksum and skipped in favour of the previous good one.

The write-ahead log records every push a shard applies after its last checkpoint (the gradient slice and where it
went; for a shard with embedding tables also the push's rows and its rate scale). A shard restarted after its process died loads the latest good checkpoint and replays the log, so the
updates it had acknowledged are not lost. Nothing here uses pickle.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from distbelief.files import atomic_write, fsync_dir


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


_ST_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def save_checkpoint_streamed(root: str | Path, shard_id: int, meta: dict[str, int],
                             specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                             pieces: Callable[[str], Iterable[torch.Tensor]], keep: int = 3) -> Path:
    """``save_checkpoint`` for a state too large to copy whole: tensor ``name`` (``specs[name]``: its dtype and
    shape) is written from ``pieces(name)``, consecutive pieces of it along its first dimension, as they come, in
    a temporary file renamed into place. The file — safetensors with the same metadata and checksum — reads back
    exactly as ``save_checkpoint``'s of the same tensors would."""
    d = shard_dir(root, shard_id)
    d.mkdir(parents=True, exist_ok=True)
    names = sorted(specs)
    header: dict = {}
    at = 0
    for name in names:
        dtype, shape = specs[name]
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + size]}
        at += size
    placeholder = "0" * 64  # the checksum, known once the data is written: written over this, in place
    header["__metadata__"] = {**{k: str(v) for k, v in meta.items()}, "sha256": placeholder}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors' alignment of the data
    mark = f'"sha256":"{placeholder}"'.encode()
    where = 8 + head.index(mark) + len(b'"sha256":"')
    final = d / f"ckpt-{int(meta['version']):012d}.safetensors"
    tmp = final.parent / f".{final.name}.tmp{os.getpid()}"
    h = hashlib.sha256()
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for name in names:
            h.update(name.encode())
            begin, end = header[name]["data_offsets"]
            wrote = 0
            for piece in pieces(name):
                raw = piece.contiguous().numpy().reshape(-1).view(np.uint8)
                h.update(raw)
                f.write(raw)
                wrote += raw.nbytes
            if wrote != end - begin:
                raise ValueError(f"checkpoint tensor {name}: {wrote} bytes written, {end - begin} expected")
        f.seek(where)
        f.write(h.hexdigest().encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(final.parent)
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
# A dense record: magic, version_after, start, stop, num_examples, session, seq, crc32 of data; then the gradient.
_HEADER = struct.Struct("<IQQQQQQI")
_MAGIC = 0xD15B_E11F
# A record of a shard with embedding tables: the same fields, then the rate scale the push was applied with and
# the bytes of its rows; the crc32 covers the gradient and the rows. Its rows follow the gradient, per row group
# that has any: _ROWS (group, dim, n), then n int64 local row ids, then n * dim float32 values.
_HEADER_ROWS = struct.Struct("<IQQQQQQdQI")
_MAGIC_ROWS = 0xD15B_E120
_ROWS = struct.Struct("<IIQ")


class LogRecord(NamedTuple):
    """One applied push, as the log holds it. ``rows``: None for a dense record, else ``(group, local_ids,
    values)`` for each row group it carried rows of."""

    version_after: int
    start: int
    stop: int
    num_examples: int
    session: int
    seq: int
    grad: np.ndarray
    rows: list | None = None
    scale: float = 1.0


def _encode_rows(rows: list) -> bytes:
    parts = []
    for g, entry in enumerate(rows):
        if entry is None or not len(entry[0]):  # (no rows: nothing of the group changed)
            continue
        ids = np.ascontiguousarray(entry[0], dtype=np.int64).reshape(-1)
        values = np.ascontiguousarray(entry[1], dtype=np.float32)
        parts += [_ROWS.pack(g, values.size // ids.size, ids.size), ids.tobytes(), values.tobytes()]
    return b"".join(parts)


def _decode_rows(blob: bytes) -> list:
    rows, pos = [], 0
    while pos < len(blob):
        g, dim, n = _ROWS.unpack_from(blob, pos)
        pos += _ROWS.size
        ids = np.frombuffer(blob, dtype=np.int64, count=n, offset=pos).copy()
        pos += 8 * n
        values = np.frombuffer(blob, dtype=np.float32, count=n * dim, offset=pos).reshape(n, dim).copy()
        pos += 4 * n * dim
        rows.append((g, ids, values))
    return rows


class WriteAheadLog:
    """Append-only log of applied pushes: ``(version_after, [start, stop) within the shard, gradient)``, and for a
    shard with embedding tables the push's rows (local ids and values per row group) and its rate scale.

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
               session: int = 0, seq: int = 0, rows: list | None = None, scale: float = 1.0) -> None:
        """Log one applied push. ``rows`` (a shard with tables; ``[]`` when the push carried none): per row group
        None or ``(local_ids, values)``, as ``ParameterShard.push`` takes them; None writes a dense record."""
        data = np.ascontiguousarray(grad, dtype=np.float32).reshape(-1).view(np.uint8)  # written in place
        if rows is None:
            header = _HEADER.pack(_MAGIC, version_after, start, stop, num_examples, session, seq, zlib.crc32(data))
            self._f.write(header)
            self._f.write(data)
            self.bytes_since_start += _HEADER.size + data.size
            return
        blob = _encode_rows(rows)
        crc = zlib.crc32(blob, zlib.crc32(data))
        # one write: a record is either whole in the file or a torn tail
        self._f.write(_HEADER_ROWS.pack(_MAGIC_ROWS, version_after, start, stop, num_examples, session, seq,
                                        float(scale), len(blob), crc) + data.tobytes() + blob)
        self.bytes_since_start += _HEADER_ROWS.size + data.size + len(blob)

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
        """Yield a ``LogRecord`` for each record newer than ``after_version``, in order (dense records of logs
        written before rows were logged read as they always did)."""
        for p in sorted(self.dir.glob("wal-*.log")):
            blob = p.read_bytes()
            pos = 0
            while pos + 4 <= len(blob):
                (magic,) = struct.unpack_from("<I", blob, pos)
                if magic == _MAGIC and pos + _HEADER.size <= len(blob):
                    _, version_after, start, stop, n_ex, session, seq, crc = _HEADER.unpack_from(blob, pos)
                    scale, rows_size, head = 1.0, -1, _HEADER.size
                elif magic == _MAGIC_ROWS and pos + _HEADER_ROWS.size <= len(blob):
                    (_, version_after, start, stop, n_ex, session, seq, scale, rows_size,
                     crc) = _HEADER_ROWS.unpack_from(blob, pos)
                    head = _HEADER_ROWS.size
                else:
                    break  # a torn tail: the process died while writing this record
                size = (stop - start) * 4
                end = pos + head + size + max(rows_size, 0)
                data = blob[pos + head: pos + head + size]
                rows_blob = blob[pos + head + size: end]
                if (len(data) != size or len(rows_blob) != max(rows_size, 0)
                        or zlib.crc32(rows_blob, zlib.crc32(data)) != crc):
                    break  # a torn tail
                pos = end
                if version_after > after_version:
                    yield LogRecord(version_after, start, stop, n_ex, session, seq,
                                    np.frombuffer(data, dtype=np.float32),
                                    None if rows_size < 0 else _decode_rows(rows_blob), scale)
