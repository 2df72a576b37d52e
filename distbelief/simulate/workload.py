"""What a simulated run does, read from the same configuration ``distbelief train`` reads.

``Workload.from_config(cfg)`` keeps the settings that decide where time goes (strategy, replicas, shards,
partitions, minibatch, n_fetch / n_push, prefetch, consistency, compression, Sandblaster's batch and portions)
and derives the bytes each call moves, with the compression codecs' own byte formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from distbelief.config import RunConfig
from distbelief.exceptions import ConfigError
from distbelief.ps.sharding import ShardLayout
from distbelief.simulate.profile import ModelProfile, profile_model

SIMULATED = ("downpour", "sync", "sandblaster")


@dataclass(frozen=True)
class Workload:
    strategy: str
    profile: ModelProfile
    replicas: int = 2
    shards: int = 2
    partitions: int = 1
    batch: int = 32
    fetch_every: int = 1
    push_every: int = 1
    overlap: bool = False
    consistency: str = "async"
    staleness_bound: int = 3
    backup_replicas: int = 0
    rule: str = "adagrad"
    compress: str = "none"
    compress_ratio: float = 0.01
    compress_bits: int = 4
    compress_rank: int = 4
    compress_fetch: str = "none"
    streams: bool = True
    lbfgs_batch: int = 8000
    portion_size: int = 500
    push_every_portions: int = 4
    history: int = 10
    backup_tasks: bool = True
    # replica id -> how many times slower it computes (stragglers)
    slow: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: RunConfig, profile: ModelProfile | None = None,
                    slow: dict[int, float] | None = None) -> "Workload":
        cfg = cfg.normalized()
        if cfg.strategy not in SIMULATED:
            raise ConfigError("strategy", f"the simulator models {', '.join(SIMULATED)} (runs with parameter "
                                          f"shards); got {cfg.strategy!r}")
        if cfg.max_replicas:
            raise ConfigError("replicas", "simulate a fixed replica count (elastic MIN:MAX runs are not modelled)")
        profile = profile or profile_model(cfg.model, cfg.task, cfg.num_classes)
        return cls(
            strategy=cfg.strategy, profile=profile, replicas=cfg.replicas, shards=cfg.shards,
            partitions=cfg.partitions, batch=cfg.batch_size, fetch_every=cfg.fetch_every,
            push_every=cfg.push_every, overlap=cfg.overlap, consistency=cfg.consistency,
            staleness_bound=cfg.staleness_bound, backup_replicas=cfg.backup_replicas,
            rule="sgd" if cfg.strategy == "sandblaster" else cfg.optimizer, compress=cfg.compress,
            compress_ratio=cfg.compress_ratio, compress_bits=cfg.compress_bits, compress_rank=cfg.compress_rank,
            compress_fetch=cfg.compress_fetch, streams=cfg.streams, lbfgs_batch=cfg.lbfgs_batch,
            portion_size=cfg.portion_size,
            push_every_portions=cfg.push_every_portions, history=cfg.history, backup_tasks=cfg.backup_tasks,
            slow=dict(slow or {}))

    # ------------------------------------------------------------------ derived
    @property
    def layout(self) -> ShardLayout:
        return ShardLayout.balanced(self.profile.params, self.shards)

    @property
    def chained(self) -> bool:
        """Whether each step's push is followed at once by the next step's fetch (n_fetch = n_push = 1, no
        prefetch): the fetch call reaches each shard right behind the push (Ray runs one caller's calls in
        order), so the shard answers it next, as if both were one call."""
        return not self.overlap and self.fetch_every == 1 and self.push_every == 1

    @property
    def object_store(self) -> bool:
        """Whether replicas move their bytes as call arguments through Ray's object store even beside the shards,
        instead of the shared-memory plane: compressed pushes or fetches (runtime/ray_runtime.py), and a
        model-parallel replica's partitions, which call the shards for their own ranges from actors of their own
        (runtime/partition_ray.py)."""
        return self.compress != "none" or self.compress_fetch != "none" or self.partitions > 1

    @property
    def streamed_pushes(self) -> bool:
        """Whether a Downpour replica's pushes to a shard on another node take its gloo stream (uncompressed,
        ``--streams``: runtime/transports/stream.py) rather than Ray's object store."""
        return self.streams and self.strategy == "downpour" and self.compress == "none"

    @property
    def streamed_fetches(self) -> bool:
        """... and its fetches (plain float32 ones: fp16 and delta answers go the object store's way)."""
        return self.streamed_pushes and self.compress_fetch == "none"

    def push_bytes(self) -> list[int]:
        """Bytes of one push to each shard, by the codec's own formula (float32 when uncompressed)."""
        sizes = self.layout.sizes()
        if self.compress == "none":
            return [4 * n for n in sizes]
        codec = self._codec()
        return [codec.formula_bytes(k) for k in range(self.shards)]

    @property
    def sparse_pushes(self) -> bool:
        """Whether a shard steps only the values a push carries (top-k under an elementwise rule that keeps values
        whose gradient is 0: ps/shard.py) instead of decoding the push and running the rule over its range."""
        from distbelief.ps.rules import RULES, steps_pushed_values_alone

        return self.compress == "topk" and steps_pushed_values_alone(RULES.get(self.rule))

    def push_values(self) -> list[int]:
        """Values a shard steps per push: those a sparse push carries (``sparse_pushes``), else every value of its
        range."""
        sizes = self.layout.sizes()
        if self.sparse_pushes:
            from distbelief.compression.topk import kept

            return [kept(self.compress_ratio, n) for n in sizes]
        return sizes

    def fetch_bytes(self, changed_fraction: float = 1.0) -> list[int]:
        """Bytes of one fetch from each shard: float32, float16, or the delta answer (4 bytes of position and 4
        of value per changed value, whole when that is not smaller: ps/shard.py)."""
        sizes = self.layout.sizes()
        if self.compress_fetch == "fp16":
            return [2 * n for n in sizes]
        if self.compress_fetch == "delta":
            return [min(8 * math.ceil(changed_fraction * n), 4 * n) for n in sizes]
        return [4 * n for n in sizes]

    @property
    def push_density(self) -> float:
        """Share of a shard's values one push changes (top-k: its ratio; the others: all)."""
        return self.compress_ratio if self.compress == "topk" else 1.0

    def _codec(self):
        from distbelief.compression import make_codec

        ranges = [self.layout.range(k) for k in range(self.shards)]
        tensors = list(self.profile.tensors) if self.compress == "powersgd" else None
        return make_codec(self.compress, ranges, tensors, ratio=self.compress_ratio, bits=self.compress_bits,
                          rank=self.compress_rank)
