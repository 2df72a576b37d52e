"""The link from a primary shard to its backup (``--durability replicate``, ps/replication.py): built in the
driver, used in the primary's process. On one machine a push the primary read from a replica's ``/dev/shm`` buffer
reaches the backup as the buffer's name (the backup reads it there too), else as a call argument."""

from __future__ import annotations

import ray

from distbelief.runtime.transports.calls import RayFuture


class BackupLink:
    """A primary shard's link to its backup actor (ps/replication.py); built in the driver, used in the primary's
    process. ``call`` waits for the backup's answer (at most ``timeout_s``); ``push`` only sends, and returns the
    reference to the backup's acknowledgement, which the replica that pushed waits for (runtime/forwarded.py)."""

    def __init__(self, handle, name: str, timeout_s: float):
        self.handle, self.name, self.timeout_s = handle, name, timeout_s
        self._same_node: bool | None = None  # whether the backup can map this machine's files (asked once)

    def call(self, method: str, *args):
        return RayFuture(self.handle.call.remote(method, *args), self.name).result(self.timeout_s)

    def push(self, grad, offset: int, based_on_version: int, num_examples: int, session: int, seq: int, mapped,
             rows=None):
        extra = (rows,) if rows is not None else ()  # a model's table rows travel as an argument: they are small
        if mapped is not None and self._same_node is None:
            here = ray.get_runtime_context().get_node_id()
            self._same_node = RayFuture(self.handle.node_id.remote(), self.name).result(self.timeout_s) == here
        if mapped is not None and self._same_node:
            # The whole gradient is in a replica's buffer in /dev/shm: the backup reads its range there (as we did)
            # instead of receiving a copy; the replica rewrites the buffer only after both acknowledged it.
            path, size = mapped
            return self.handle.push_shm.remote(path, size, -1, 0, based_on_version, num_examples, session, seq,
                                               *extra)
        return self.handle.call.remote("push", -1, grad, offset, based_on_version, num_examples, session, seq,
                                       *extra)

    def version_of(self, ack, wait: bool) -> int | None:
        if not wait and not ray.wait([ack], timeout=0)[0]:
            return None
        return RayFuture(ack, self.name).result(self.timeout_s)

    def handoff(self, ack):
        return ack  # calls from one process to one actor run in order: the backup applies them in ours
