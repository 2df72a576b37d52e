"""Co-located updates: a replica on its shard's machine applies its push to the shard's memory itself.

Why: on one machine a push is a round trip to another process — a call, a wake-up of the shard's process, its
update, a reply, a wake-up of the replica — and on a laptop's two cores that other process takes CPU from the
replicas while they wait for it. Hogwild pays none of this: each worker updates the shared parameters in place.
Here a shard that is asked to (``ParameterShard.share``) moves its parameters, its optimizer state and its
counters into files in ``/dev/shm``, and a replica on the same machine maps them (``ColocatedShard``) and applies
each push with the shard's own update rule, then copies the resulting parameters back, both under the shard's
lock. The update is exactly the one the shard would have applied (same rule, same state, same staleness count),
serialised with every other replica's by that lock, so Downpour's semantics do not change; only who executes it.

What stays with the shard's process: it owns the memory (a restarted shard starts from its snapshot in new
memory), writes the background snapshots (a replica that finds one due sends the shard one small call), answers
the driver's fetches and statistics, and applies anything that still arrives as a call (synchronous data
parallelism). Not shared: shards with a write-ahead log (``--durability log`` logs each push on the shard's
process) and vector-only shards (Sandblaster).

The lock is an ``flock`` on the shard's counter file: the kernel releases it when its holder's process dies, so a
killed replica never leaves a shard locked (its half-applied update stays, as a Hogwild write would). Waits for it
are bounded like every remote wait.
"""

from __future__ import annotations

import numpy as np

from distbelief.ps.shard import ParameterShard
from distbelief.ps.sharedmem import ShardLock, open_storage


class ColocatedShard:
    """A replica's handle on one shared shard: apply a push and read the parameters back, under the shard's lock.

    Built from the descriptor ``ParameterShard.share`` returned. ``acked`` is the highest version this handle
    produced (the client reports it when the shard is replaced, to count the updates a failure lost)."""

    def __init__(self, descriptor: dict, timeout_s: float = 120.0):
        d = descriptor
        self.lock = ShardLock(d["lock"], timeout_s)
        # The same object the shard's process runs, over the same memory: the push path is shared code.
        self.view = ParameterShard(d["shard_id"], d["lo"], d["hi"], None, d["optimizer"], d["total"],
                                   storage=open_storage(d["files"]), lock=self.lock,
                                   tables=(d.get("tables"), None, None))
        self.every_updates, self.every_seconds = d["every_updates"], d["every_seconds"]
        self.acked = 0

    def push_fetch(self, grad: np.ndarray | None, based_on: int, num_examples: int,
                   out: np.ndarray | None, rows: list | None = None) -> tuple[int, int, bool]:
        """Apply the push (``grad`` covers the whole flat vector; None = no push; ``rows``: this shard's table
        rows of it, see ``ParameterShard.push``), then copy the parameters into ``out[lo:hi]`` (None = no fetch),
        atomically. Returns ``(version after the push, version copied, snapshot requested)``: the last is True
        once when a snapshot fell due, and the caller then asks the shard's process to write one
        (``ParameterShard.request_snapshot``)."""
        view = self.view
        with self.lock:
            pushed = view.push(-1, grad, 0, based_on, num_examples, rows=rows) if grad is not None else view.version
            fetched = view.read_into(out) if out is not None else pushed
            due = view.claim_snapshot(self.every_updates, self.every_seconds)
        if grad is not None and pushed > self.acked:
            self.acked = pushed
        return pushed, fetched, due

    def fetch_rows(self, requests: list) -> tuple[list, int]:
        """This shard's rows of the tables, as ``ParameterShard.fetch_rows`` (copies taken under the lock)."""
        return self.view.fetch_rows(requests)

    def close(self) -> None:
        self.lock.close()
