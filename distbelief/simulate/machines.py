"""The machines a simulated run has: nodes, cores, links.

``bandwidth`` is each node's link rate in bits per second, each direction (full duplex, as a NIC or a shaped
veth pair is), ``latency_s`` the one-way delay a message pays on top of its bytes. ``shared_cores`` > 0 says that
all nodes share that many physical cores: the shaped cluster of ``distbelief cluster up`` runs every node's
processes on this one machine's cores, and the simulator must share them the same way to predict it.
``shard_nodes`` > 0 puts the shards on the last ``shard_nodes`` nodes and the replicas on the others (``cluster
up --shard-nodes``); 0 spreads replicas and shards over all nodes, replicas first.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from distbelief.exceptions import ConfigError

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bandwidth(text: str | float, flag: str = "bandwidth") -> float:
    """Bits per second from ``"1gbit"``, ``"100mbit"``, ``"10g"``, ``"inf"`` or a number; ConfigError naming
    ``flag`` otherwise."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text > 0:
            return float(text)
        raise ConfigError(flag, f"must be > 0, got {text!r}")
    s = str(text).strip().lower()
    if s in ("inf", "unlimited", "none"):
        return math.inf
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps|b)?(/s)?", s)
    if not m or float(m[1]) <= 0:
        raise ConfigError(flag, f"a link rate such as 1gbit, 100mbit or 10gbit (bits per second), or inf; got "
                                f"{text!r}")
    return float(m[1]) * _UNITS[m[2]]


def format_bandwidth(bps: float) -> str:
    if math.isinf(bps):
        return "unlimited"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


@dataclass(frozen=True)
class Machines:
    nodes: int = 1
    cores_per_node: int = 2
    bandwidth: float = math.inf  # bits/s per node link, each direction
    latency_s: float = 0.0
    shared_cores: int = 0
    shard_nodes: int = 0

    def __post_init__(self):
        if self.nodes < 1:
            raise ConfigError("nodes", f"must be >= 1, got {self.nodes}")
        if self.cores_per_node < 1:
            raise ConfigError("cores_per_node", f"must be >= 1, got {self.cores_per_node}")
        if not self.bandwidth > 0:
            raise ConfigError("bandwidth", f"must be > 0, got {self.bandwidth}")
        if self.latency_s < 0:
            raise ConfigError("latency_s", f"must be >= 0, got {self.latency_s}")
        if self.shard_nodes < 0 or (self.shard_nodes and self.shard_nodes >= self.nodes):
            raise ConfigError("shard_nodes", f"must leave a node for the replicas: 0 <= shard_nodes < nodes "
                                             f"({self.nodes}), got {self.shard_nodes}")

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth / 8

    def describe(self) -> str:
        cores = (f"{self.shared_cores} cores shared by all nodes" if self.shared_cores
                 else f"{self.cores_per_node} cores each")
        link = "" if self.nodes == 1 else f", {format_bandwidth(self.bandwidth)} links"
        lat = f", {self.latency_s * 1e3:g} ms latency" if self.latency_s else ""
        return f"{self.nodes} node{'s' if self.nodes > 1 else ''} ({cores}){link}{lat}"

    def place(self, replicas: int, shards: int) -> tuple[list[int], list[int]]:
        """The node of each replica and each shard: with ``shard_nodes``, shards round-robin on the last nodes
        and replicas on the others; otherwise replicas round-robin from node 0 and shards from the node after
        the last replica's (so that on N >= R + S nodes every role has a node of its own)."""
        if self.nodes == 1:
            return [0] * replicas, [0] * shards
        if self.shard_nodes:
            first = self.nodes - self.shard_nodes
            return ([r % first for r in range(replicas)],
                    [first + k % self.shard_nodes for k in range(shards)])
        rep = [r % self.nodes for r in range(replicas)]
        return rep, [(replicas + k) % self.nodes for k in range(shards)]
