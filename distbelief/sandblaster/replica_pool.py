"""The coordinator's replicas: one slot per live portion worker, and what happens when one fails.

A failed replica is killed and handed to the driver's ``restart`` callback, which answers with a replacement
role (it takes portions at once), a ``DeferredRestart`` (it starts once its backoff is over; the other replicas
go on meanwhile, nothing waits), or None (go on without it). What the failed replica computed or held is the
portion dispatch's business (``portion_dispatch``); this module only keeps the slots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from distbelief.exceptions import DistBeliefError, RemoteTimeoutError, RoleFailedError
from distbelief.runtime.base import Future, Role, Runtime


@dataclass(frozen=True)
class DeferredRestart:
    """What a ``restart`` callback returns to have a failed replica started again later (its backoff), without
    holding up the coordinator: ``start()`` is called once ``time.monotonic()`` reaches ``at``."""

    at: float
    start: Callable[[], Role]


@dataclass
class ReplicaSlot:
    """The coordinator's view of one replica."""

    role: Role
    future: Future | None = None
    kind: str = ""  # "compute" or "take"
    call_eval: int = -1  # the evaluation the outstanding call belongs to
    started_s: float = 0.0
    eval_id: int = -1  # the evaluation whose parameters (and held portions) the replica has
    claim: list[int] = field(default_factory=list)  # portions carried by the outstanding take


RestartFn = Callable[[int, Exception], "Role | DeferredRestart | None"]


class ReplicaPool:
    """The live replicas (``slots``) and the failed ones waiting out their backoff (``deferred``).

    Args:
        runtime: kills failed replicas and reaches the live ones.
        replicas: replica id -> placed SandblasterReplica role.
        restart: called with ``(replica_id, error)`` when a replica fails (see the module docstring). Default: go
            on without it.
        log: progress messages.
    """

    def __init__(self, runtime: Runtime, replicas: dict[int, Role], restart: RestartFn | None,
                 log: Callable[[str], None], timeout_s: float):
        if not replicas:
            raise ValueError("the coordinator needs at least one replica")
        self.runtime, self.restart, self.log, self.timeout_s = runtime, restart, log, timeout_s
        self.slots = {rid: ReplicaSlot(role) for rid, role in replicas.items()}
        self.deferred: dict[int, DeferredRestart] = {}  # failed replicas waiting out their backoff

    def replace(self, rid: int, err: Exception) -> bool:
        """Replica ``rid`` failed (its slot's bookkeeping is done): kill it, then replace it now, later, or never.
        Returns True if a replacement runs now (it takes portions from now on)."""
        slot = self.slots[rid]
        self.log(f"replica {rid} failed ({err}); what it held is computed again")
        try:
            self.runtime.kill(slot.role)
        except Exception:  # noqa: BLE001 - it is already gone
            pass
        new_role = self.restart(rid, err) if self.restart is not None else None
        if isinstance(new_role, DeferredRestart):
            del self.slots[rid]
            self.deferred[rid] = new_role
            return False
        if new_role is None:
            del self.slots[rid]
            if not self.slots and not self.deferred:
                raise DistBeliefError(f"every replica failed (last: replica {rid}: {err})")
            return False
        self.slots[rid] = ReplicaSlot(new_role)
        return True

    def start_due(self) -> list[int]:
        """Start the failed replicas whose backoff is over; returns their ids."""
        now = time.monotonic()
        started = []
        for rid, d in list(self.deferred.items()):
            if now >= d.at:
                del self.deferred[rid]
                self.slots[rid] = ReplicaSlot(d.start())
                started.append(rid)
        return started

    def next_start_at(self) -> float | None:
        """When the next deferred replica is due (``time.monotonic()``), or None if none waits."""
        return min((d.at for d in self.deferred.values()), default=None)

    def hand_shard(self, k: int, role: Role) -> None:
        """Give every live replica the restarted shard ``k``. One that cannot take it fails its next call and is
        replaced then."""
        handed = [(rid, self.runtime.call(slot.role, "replace_shard", k, role.handle))
                  for rid, slot in self.slots.items()]
        for rid, f in handed:
            try:
                f.result(self.timeout_s)
            except (RoleFailedError, RemoteTimeoutError) as e:
                self.log(f"replica {rid} could not take the restarted shard {k}: {e}")
