"""Warm role processes: the worker processes of a finished run, kept for the next run in the same Python process.

Starting a role's process costs several CPU-seconds (a Python interpreter, Ray's worker, PyTorch) and, on a small
machine, seconds of wall time before the first step. A script that trains more than once — a sweep, a benchmark,
a notebook, the test suite — pays it every run. So when a run on the local Ray instance (the one ``connect``
starts) ends with every role idle, its role processes stay up, empty, in the warm pool; the next run's roles that
ask for the same Ray options (CPUs, GPUs, threads, node) are built in them instead of in new processes.

This module is the pool's bookkeeping only (no Ray): which idle process fits which request, and which to stop.
The runtime (``ray_runtime``) stops them and decides what may enter: only processes whose role answered that it
was idle (``RoleActor.retire``), and only after a run in which every role did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable


@dataclass(frozen=True)
class WarmKey:
    """The Ray options a role's process was started with: a warm process serves only a request with equal ones."""

    stream_calls: int  # threads of the actor class's stream group (a class property in Ray)
    num_cpus: float
    num_gpus: float
    max_concurrency: int
    resources: tuple = ()  # custom resources, as sorted (name, amount) pairs
    node: str | None = None  # the node it was pinned to (None: wherever Ray placed it)

    @property
    def holds_resources(self) -> bool:
        """An idle process that holds CPUs, GPUs or custom resources keeps them from everything else."""
        return self.num_cpus > 0 or self.num_gpus > 0 or bool(self.resources)


class WarmPool:
    """Idle role processes of one Ray instance (``owner``), by WarmKey.

    Holds at most one run's processes: ``give`` hands back those of earlier runs that the latest run did not
    take, for the caller to stop. Processes that hold resources give way to a request they cannot serve
    (``evict``), so an idle process never makes a new one wait for its CPU."""

    def __init__(self):
        self.owner: Hashable | None = None
        self._idle: list[tuple[WarmKey, Any]] = []

    def __len__(self) -> int:
        return len(self._idle)

    def _check_owner(self, owner: Hashable) -> None:
        if owner != self.owner:  # another Ray instance: the old one's processes went with it
            self._idle.clear()
            self.owner = owner

    def take(self, owner: Hashable, key: WarmKey) -> Any | None:
        """An idle process started with ``key``'s options (it leaves the pool), or None."""
        self._check_owner(owner)
        for i, (k, handle) in enumerate(self._idle):
            if k == key:
                del self._idle[i]
                return handle
        return None

    def evict(self, owner: Hashable, holding_only: bool = True) -> list:
        """Remove and return (for the caller to stop) the idle processes that hold resources (all with
        ``holding_only`` False)."""
        self._check_owner(owner)
        goes = [(k.holds_resources or not holding_only) for k, _ in self._idle]
        out = [h for (_, h), g in zip(self._idle, goes) if g]
        self._idle = [entry for entry, g in zip(self._idle, goes) if not g]
        return out

    def give(self, owner: Hashable, entries: list[tuple[WarmKey, Any]]) -> list:
        """Make ``entries`` (a finished run's idle processes) the pool; returns what was idle before, to stop."""
        self._check_owner(owner)
        stale = [h for _, h in self._idle]
        self._idle = list(entries)
        return stale

    def size(self, owner: Hashable) -> int:
        """How many idle processes of ``owner``'s instance the pool holds."""
        self._check_owner(owner)
        return len(self._idle)

    def idle_cpus(self, owner: Hashable) -> float:
        """CPUs the idle processes hold (free for a new run: taking or evicting them releases them)."""
        self._check_owner(owner)
        return sum(k.num_cpus for k, _ in self._idle)
