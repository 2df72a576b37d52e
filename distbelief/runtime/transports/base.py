"""What every transport does (the shard client hands it each operation); see the package's docstring."""

from __future__ import annotations

from abc import ABC, abstractmethod

from distbelief.runtime.base import Future, ShardClient
from distbelief.runtime.transports.calls import calls


class ShardTransport(ABC):
    """A data plane between one client and all shards. Arguments are prepared by the client: ``g`` is the flat
    float32 gradient (numpy), ``versions[k]`` the version the push is based on at shard k, ``seq`` the push's
    sequence number, ``rows`` None or per shard its part of the push's table rows (already checked)."""

    name: str = "transport"
    fuses_push_fetch = False  # whether push_fetch does a push and the fetch after it in one step per shard

    def __init__(self, client: ShardClient):
        self.client = client

    @abstractmethod
    def fetch(self) -> Future:
        """Every shard's parameters: ``(parts, versions)``, ``parts = [(lo, values), ...]``."""

    @abstractmethod
    def push(self, g, versions: list[int], num_examples: int, seq: int, rows: list | None) -> Future:
        """Each shard its range of ``g`` (and its rows); the result is the versions after the push, per shard."""

    def push_fetch(self, g, versions: list[int], num_examples: int, seq: int, rows: list | None) -> Future:
        """(Where ``fuses_push_fetch``) a push and the fetch after it in one step per shard: ``(versions after the
        push, (parts, versions))``. Elsewhere the client sends a push and then a fetch."""
        raise NotImplementedError(f"the {self.name} transport sends a push and a fetch separately")

    def fetch_rows(self, per_shard: list[list]) -> Future:
        """One ``fetch_rows`` per shard (``per_shard[k]``: its local ids per table): the shards' ``(values,
        version)`` answers. Rows are small: every calling transport sends them as call arguments."""
        c = self.client
        return calls(c, "fetch_rows", [(per_shard[k], c.replica_id) for k in range(len(c.handles))])

    def replace_shard(self, shard_id: int, handle) -> int:
        """Install a restarted shard (the client's ``replace_shard``)."""
        return ShardClient.replace_shard(self.client, shard_id, handle)

    def shared_buffers(self):
        return None


def row_args(rows: list | None, num_shards: int) -> list[tuple]:
    """Per shard, the trailing push arguments that carry its rows (a model's table rows travel as arguments:
    they are small); none at all for a push without rows."""
    return [()] * num_shards if rows is None else [(part,) for part in rows]
