"""A shard's state in shared memory: files in /dev/shm that several processes map, and the lock that guards them.

Used by ``ParameterShard.share`` (which moves a shard's state here) and ``ps/colocated.py`` (replicas that map it).
"""

from __future__ import annotations

import fcntl
import glob
import os
import threading
import time

import numpy as np

from distbelief.exceptions import RemoteTimeoutError
from distbelief.runtime import shm

COUNTERS_FILE = "counters"


class ShardLock:
    """An inter-process lock on one shard's shared state (``flock``), re-entrant within one thread of a process.

    Every process opens the lock file itself (a lock belongs to an open file, so two processes exclude each
    other; a second acquire through the same open file would not)."""

    def __init__(self, path: str, timeout_s: float = 120.0):
        self.path, self.timeout_s = path, timeout_s
        self._fd = os.open(path, os.O_RDWR)
        self._depth = 0
        self._owner: int | None = None

    def acquire(self, timeout_s: float | None = None) -> None:
        me = threading.get_ident()
        if self._depth and self._owner == me:
            self._depth += 1
            return
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._wait(self.timeout_s if timeout_s is None else timeout_s)
        self._owner, self._depth = me, 1

    def _wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pause = 20e-6
        while True:
            time.sleep(pause)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise RemoteTimeoutError(
                        f"a parameter shard's lock ({self.path}) was held for more than {timeout_s:.0f}s "
                        f"(raise remote_timeout_s if updates are that slow)") from None
                pause = min(pause * 2, 1e-3)

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def create_storage(base: str, arrays: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
    """Copy ``arrays`` (name -> 1-D array) into new shared files ``<base>-<name>``. Returns ``(files, maps)``:
    ``files`` maps each name to ``(path, dtype, size)`` (what another process needs to map it), ``maps`` the
    writable mappings, filled."""
    files, maps = {}, {}
    for name, a in arrays.items():
        path = f"{base}-{name.replace('.', '_')}"
        m = np.memmap(path, dtype=a.dtype, mode="w+", shape=a.shape)
        m[:] = a
        files[name] = (path, a.dtype.str, int(a.size))
        maps[name] = m
    return files, maps


def open_storage(files: dict) -> dict[str, np.ndarray]:
    """Map the shared files described by ``create_storage``'s ``files`` (read-write)."""
    return {name: np.memmap(path, dtype=np.dtype(dtype), mode="r+", shape=(size,))
            for name, (path, dtype, size) in files.items()}


def remove_older(prefix: str, keep: str) -> list[str]:
    """Unlink the files named ``prefix*`` except those of ``keep`` (a longer prefix); returns what was removed."""
    return shm.unlink_quietly(p for p in glob.glob(glob.escape(prefix) + "*") if not p.startswith(keep))

