"""The object-store transport: Ray calls whose arrays travel through Ray's object store. Works on any cluster.

On one node the object store is shared memory, so one ``ray.put`` of a gradient serves every shard (each maps it
and reads its own range); across nodes each shard receives only its own range, serialised when the push is made
(so the caller may reuse its buffer, and sending a shard the whole vector never multiplies network traffic).
A push and the fetch right after it (the replica's fused loop) are one call per shard.
"""

from __future__ import annotations

import ray

from distbelief.runtime.base import Future
from distbelief.runtime.transports.base import ShardTransport, row_args
from distbelief.runtime.transports.calls import ShardCalls, calls


class ObjectStoreTransport(ShardTransport):
    name = "object-store"
    fuses_push_fetch = True

    def __init__(self, client, single_node: bool):
        super().__init__(client)
        self.single_node = single_node
        self.los = [client.layout.range(k)[0] for k in range(len(client.handles))]

    def _parts(self, answers) -> tuple[list, list]:
        """Every shard's fetch answer ``(values, version)`` as a fetch's ``(parts, versions)``."""
        return [(lo, a[0]) for lo, a in zip(self.los, answers)], [a[1] for a in answers]

    def fetch(self) -> Future:
        return calls(self.client, "fetch", self.client.fetch_args(), transform=self._parts)

    def _push_args(self, g, versions, num_examples, seq, rows) -> list[tuple]:
        c = self.client
        n = len(c.handles)
        extra = row_args(rows, n)
        if self.single_node and n > 1:
            # The future keeps the reference alive, so a push can be re-sent to a restarted shard.
            ref = ray.put(g)
            return [(c.replica_id, ref, 0, versions[k], num_examples, c.session, seq, *extra[k]) for k in range(n)]
        return [(c.replica_id, g[lo:hi], lo, versions[k], num_examples, c.session, seq, *extra[k])
                for k, (lo, hi) in enumerate(c.layout.range(j) for j in range(n))]

    def push(self, g, versions, num_examples, seq, rows) -> Future:
        return calls(self.client, "push", self._push_args(g, versions, num_examples, seq, rows))

    def push_fetch(self, g, versions, num_examples, seq, rows) -> Future:
        """One call per shard: its push, then its fetch (one round trip and one call's overhead a step, not two)."""
        fetch_args = self.client.fetch_args()
        sends = {k: ("push_fetch", (len(push), *push, *fetch_args[k]))
                 for k, push in enumerate(self._push_args(g, versions, num_examples, seq, rows))}

        def unpack(replies):
            return [r[0] for r in replies], self._parts([r[1] for r in replies])

        return ShardCalls(self.client, "push+fetch", sends, transform=unpack)
