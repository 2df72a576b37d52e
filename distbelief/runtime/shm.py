"""A shared-memory data plane for roles on the same machine, behind the Ray runtime.

Why: on one machine, Ray moves a push or a fetch through its object store — a copy into a fresh object, page
faults on both sides, the raylet's bookkeeping — which for a 9 MB parameter vector cost as much CPU as a third of a
gradient step here. Instead each replica owns a few named float32 buffers in ``/dev/shm``: it writes its gradient
into a push buffer and sends each shard only a tiny Ray call naming it; a shard answers a fetch by copying its
slice into the replica's fetch buffer and returning only its version. Ray still carries every call (ordering,
failures, timeouts and restarts are Ray's, as before); only the bulk bytes take the short way.

The protocol's safety rests on the replica loop's own discipline (downpour/replica.py): at most one push is in
flight and a new push starts only after the previous one was acknowledged by every shard, so a push buffer is
never rewritten while a shard may still read it (two alternate anyway); and a fetch buffer is read (copied into
the model) before the next fetch is issued. In the fused push-fetch loop (``push_fetch_shm``, one call per shard
per step) the replica's model parameters and gradients *are* the fetch buffer and a push buffer: the replica
computes only between two fused calls, and a shard writes or reads them only during one. A push re-sent to a
restarted shard reads the same, unchanged buffer.

Buffers are files named ``<prefix>-...`` in ``/dev/shm``; the runtime that owns the prefix removes them all at
shutdown, whichever processes died on the way, and the next runtime started on the machine removes those of a
runtime whose process was killed before it could (the prefix names its pid). Shards shared with co-located
replicas (ps/colocated.py) keep their state in files under the same prefix.
"""

from __future__ import annotations

import glob
import os
import secrets

import numpy as np

SHM_DIR = "/dev/shm"


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def has_room(num_bytes: int) -> bool:
    """Whether ``/dev/shm`` has ``num_bytes`` free with a margin (writing past its end would kill the writer with
    SIGBUS, so a full or small ``/dev/shm`` means: use the object store instead)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= 2 * num_bytes + 64 * 2**20


def new_prefix() -> str:
    """A prefix unique to one runtime instance (its buffers, and only its, are removed at its shutdown)."""
    return f"distbelief-{os.getpid()}-{secrets.token_hex(4)}"


def create(path: str, size: int) -> np.ndarray:
    """A new float32 buffer of ``size`` elements at ``path`` (writable, shared), its pages allocated now."""
    buf = np.memmap(path, dtype=np.float32, mode="w+", shape=(size,))
    buf[:] = 0  # touch every page here, not on the hot path
    return buf


def remove_stale() -> list[str]:
    """Remove the buffers of runtimes whose process is gone (a driver killed with SIGKILL cannot remove its own);
    returns the paths removed. The pid in a prefix names the runtime's process (new_prefix)."""
    def stale(path: str) -> bool:
        pid = os.path.basename(path).split("-")[1]
        return pid.isdigit() and not _alive(int(pid))

    return unlink_quietly(p for p in glob.glob(os.path.join(SHM_DIR, "distbelief-*-*")) if stale(p))


def unlink_quietly(paths) -> list[str]:
    """Unlink each path, skipping those already gone (or not ours to remove); returns the ones removed."""
    removed = []
    for p in paths:
        try:
            os.unlink(p)
            removed.append(p)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_all(prefix: str) -> None:
    unlink_quietly(glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "-*")))


class Attached:
    """A shard's cache of the replicas' buffers it has mapped (one mapping per file, kept for the process's life:
    files are tiny in number, one set per replica incarnation)."""

    def __init__(self):
        self._maps: dict[str, np.ndarray] = {}

    def get(self, path: str, size: int) -> np.ndarray:
        m = self._maps.get(path)
        if m is None:
            m = np.memmap(path, dtype=np.float32, mode="r+", shape=(size,))
            self._maps[path] = m
        return m

    def push(self, shard, path: str, size: int, replica_id: int, *args) -> int:
        """``shard.push`` reading the gradient from the replica's buffer (the shard reads only its range)."""
        return shard.push(replica_id, self.get(path, size), *args)

    def push_fetch(self, shard, push_path: str, fetch_path: str, size: int, replica_id: int, *args):
        """``push`` then ``fetch`` in one call: ``(version after the push, version fetched)``."""
        pushed = self.push(shard, push_path, size, replica_id, *args)
        return pushed, self.fetch(shard, fetch_path, size, replica_id)

    def fetch(self, shard, path: str, size: int, replica_id: int) -> int:
        """Copy the shard's parameter slice into the replica's buffer, at its flat offset; return the version."""
        values, version = shard.fetch(replica_id)
        self.get(path, size)[shard.lo : shard.lo + len(values)] = values
        return version
