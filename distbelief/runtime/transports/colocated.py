"""The co-located transport: on one machine, the replica applies its pushes to the shards' memory itself.

Each shard shares its parameters, optimizer state and counters in ``/dev/shm`` (``ParameterShard.share``); the
replica maps them (ps/colocated.py) and runs the shard's own update under the shard's lock, then copies the
parameters into its fetch buffer (the shared-memory transport's). No call to a shard's process on the hot path,
except a tiny one when a background snapshot falls due.
"""

from __future__ import annotations

import threading

from distbelief.exceptions import RemoteTimeoutError, RoleFailedError
from distbelief.ps.colocated import ColocatedShard
from distbelief.runtime.base import Done, Future, ShardClient
from distbelief.runtime.transports.base import ShardTransport
from distbelief.runtime.transports.calls import RayFuture
from distbelief.runtime.transports.shared_memory import SharedMemoryTransport


class ColocatedTransport(ShardTransport):
    name = "colocated"
    fuses_push_fetch = True

    def __init__(self, plane: SharedMemoryTransport, shards: list[ColocatedShard], share_base: str):
        super().__init__(plane.client)
        self.plane, self.shards, self.share_base = plane, shards, share_base
        self._swap = threading.Lock()  # a shard's replacement vs the loop's update of it
        self._broken: Exception | None = None

    @classmethod
    def open(cls, plane: SharedMemoryTransport, share_base: str) -> "ColocatedTransport | None":
        """Ask every shard to share its memory under ``share_base``; None if one cannot (a write-ahead log, a
        vector-only shard: see ps/colocated.py)."""
        c = plane.client
        descriptors = RayFuture([h.call.remote("share", share_base, c.timeout_s) for h in c.handles],
                                "parameter shards", many=True).result(c.timeout_s)
        if any(d is None for d in descriptors):
            return None
        return cls(plane, [ColocatedShard(d, c.timeout_s) for d in descriptors], share_base)

    def _step(self, g, versions, num_examples: int, out, rows) -> tuple[list[int], list[int]]:
        """Push ``g`` (None: none) with ``rows`` to every shard and copy its parameters into ``out`` (None: no
        fetch); ``(versions after the push, versions copied)``."""
        if self._broken is not None:
            raise self._broken
        c = self.client
        pushed, fetched = [], []
        for k in range(len(c.handles)):
            with self._swap:
                p, f, due = self.shards[k].push_fetch(g, versions[k] if versions else 0, num_examples, out,
                                                      rows[k] if rows is not None else None)
            pushed.append(p)
            fetched.append(f)
            if due:  # the shard's process writes it in the background; nothing to wait for
                c.handles[k].call.remote("request_snapshot")
        return pushed, fetched

    def shared_buffers(self):
        return self.plane.shared_buffers()

    def fetch(self) -> Future:
        _, versions = self._step(None, None, 0, self.plane.buffers["fetch"], None)
        return Done((self.plane.fetch_parts, versions))

    def push(self, g, versions, num_examples, seq, rows) -> Future:
        return Done(self._step(g, versions, num_examples, None, rows)[0])

    def push_fetch(self, g, versions, num_examples, seq, rows) -> Future:
        pushed, fetched = self._step(g, versions, num_examples, self.plane.buffers["fetch"], rows)
        return Done((pushed, (self.plane.fetch_parts, fetched)))

    def fetch_rows(self, per_shard: list[list]) -> Future:
        if self._broken is not None:  # read under each shard's lock, here
            raise self._broken
        replies = []
        for k in range(len(self.client.handles)):
            with self._swap:
                replies.append(self.shards[k].fetch_rows(per_shard[k]))
        return Done(replies)

    def replace_shard(self, shard_id: int, handle) -> int:
        """Map the restarted shard's memory; returns the highest version this client had from the old one (final:
        read as the switch happens, so no later update to the old memory is missed)."""
        c = self.client
        try:
            descriptor = RayFuture(handle.call.remote("share", self.share_base, c.timeout_s),
                                   f"parameter shard {shard_id}").result(c.timeout_s)
            new = ColocatedShard(descriptor, c.timeout_s) if descriptor else None
        except (RoleFailedError, RemoteTimeoutError) as e:
            new, err = None, e
        else:
            err = RoleFailedError(f"restarted parameter shard {shard_id} cannot be shared")
        with self._swap:
            old = self.shards[shard_id].acked
            if new is None:
                self._broken = RoleFailedError(f"could not take restarted parameter shard {shard_id}: {err}")
            else:
                self.shards[shard_id].close()
                self.shards[shard_id] = new
            ShardClient.replace_shard(c, shard_id, handle)
        return old
