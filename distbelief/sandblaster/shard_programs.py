"""The coordinator's calls to the parameter shards: vector programs whose partial scalars it sums (docs/paper.md).

Every vector lives sliced on the ``ParameterShard``s, which run short *programs* of vector operations on their
own slice (``execute``: ``lincomb``, ``dots``, ``copy``, ``zero``, ...) and answer with partial scalars. A shard
that dies during any of these calls is reported as ``ShardFailed`` (with its index), which the shard recovery
turns into a restart and a rollback.
"""

from __future__ import annotations

import math

from distbelief.exceptions import RoleFailedError
from distbelief.runtime.base import Role, Runtime


class ShardFailed(RoleFailedError):
    """Parameter shard ``shard_id`` died during an iteration (internal: triggers a rollback)."""

    def __init__(self, shard_id: int, msg: str):
        super().__init__(msg)
        self.shard_id = shard_id


class ShardGroup:
    """The parameter shards, called together.

    ``roles`` is the caller's list, shared: a restarted shard replaces its predecessor in it in place, so that
    whoever holds the list (the trainer) sees the new shard.
    """

    def __init__(self, runtime: Runtime, roles: list[Role], timeout_s: float):
        self.runtime, self.roles, self.timeout_s = runtime, roles, timeout_s

    def call_each(self, during: str, method: str, *args) -> list:
        """``method(*args)`` on every shard at once; their answers in shard order. A shard that failed raises
        ``ShardFailed`` ("parameter shard k failed ``during``: ...")."""
        futs = [self.runtime.call(s, method, *args) for s in self.roles]
        out = []
        for k, f in enumerate(futs):
            try:
                out.append(f.result(self.timeout_s))
            except RoleFailedError as e:
                raise ShardFailed(k, f"parameter shard {k} failed {during}: {e}") from e
        return out

    def program(self, ops: list[tuple]) -> list:
        """Run ``ops`` on every shard's slice in one round trip; partial scalars are summed over the shards."""
        per_shard = self.call_each("during an L-BFGS vector program", "execute", ops)
        out = []
        for i in range(len(ops)):
            vals = [r[i] for r in per_shard]
            if vals[0] is None:
                out.append(None)
            elif isinstance(vals[0], (list, tuple)):
                out.append([math.fsum(col) for col in zip(*vals)])
            else:
                out.append(math.fsum(vals))
        return out

    def dead(self) -> list[int]:
        """The shards that do not answer (their process died)."""
        futs = [self.runtime.call(s, "stats") for s in self.roles]
        dead = []
        for k, f in enumerate(futs):
            try:
                f.result(self.timeout_s)
            except RoleFailedError:
                dead.append(k)
        return dead
