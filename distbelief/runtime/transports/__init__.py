"""Transports: how a replica's shard client moves calls and bytes to the parameter shards on Ray.

One shard client (``runtime.ray_runtime.RayShardClient``) does what is the same for every transport — version
bookkeeping, splitting a push's table rows by shard once, acknowledgements — and hands each operation to one
transport, chosen when the client is built:

- :mod:`.object_store` — Ray calls whose arrays travel through Ray's object store; works everywhere, across nodes.
- :mod:`.stream` — across nodes, a dense replica's pushes and fetches travel on a gloo stream per shard
  (runtime/streams.py) beside the Ray call; the rest, and any shard whose stream fails, the object store's way.
- :mod:`.shared_memory` — on one machine, the bulk bytes go through the replica's buffers in ``/dev/shm`` and the
  Ray call carries only their names (runtime/shm.py).
- :mod:`.colocated` — on one machine, the replica applies its pushes to the shards' shared memory itself, under
  each shard's lock (ps/colocated.py); no call at all on the hot path.

A transport's calls go through :class:`~.calls.ShardCalls`, where a call to a shard that died is re-sent to its
replacement: the failover loop exists once, for every transport and for partitions' range clients.
"""

from __future__ import annotations

import ray

from distbelief.runtime import shm
from distbelief.runtime.base import ShardClient
from distbelief.runtime.transports.base import ShardTransport
from distbelief.runtime.transports.colocated import ColocatedTransport
from distbelief.runtime.transports.object_store import ObjectStoreTransport
from distbelief.runtime.transports.shared_memory import SharedMemoryTransport
from distbelief.runtime.transports.stream import StreamTransport


def choose(client: ShardClient, shm_prefix: str | None, colocate: bool, stream: bool = False) -> ShardTransport:
    """The fastest transport that works where ``client`` runs: co-located updates, else the shared-memory plane
    (both only on a one-node cluster, with a prefix from the runtime and room in ``/dev/shm``), else, across nodes,
    streams for a replica that may use them (``stream``: dense pushes), else the object store. The driver's client
    (replica id -1) never co-locates nor streams: it only reads, now and then."""
    total = client.layout.total
    single_node = sum(1 for n in ray.nodes() if n.get("Alive")) == 1
    if not single_node and stream and client.replica_id >= 0:
        return StreamTransport(client, client.timeout_s)
    if not (shm_prefix and single_node and shm.available() and shm.has_room(3 * 4 * total)):
        return ObjectStoreTransport(client, single_node)
    plane = SharedMemoryTransport(client, shm_prefix)
    # (the shards' state takes params + optimizer state, about 2 x 4 bytes x parameters, in /dev/shm)
    if colocate and client.replica_id >= 0 and shm.has_room(2 * 4 * total):
        shared = ColocatedTransport.open(plane, f"{shm.SHM_DIR}/{shm_prefix}")
        if shared is not None:
            return shared
    return plane
