"""Writing files so that a crash leaves either the old file or the new one, never a torn one."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(d: Path) -> None:
    """Make a rename in ``d`` durable (best effort: some filesystems cannot open a directory)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes | str, durable: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically: a temporary file in the same directory, renamed into place. With
    ``durable`` the file and the rename are fsynced first (checkpoints); without, only atomicity is promised (a
    run's summary, which is rewritten anyway)."""
    final = Path(path)
    tmp = final.parent / f".{final.name}.tmp{os.getpid()}"
    with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, final)
    if durable:
        fsync_dir(final.parent)
    return final
