"""The object-store transport: Ray calls whose arrays travel through Ray's object store. Works on any cluster.

On one node the object store is shared memory, so one ``ray.put`` of a gradient serves every shard (each maps it
and reads its own range); across nodes each shard receives only its own range, serialised when the push is made
(so the caller may reuse its buffer, and sending a shard the whole vector never multiplies network traffic).
"""

from __future__ import annotations

import ray

from distbelief.runtime.base import Future
from distbelief.runtime.transports.base import ShardTransport, row_args
from distbelief.runtime.transports.calls import calls


class ObjectStoreTransport(ShardTransport):
    name = "object-store"

    def __init__(self, client, single_node: bool):
        super().__init__(client)
        self.single_node = single_node

    def fetch(self) -> Future:
        c = self.client
        los = [c.layout.range(k)[0] for k in range(len(c.handles))]

        def split(values):
            return [(lo, v[0]) for lo, v in zip(los, values)], [v[1] for v in values]

        return calls(c, "fetch", c.fetch_args(), transform=split)

    def push(self, g, versions, num_examples, seq, rows) -> Future:
        c = self.client
        n = len(c.handles)
        extra = row_args(rows, n)
        if self.single_node and n > 1:
            # The future keeps the reference alive, so a push can be re-sent to a restarted shard.
            ref = ray.put(g)
            args = [(c.replica_id, ref, 0, versions[k], num_examples, c.session, seq, *extra[k]) for k in range(n)]
        else:
            args = [(c.replica_id, g[lo:hi], lo, versions[k], num_examples, c.session, seq, *extra[k])
                    for k, (lo, hi) in enumerate(c.layout.range(j) for j in range(n))]
        return calls(c, "push", args)
