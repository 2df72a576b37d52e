"""How the Sandblaster coordinator runs: one frozen record shared by its parts (see docs/sandblaster.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from distbelief.sandblaster.lbfgs import LBFGSSettings


@dataclass(frozen=True)
class CoordinatorSettings:
    """How the coordinator runs (see docs/sandblaster.md).

    Attributes:
        num_examples: size of the training set every replica holds.
        batch_size: examples per gradient evaluation (>= num_examples means full batch).
        portion_size: examples per portion.
        push_every_portions: a replica pushes the gradients it holds after this many portions (and at once
            when nothing is left to hand out).
        backup_tasks: near the end of a batch, give running portions to idle replicas too.
        force_backups: testing only: every portion is computed by two replicas.
        lbfgs: the L-BFGS and line-search constants.
        seed: seeds the batch order (full batch ignores it).
        remote_timeout_s: the longest any call may take; a replica over it is treated as dead.
        poll_s: how long one wait for results may block before the loop looks at timeouts and hooks.
        checkpoint_dir: where every shard saves all its vectors at each iteration boundary (before an iteration
            unless nothing changed since the last checkpoint; ``checkpoint()`` after one); a shard that dies is
            restarted from there and the iteration is redone. Empty: no checkpoints (a dead shard ends the run).
        max_shard_restarts: how often one shard may be restarted in a run.
    """

    num_examples: int
    batch_size: int
    portion_size: int
    push_every_portions: int = 4
    backup_tasks: bool = True
    force_backups: bool = False
    lbfgs: LBFGSSettings = field(default_factory=LBFGSSettings)
    seed: int = 0
    remote_timeout_s: float = 120.0
    poll_s: float = 0.5
    checkpoint_dir: str = ""
    max_shard_restarts: int = 3

    @property
    def effective_batch(self) -> int:
        return min(self.batch_size, self.num_examples)

    @property
    def full_batch(self) -> bool:
        return self.batch_size >= self.num_examples
