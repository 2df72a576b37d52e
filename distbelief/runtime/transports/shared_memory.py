"""The shared-memory transport: on one machine, a push's and a fetch's bulk bytes skip the object store.

The replica owns three float32 buffers in ``/dev/shm`` (a fetch buffer, two push buffers that alternate); each
shard gets a tiny Ray call naming a buffer and reads or writes its own range there (the shard's side is
``RoleActor.push_shm`` / ``fetch_shm`` / ``push_fetch_shm`` over runtime/shm.py, where the protocol's safety
argument is written). Table rows and everything else still travel as call arguments.
"""

from __future__ import annotations

import numpy as np

from distbelief.runtime import shm
from distbelief.runtime.base import Future
from distbelief.runtime.transports.base import ShardTransport, row_args
from distbelief.runtime.transports.calls import calls


class SharedMemoryTransport(ShardTransport):
    name = "shared-memory"
    fuses_push_fetch = True

    def __init__(self, client, shm_prefix: str):
        super().__init__(client)
        layout = client.layout
        base = f"{shm.SHM_DIR}/{shm_prefix}-r{client.replica_id}-{client.session:x}"
        self.paths = {"fetch": f"{base}-fetch", "push0": f"{base}-push0", "push1": f"{base}-push1"}
        self.buffers = {k: shm.create(p, layout.total) for k, p in self.paths.items()}
        self._next_push = 0
        # What a fetch returns: each shard's range of the fetch buffer (views, fixed for the buffer's life).
        fetch_buf = self.buffers["fetch"]
        self.fetch_parts = [(lo, fetch_buf[lo:hi]) for lo, hi in map(layout.range, range(len(client.handles)))]

    def shared_buffers(self):
        return self.buffers["fetch"], self.buffers["push0"]

    def fetch(self) -> Future:
        c = self.client

        def from_buffer(versions):  # the caller copies these views before it fetches again
            return self.fetch_parts, list(versions)

        args = [(self.paths["fetch"], c.layout.total, c.replica_id)] * len(c.handles)
        return calls(c, "fetch", args, actor_method="fetch_shm", transform=from_buffer)

    def _push_args(self, key: str, g, versions, num_examples: int, seq: int, rows) -> list[tuple]:
        """Put ``g`` into push buffer ``key`` (no copy if ``g`` is that buffer: a replica bound to
        ``shared_buffers()`` computed it in place) and return each shard's ``push_shm`` arguments."""
        c = self.client
        buf = self.buffers[key]
        if g.ctypes.data != buf.ctypes.data:
            np.copyto(buf, g)
        extra = row_args(rows, len(c.handles))
        return [(self.paths[key], c.layout.total, c.replica_id, 0, versions[k], num_examples, c.session, seq,
                 *extra[k]) for k in range(len(c.handles))]

    def push(self, g, versions, num_examples, seq, rows) -> Future:
        # The previous push was acknowledged before this one starts (the replica's back-pressure); buffers
        # alternate anyway, so a buffer is rewritten only two pushes after it was sent.
        key = f"push{self._next_push}"
        self._next_push ^= 1
        args = self._push_args(key, g, versions, num_examples, seq, rows)
        return calls(self.client, "push", args, actor_method="push_shm")

    def push_fetch(self, g, versions, num_examples, seq, rows) -> Future:
        push_args = self._push_args("push0", g, versions, num_examples, seq, rows)
        self._next_push = 1  # a plain push after this one must not reuse push0 while a shard may read it
        args = [(a[0], self.paths["fetch"], *a[1:]) for a in push_args]

        def unpack(replies):
            return [r[0] for r in replies], (self.fetch_parts, [r[1] for r in replies])

        return calls(self.client, "push+fetch", args, actor_method="push_fetch_shm", transform=unpack)
