"""What a parameter shard's process holds in memory, measured by the process itself (docs/tables.md, "Tables
larger than one process").

``process_memory()`` reads Linux's ``/proc/self/smaps_rollup``: ``rss`` (every resident page the process maps,
shared libraries included), ``uss`` (pages only this process maps: what its exit would free; the shard's rows and
optimizer state are there, unless they were moved into shared memory for co-located replicas), ``pss`` (its
proportional share of shared pages) and ``anon`` (anonymous pages: the heap and its large arrays). Bytes, not kB.
None where there is no such file (not Linux): a shard then reports no process memory, never a guess.

A shard measures itself once before it allocates anything of its own (``ParameterShard.base_memory``: the runtime's
base, i.e. the interpreter, torch, Ray's worker, with no parameters, rows or state yet) and again whenever it is
asked (``ParameterShard.memory()``), so that a caller can check, per shard process, that its memory is its base
plus what it holds and not much more.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

_FIELDS = {"Rss": "rss", "Pss": "pss", "Anonymous": "anon", "Private_Clean": "_pc", "Private_Dirty": "_pd"}


def process_memory(pid: int | str = "self") -> dict[str, int] | None:
    """``{"rss", "uss", "pss", "anon"}`` of process ``pid`` (this one by default) in bytes, or None where
    ``/proc/<pid>/smaps_rollup`` cannot be read (not Linux, or the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    kb: dict[str, int] = {}
    for line in text.splitlines()[1:]:
        name, _, value = line.partition(":")
        if name in _FIELDS:
            kb[_FIELDS[name]] = int(value.split()[0])
    out = {k: v * 1024 for k, v in kb.items() if not k.startswith("_")}
    out["uss"] = (kb.get("_pc", 0) + kb.get("_pd", 0)) * 1024
    return out


def tensor_bytes(values) -> int:
    """Bytes of the arrays / tensors in ``values`` (their elements, not Python's object overhead)."""
    total = 0
    for v in values:
        total += v.nbytes if hasattr(v, "nbytes") else v.numel() * v.element_size()
    return total


def transient_copy(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` in an anonymous memory mapping of its own, given back to the system as soon as the copy is
    dropped.

    For the large copies a shard hands out once and drops (the driver reading all of its table rows at each
    evaluation): from the heap, glibc would keep a freed block of that size for reuse (its mmap threshold adapts
    upward to the largest block freed, up to 32 MiB), and the process would stay a whole rows-sized copy larger
    than what it holds (measured: +23 MiB after two reads of 24 MiB of rows)."""
    if a.nbytes < mmap.PAGESIZE:
        return a.copy()
    out = np.frombuffer(mmap.mmap(-1, a.nbytes), dtype=a.dtype).reshape(a.shape)
    np.copyto(out, a)
    return out
