"""Shard replication (``--durability replicate``): every parameter shard has a backup, a second shard in another
process (on another node where the cluster has one), that applies every update the primary applies, in the
primary's order; a replica counts a push as acknowledged only once both applied it (the primary's answer carries
the backup's pending acknowledgement, and the replica waits for both: runtime/forwarded.py). When the primary dies
the backup takes its place holding every acknowledged update, and the replicas re-send what was not acknowledged, recognised by its (session, seq)
if the backup already has it: nothing is lost and nothing is applied twice, with no disk anywhere.

The primary forwards each applied update to its backup over a *link*, which the runtime provides (a lock-guarded
call in one process, a Ray actor call across processes): ``link.call(method, *args)`` runs ``method`` on the backup
shard and returns its answer; ``link.push(grad, offset, based_on_version, num_examples, session, seq, mapped,
rows)`` sends a push there and returns an acknowledgement to check later with ``link.version_of(ack, wait)`` (the
backup's version after it, or None while it is on its way) — ``mapped`` names the file the whole gradient lives in
when the replica handed it over in shared memory, so that a backup on the same machine reads it there instead of
receiving a copy, and ``rows`` are the push's embedding-table rows (None for a model without tables), which the
backup, holding the same keys, applies as they are; ``link.handoff(ack)`` is what the replica that pushed must
wait for (None when the link applied the push before returning). All raise RoleFailedError or RemoteTimeoutError when the backup is gone. A backup that
fails is dropped at once (the primary goes on alone, and its ``stats()`` say ``has_backup: False``) and the
driver gives the primary a new one (``attach_backup``): the new backup receives the primary's whole state in the
same call, so no update falls between the copy and the first forwarded push.

``ParameterShard`` inherits this (mixed in), like its durability.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Self

import numpy as np

from distbelief.exceptions import RemoteTimeoutError, RoleFailedError
from distbelief.ps.arrays import PARAMS
from distbelief.ps.rules import persistent


class ReplicatedShard:
    """The replication half of ParameterShard (mixed in): forwarding to a backup, and becoming one."""

    _backup: Any = None  # the link to our backup, while we have one
    _handoff: Any = None  # the backup's pending acknowledgement of the push just applied, for the runtime
    _unsettled: deque  # (acknowledgement, our version after that update), oldest first
    replicated = False  # a primary or a backup of a replicated run: never shared with co-located replicas
    backups_lost = 0  # backups dropped because a forward to them failed
    backups_attached = 0

    @classmethod
    def blank(cls, shard_id: int, lo: int, hi: int, optimizer, total: int, slicer=None) -> Self:
        """An empty shard for range ``[lo, hi)`` (and, with ``slicer``, the keys of its embedding-table rows), to
        become a backup: its state arrives with ``load_state``."""
        shard = cls(shard_id, lo, hi, np.zeros(hi - lo, dtype=np.float32), optimizer, total,
                    tables=(slicer, None, None) if slicer is not None else None)
        shard.replicated = True
        return shard

    def attach_backup(self, link) -> int:
        """Make the shard behind ``link`` our backup: copy our whole state to it now, then forward every update
        we apply. Returns our version (the backup's too)."""
        with self.lock:
            link.call("load_state", self._replica_state())
            self._backup, self._handoff, self._unsettled = link, None, deque()
            self.replicated = True
            self.backups_attached += 1
            return self.version

    def _replica_state(self) -> dict:
        """Everything a backup needs to be us: parameters, optimizer state, counters, exactly-once sequence
        numbers. Live arrays: the link copies them (Ray serialises the call; in one process load_state copies)."""
        state = {PARAMS: self._params_np, "counters": self._ctr, "last_seq": dict(self.last_seq)}
        state.update({f"opt.{k}": v.numpy() for k, v in persistent(self.optimizer, self.opt_state).items()})
        state.update({k: v.numpy() for k, v in self._table_arrays().items()})  # table.<g>.weight, table.<g>.opt.*
        return state

    def load_state(self, state: dict) -> int:
        """(On a backup) take a primary's whole state (``_replica_state``)."""
        with self.lock:
            np.copyto(self._params_np, np.asarray(state[PARAMS], dtype=np.float32))
            for name, value in state.items():
                if name.startswith("opt."):
                    self.opt_state[name[4:]].numpy()[:] = value
            self._load_table_arrays(state)
            self._ctr[:] = state["counters"]
            self.last_seq = dict(state["last_seq"])
            self.replicated = True
            return self.version

    def _forward(self, grad: np.ndarray, offset: int, based_on_version: int, num_examples: int, session: int,
                 seq: int, whole=None, wait: bool = False, rows: list | None = None) -> None:
        """Send the update we just applied to our backup too (called under our lock, after our version moved):
        ``grad`` is the slice we applied at flat ``offset``; ``whole`` the push's whole gradient as it arrived
        (a file mapping when a replica handed it over in shared memory); ``rows`` the push's embedding-table rows
        (ours: the backup holds the same keys).

        The backup's acknowledgement is not awaited here unless ``wait``: the runtime hands it to the caller with
        our answer (``take_handoff``), and the caller waits for both, so we and our backup apply the update at
        the same time. A backup that fails, or whose version after an update is not ours, is dropped; the
        driver gives us a new one."""
        if self._backup is None:
            return
        self._settle(wait=False)
        if self._backup is None:
            return
        filename = getattr(whole, "filename", None)  # np.memmap: the replica's buffer, the whole model's length
        mapped = (filename, whole.size) if filename and whole.size == self.total else None
        try:
            ack = self._backup.push(grad, offset, based_on_version, num_examples, session, seq, mapped, rows)
        except (RoleFailedError, RemoteTimeoutError):
            self._drop_backup()
            return
        self._unsettled.append((ack, self.version))
        if wait:
            self._settle(wait=True)
        else:
            self._handoff = self._backup.handoff(ack)

    def _settle(self, wait: bool) -> None:
        """Check the backup's acknowledgements of earlier forwards, oldest first (all of them if ``wait``; else
        those already in): each must report our version after that update."""
        while self._backup is not None and self._unsettled:
            ack, expected = self._unsettled[0]
            try:
                after = self._backup.version_of(ack, wait)
            except (RoleFailedError, RemoteTimeoutError):
                after = -1
            if after is None:  # still on its way
                return
            self._unsettled.popleft()
            if after != expected:  # gone, or (never seen) out of step: a copy that differs is no backup
                self._drop_backup()

    def _drop_backup(self) -> None:
        self._backup, self._handoff = None, None
        self._unsettled.clear()
        self.backups_lost += 1

    def take_handoff(self):
        """(The runtime, right after a push) what the caller must wait for besides our answer: the backup's
        acknowledgement of that push, or None (nothing forwarded, or forwarded and already acknowledged)."""
        handoff, self._handoff = self._handoff, None
        return handoff

    def replication_stats(self) -> dict:
        self._settle(wait=False)
        return {"has_backup": self._backup is not None, "backups_lost": self.backups_lost,
                "backups_attached": self.backups_attached}
