"""The progress block the hogwild / ddp driver shares with its worker processes: per-worker counters and the
driver's go / stop / pause / resume flags, in shared memory, without locks."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from distbelief.exceptions import RemoteTimeoutError

# Worker phases, written by the worker into its row of SharedProgress.
STARTING, READY, DONE = 0, 1, 2
# Columns of a worker's row; _PAUSED holds the pause generation the worker is paused for (0 while it trains).
_STEPS, _EXAMPLES, _STALE_SUM, _STALE_MAX, _PHASE, _PAUSED = range(6)
# The driver's flags; _PAUSE and _RESUME are generations: a pause is requested while _PAUSE > _RESUME.
_GO, _STOP, _PAUSE, _RESUME = range(4)


class SharedProgress:
    """Per-worker progress in shared memory: each worker writes only its own row, lock-free; the driver reads.

    Rows hold steps, examples, staleness sum and max, the phase and the pause the worker is holding;
    ``loss_ema`` the worker's training loss (an EMA, NaN before its first step); ``flags`` the driver's go,
    stop, pause and resume signals. It crosses to a worker by pickling: torch.multiprocessing passes the
    shared tensors by handle, not by copy. Thread/process safety: a single writer per row; readers may see a
    row mid-update (one counter ahead of another), never a torn value.
    """

    def __init__(self, num_workers: int):
        self.counts = torch.zeros(num_workers, 6, dtype=torch.int64).share_memory_()
        self.loss_ema = torch.full((num_workers,), math.nan, dtype=torch.float64).share_memory_()
        self.flags = torch.zeros(4, dtype=torch.int64).share_memory_()
        self._views()

    def _views(self) -> None:
        # numpy views of the same memory: a scalar write costs ~0.1 us, a tensor __setitem__ several us
        self._c, self._loss, self._flags = self.counts.numpy(), self.loss_ema.numpy(), self.flags.numpy()

    def __getstate__(self) -> dict:
        return {"counts": self.counts, "loss_ema": self.loss_ema, "flags": self.flags}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._views()

    # ------------------------------------------------------------------ worker side
    def mark(self, rank: int, phase: int) -> None:
        self._c[rank, _PHASE] = phase

    def count_step(self, rank: int, examples: int, loss: float, staleness: int) -> None:
        row = self._c[rank]
        row[_EXAMPLES] += examples
        row[_STALE_SUM] += staleness
        row[_STALE_MAX] = max(row[_STALE_MAX], staleness)
        prev = self._loss[rank]
        self._loss[rank] = loss if math.isnan(prev) else 0.9 * prev + 0.1 * loss
        row[_STEPS] += 1  # last: a reader that sees the step also sees its examples

    def total_steps(self) -> int:
        return int(self._c[:, _STEPS].sum())

    def stop_requested(self) -> bool:
        return bool(self._flags[_STOP])

    def pause_requested(self) -> bool:
        return bool(self._flags[_PAUSE] > self._flags[_RESUME])

    def hold_pause(self, rank: int, timeout_s: float) -> None:
        """Called at a step boundary once a pause is requested (DDP: agreed by every rank): report paused and
        wait until the driver resumes or stops the run, or is gone, so the driver evaluates on idle cores and
        parameters that no one writes. Raises if the driver neither resumes nor stops it within
        ``timeout_s``."""
        generation = int(self._flags[_PAUSE])
        self._c[rank, _PAUSED] = generation
        deadline = time.monotonic() + timeout_s
        try:
            while self._flags[_RESUME] < generation and not self._flags[_STOP] and driver_alive():
                if time.monotonic() > deadline:
                    raise RemoteTimeoutError(f"worker {rank} was paused for evaluation and not resumed "
                                             f"within {timeout_s:.0f}s (remote_timeout_s, at least 300)")
                time.sleep(0.0005)
        finally:
            self._c[rank, _PAUSED] = 0

    def wait_go(self, rank: int, timeout_s: float) -> bool:
        """Block until the driver says go (True) or stop (False); raise if neither comes in time."""
        deadline = time.monotonic() + timeout_s
        while not self._flags[_GO]:
            if self._flags[_STOP] or not driver_alive():
                return False
            if time.monotonic() > deadline:
                raise RemoteTimeoutError(f"worker {rank} waited {timeout_s:.0f}s for the driver to start "
                                         f"training (remote_timeout_s, at least 60)")
            time.sleep(0.001)
        return not self._flags[_STOP]

    # ------------------------------------------------------------------ driver side
    def go(self) -> None:
        self._flags[_GO] = 1

    def stop(self) -> None:
        self._flags[_STOP] = 1

    def request_pause(self) -> int:
        """Ask every worker to pause at its next step boundary; the generation to wait for in ``paused``."""
        generation = int(self._flags[_PAUSE]) + 1
        self._flags[_PAUSE] = generation
        return generation

    def resume(self) -> None:
        self._flags[_RESUME] = self._flags[_PAUSE]

    def pause_generation(self) -> int:
        """The generation of the latest pause requested (what ``paused`` compares a worker's hold with)."""
        return int(self._flags[_PAUSE])

    def paused(self, rank: int, generation: int) -> bool:
        return int(self._c[rank, _PAUSED]) == generation

    def phase(self, rank: int) -> int:
        return int(self._c[rank, _PHASE])

    def steps(self) -> list[int]:
        return [int(s) for s in self._c[:, _STEPS]]

    def snapshot(self, ranks: list[int]) -> dict[str, Any]:
        """Totals over all workers (counts include lost workers' steps: their updates are in the parameters);
        the training loss is the mean of the EMAs of ``ranks`` (the workers not lost)."""
        c = self._c.copy()
        losses = [float(self._loss[r]) for r in ranks if not math.isnan(self._loss[r])]
        steps = int(c[:, _STEPS].sum())
        return {
            "steps": [int(s) for s in c[:, _STEPS]], "examples": int(c[:, _EXAMPLES].sum()),
            "train_loss": sum(losses) / len(losses) if losses else None,
            "staleness_mean": float(c[:, _STALE_SUM].sum()) / steps if steps else 0.0,
            "staleness_max": int(c[:, _STALE_MAX].max()) if len(c) else 0,
        }


def driver_alive() -> bool:
    """In a worker: whether the driver that started it is still running (an orphan must stop)."""
    parent = mp.parent_process()  # the driver, for spawn and forkserver children alike
    return parent is None or parent.is_alive()
