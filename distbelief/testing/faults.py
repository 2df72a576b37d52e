"""Failures and slowdowns injected into a run, for tests and benchmarks: ``distbelief.hooks.RunHooks``.

They are not part of a run's configuration (``distbelief train`` has no flag for them and config.toml never records
them): a test or a benchmark passes them to the Python API, ``train(..., hooks=Faults(...))`` or
``train_task(cfg, hooks=...)``. The drivers know nothing of them: a failure is fired through the hooks' ``on_step``
at a step (Sandblaster: L-BFGS iteration) count of the whole run, never at a wall-clock time, so it lands at the
same point of every run, by the driver's own ``kill_replica`` / ``kill_shard``; a slow machine is the replica hook
``Straggle``, which the replica runs after each step.

- ``kill_replica_at_step`` / ``kill_replica_id``: kill that replica's process once the run's replicas have done
  this many steps together (Downpour, sync, Hogwild, DDP; Sandblaster: iterations). ``kill_partition_id`` kills
  only that partition of a model-parallel replica.
- ``kill_shard_at_step`` / ``kill_shard_id``: kill that parameter shard's process the same way. With
  ``kill_shard_times = n`` (Downpour, sync), kill a shard n times, every ``kill_shard_every_steps`` steps; the i-th kill
  hits shard ``(kill_shard_id + i) % shards`` (a failover test's kills in a row).
- ``portion_delay_s``, ``straggler_id``, ``straggler_slowdown``: every step (Sandblaster: portion) takes at least
  ``portion_delay_s`` longer, and replica ``straggler_id`` takes ``straggler_slowdown`` times as long (emulating a
  slow machine).
- ``on_evaluation(driver, record)``: a test's probe into the driver (Downpour, sync, Hogwild, DDP, Sandblaster),
  called after each evaluation with the driver object itself — to kill a worker at a chosen moment, read the
  replicas' state while they are paused, remove a node, end the run (``driver.request_stop``). Users' callbacks get
  a typed ``Evaluation`` instead (``train(callbacks=)``).

Each fault fires once per run (not again after a resume).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Any

from distbelief.exceptions import ConfigError
from distbelief.hooks import RunHooks


@dataclass(frozen=True)
class Straggle:
    """A replica hook: after each step (portion) that took ``compute_s``, sleep so that it took
    ``delay_s + (compute_s + delay_s) * slowdown`` in all (a machine ``slowdown`` times slower, plus a fixed
    ``delay_s`` of emulated compute)."""

    delay_s: float = 0.0
    slowdown: float = 1.0

    def __call__(self, count: int, compute_s: float) -> None:
        extra = self.delay_s + (self.slowdown - 1.0) * (compute_s + self.delay_s)
        if extra > 0:
            time.sleep(extra)


@dataclass(frozen=True)
class Faults(RunHooks):
    kill_replica_at_step: int = 0  # 0 = never
    kill_replica_id: int = 0
    kill_partition_id: int = -1  # -1 = the whole replica
    kill_shard_at_step: int = 0  # 0 = never
    kill_shard_id: int = 0
    kill_shard_times: int = 1
    kill_shard_every_steps: int = 0
    portion_delay_s: float = 0.0
    straggler_id: int = -1  # -1 = none
    straggler_slowdown: float = 1.0
    on_evaluation: Any = None  # f(driver, record), in the driver process

    def check(self, cfg: Any) -> None:
        self.validate(cfg.replicas_started, cfg.shards, cfg.partitions)

    def validate(self, replicas: int, shards: int, partitions: int) -> "Faults":
        """Check the faults against the run they go into; ConfigError names the field."""
        for name in ("kill_replica_at_step", "kill_shard_at_step", "kill_shard_id", "kill_replica_id",
                     "kill_shard_times", "kill_shard_every_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(name, f"must be an integer >= 0, got {v!r}")
        if self.kill_replica_at_step and not 0 <= self.kill_replica_id < replicas:
            raise ConfigError("kill_replica_id", f"must name a replica in [0, {replicas}), got "
                                                 f"{self.kill_replica_id}")
        if self.kill_partition_id != -1:
            if partitions == 1 or not 0 <= self.kill_partition_id < partitions:
                raise ConfigError("kill_partition_id", f"must name a partition in [0, {partitions}) of a "
                                                       f"partitioned replica (partitions > 1), or be -1 (the whole "
                                                       f"replica), got {self.kill_partition_id!r}")
            if not self.kill_replica_at_step:
                warnings.warn("kill_partition_id has no effect without kill_replica_at_step", stacklevel=2)
        if self.kill_shard_at_step and not 0 <= self.kill_shard_id < shards:
            raise ConfigError("kill_shard_id", f"must name a shard in [0, {shards}), got {self.kill_shard_id}")
        if self.kill_shard_times < 1:
            raise ConfigError("kill_shard_times", f"must be >= 1, got {self.kill_shard_times}")
        if self.kill_shard_times > 1 and not self.kill_shard_every_steps:
            raise ConfigError("kill_shard_every_steps", "must be > 0 when kill_shard_times > 1 (the steps between "
                                                        "two kills)")
        if not (math.isfinite(self.portion_delay_s) and self.portion_delay_s >= 0):
            raise ConfigError("portion_delay_s", f"must be >= 0, got {self.portion_delay_s!r}")
        if not (math.isfinite(self.straggler_slowdown) and self.straggler_slowdown >= 1):
            raise ConfigError("straggler_slowdown", f"must be >= 1 (a factor), got {self.straggler_slowdown!r}")
        if not -1 <= self.straggler_id < replicas:
            raise ConfigError("straggler_id", f"must name a replica in [0, {replicas}) or be -1 (none), got "
                                              f"{self.straggler_id}")
        return self

    def start(self, driver: Any, resumed: bool) -> "FaultInjector":
        return FaultInjector(self, already_fired=resumed, shards=getattr(getattr(driver, "cfg", None), "shards", None))

    def replica_hook(self, replica_id: int) -> Straggle | None:
        slowdown = self.straggler_slowdown if replica_id == self.straggler_id else 1.0
        if slowdown > 1 or self.portion_delay_s > 0:
            return Straggle(self.portion_delay_s, slowdown)
        return None


class FaultInjector(RunHooks):
    """One run's ``Faults``: fires each once, when the run's step count (all replicas together; Sandblaster:
    L-BFGS iterations) reaches it, through the driver's ``kill_shard(shard_id, steps)`` and
    ``kill_replica(replica_id, partition_id, steps)``; the latter returns False when that replica cannot be
    killed now (not running: the fault waits for the driver's next look)."""

    def __init__(self, faults: Faults, already_fired: bool = False, shards: int | None = None):
        self.faults = faults
        self.replica_done = already_fired or not faults.kill_replica_at_step
        self.shard_done = already_fired or not faults.kill_shard_at_step
        self.shard_kills = 0  # kills fired so far (kill_shard_times)
        self.shards = shards  # how many the run has (repeated kills go round them)

    @property
    def pending(self) -> bool:
        return not (self.replica_done and self.shard_done)

    def next_step(self) -> int | None:
        f, due = self.faults, []
        if not self.shard_done:
            due.append(f.kill_shard_at_step + self.shard_kills * f.kill_shard_every_steps)
        if not self.replica_done:
            due.append(f.kill_replica_at_step)
        return min(due) if due else None

    def on_step(self, driver: Any, steps: int) -> None:
        self.check_steps(steps, driver.kill_shard, driver.kill_replica)

    def check_steps(self, steps: int, kill_shard, kill_replica) -> None:
        f = self.faults
        if not self.shard_done and steps >= f.kill_shard_at_step + self.shard_kills * f.kill_shard_every_steps:
            k = f.kill_shard_id if not self.shards else (f.kill_shard_id + self.shard_kills) % self.shards
            self.shard_kills += 1
            self.shard_done = self.shard_kills >= f.kill_shard_times
            kill_shard(k, steps)
        if not self.replica_done and steps >= f.kill_replica_at_step:
            if kill_replica(f.kill_replica_id, f.kill_partition_id, steps):
                self.replica_done = True

    def on_evaluation(self, driver: Any, record: dict) -> None:
        if self.faults.on_evaluation is not None:
            self.faults.on_evaluation(driver, record)

    def replica_hook(self, replica_id: int) -> Straggle | None:
        return self.faults.replica_hook(replica_id)
