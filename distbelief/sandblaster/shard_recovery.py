"""Iteration checkpoints, and what happens when a parameter shard dies: restart it, roll back, redo the iteration.

Sandblaster keeps its whole optimizer state on the shards (the accepted point, the gradients, the L-BFGS history),
so a shard that dies takes part of that state with it. With ``checkpoint_dir``, every shard saves all its vectors
at each iteration boundary and the coordinator remembers its scalars at that point (the last checkpoint every
shard acknowledged). When a shard dies mid-iteration, it is restarted from that checkpoint
(``ParameterShard.from_vectors``) and handed to every replica, the partial iteration is dropped, every shard and
the coordinator roll back to the checkpoint, and the iteration is done again — the result is the same as without
the failure. Without checkpoints a dead shard ends the run.

The coordinator's scalars stay the coordinator's: this module takes them through ``capture`` (a deep copy, and
their JSON-able ``export_state()`` for ``persist``) and gives them back through ``restore``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, TypeVar

from distbelief.exceptions import RoleFailedError
from distbelief.ps.shard import ParameterShard
from distbelief.runtime.base import Role, Runtime
from distbelief.sandblaster.counters import Counters
from distbelief.sandblaster.portion_dispatch import PortionDispatcher
from distbelief.sandblaster.settings import CoordinatorSettings
from distbelief.sandblaster.shard_programs import ShardFailed, ShardGroup

T = TypeVar("T")


@dataclass(frozen=True)
class IterationCheckpoint:
    """The last iteration checkpoint every shard acknowledged, and the coordinator's scalars at that point."""

    tag: int
    scalars: dict  # deep copies of the coordinator's scalars, for an in-run rollback
    state: dict  # export_state() at that point: JSON-able, for a resume in another process


class ShardRecovery:
    """Writes iteration checkpoints and recovers from shard failures, for the coordinator.

    Args:
        capture: the coordinator's scalars now, ``(deep copy, export_state())``.
        restore: puts the coordinator's scalars back to a deep copy taken by ``capture``.
        shard_replaced: called with ``(shard_id, new_role)`` after a dead shard was restarted (``shards.roles`` is
            already updated in place, and so are the replicas' clients).
        persist: called with ``(tag, state)`` once every shard has written iteration checkpoint ``tag``.
    """

    def __init__(self, runtime: Runtime, shards: ShardGroup, dispatcher: PortionDispatcher,
                 settings: CoordinatorSettings, counters: Counters,
                 capture: Callable[[], tuple[dict, dict]], restore: Callable[[dict], None],
                 log: Callable[[str], None],
                 shard_replaced: Callable[[int, Role], None] | None = None,
                 persist: Callable[[int, dict], None] | None = None):
        self.runtime, self.shards, self.dispatcher, self.settings = runtime, shards, dispatcher, settings
        self.counters, self.capture, self.restore, self.log = counters, capture, restore, log
        self.shard_replaced, self.persist = shard_replaced, persist
        self.timeout_s = settings.remote_timeout_s
        # One attribute, assigned in one statement: a Ctrl-C can never leave the tag and the scalars disagreeing.
        self.ckpt: IterationCheckpoint | None = None
        self.next_tag = 0
        self.checkpointed = False  # nothing changed on the shards or the coordinator since self.ckpt was taken
        self._restarts_by_shard: dict[int, int] = {}

    def reset(self, next_tag: int) -> None:
        """A resumed run: nothing to roll back to until the first checkpoint, which will be ``next_tag``."""
        self.ckpt, self.next_tag, self.checkpointed = None, next_tag, False

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_if_needed(self) -> None:
        if self.settings.checkpoint_dir and not self.checkpointed:
            self.save()

    def save(self) -> None:
        """Every shard saves all its vectors as checkpoint ``tag``; once all have, remember the coordinator's
        scalars (and hand them to ``persist``). A tag is reused only when its save failed, so no state ever names a
        rewritten one."""
        tag = self.next_tag
        self.shards.call_each("while checkpointing", "checkpoint_vectors", self.settings.checkpoint_dir, tag)
        scalars, state = self.capture()
        self.ckpt = IterationCheckpoint(tag, scalars, state)
        self.next_tag = tag + 1
        self.checkpointed = True
        if self.persist is not None:
            self.persist(tag, self.ckpt.state)

    def rollback(self) -> None:
        """Every shard's vectors and the coordinator's scalars back to the last iteration checkpoint."""
        ck = self.ckpt
        self.shards.call_each("while rolling back", "load_vectors", self.settings.checkpoint_dir, ck.tag)
        self.restore(ck.scalars)
        self.checkpointed = True

    # ------------------------------------------------------------------ shard failures
    def run(self, fn: Callable[[], T]) -> T:
        """``fn()``; if a shard dies meanwhile, restart it, roll back to the last checkpoint and call ``fn`` again."""
        failed: ShardFailed | None = None
        while True:
            try:
                if failed is not None:
                    self._recover(failed)
                    failed = None
                return fn()
            except ShardFailed as e:
                if not self.settings.checkpoint_dir or self.ckpt is None:
                    raise RoleFailedError(f"{e}. Sandblaster keeps its history on the shards and cannot continue "
                                          f"without iteration checkpoints (checkpoint_dir; a run writes them "
                                          f"unless --durability is off)") from e
                n = self._restarts_by_shard.get(e.shard_id, 0)
                if n >= self.settings.max_shard_restarts:
                    raise RoleFailedError(f"{e}; shard {e.shard_id} was already restarted {n} times "
                                          f"(max_shard_restarts)") from e
                failed = e

    def _recover(self, err: ShardFailed) -> None:
        """Restart the dead shard(s) from the last iteration checkpoint, drop the partial iteration, and roll every
        shard and the coordinator's scalars back to that checkpoint."""
        t0 = time.monotonic()
        root, tag = self.settings.checkpoint_dir, self.ckpt.tag
        dead = sorted({err.shard_id, *self.shards.dead()})
        self.log(f"parameter shard(s) {dead} died ({err}); restarting from iteration checkpoint {tag} and redoing "
                 f"the iteration")
        for k in dead:
            try:
                self.runtime.kill(self.shards.roles[k])
            except Exception:  # noqa: BLE001 - already gone
                pass
            role = self.runtime.create_shard(k, partial(ParameterShard.from_vectors, root, k, tag))
            try:
                self.runtime.call(role, "stats").result(max(self.timeout_s, 180.0))
            except RoleFailedError as e:
                raise RoleFailedError(f"parameter shard {k} could not be restarted from checkpoint {tag}: {e}") from e
            self.shards.roles[k] = role  # in place: whoever shares this list (the trainer) sees the new shard
            self._restarts_by_shard[k] = self._restarts_by_shard.get(k, 0) + 1
            self.counters.shard_restarts += 1
            self.dispatcher.pool.hand_shard(k, role)
            if self.shard_replaced is not None:
                self.shard_replaced(k, role)
        self.dispatcher.discard_in_flight()
        self.rollback()
        self.counters.iterations_redone += 1
        self.counters.shard_recovery_s.append(time.monotonic() - t0)
        self.log(f"shard(s) {dead} restored from iteration checkpoint {tag} in "
                 f"{self.counters.shard_recovery_s[-1]:.2f}s")
