"""The run summary (``summary.json``): one typed record that every strategy fills in.

The fields every run has come first and are required (``summary.json`` always holds them; ``target_accuracy``
and ``time_to_target_s`` are null when no target was set or it was not reached). The rest belong to some
strategies only and default to None, which means "does not apply to this run" — never a placeholder zero: a
single-process SGD run has no parameter shards, so it reports no staleness, no rejected pushes and no restarts,
rather than zeros a reader would take for measurements. ``to_dict()`` leaves those out of ``summary.json``.

A strategy that reported a field this class does not name would fail here (``TypeError``), so a misspelt or
undocumented key cannot slip into the summary.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any


@dataclass
class RunSummary:
    # -- every run --
    strategy: str
    runtime: str
    replicas: int
    num_parameters: int
    final_test_accuracy: float
    best_test_accuracy: float
    target_accuracy: float | None  # the user's target (None: none set)
    time_to_target_s: float | None  # None: the target was not reached (or none was set)
    examples: int
    examples_per_s: float
    updates: int  # parameter updates applied (a shard push, an optimizer step, an L-BFGS step)
    steps_per_replica: list[int]
    stop_reason: str
    wall_s: float
    events: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None  # set when the run ended on a failure (the run directory is still written)

    # -- how the run was placed --
    threads: int | None = None  # torch threads per process (single-process and torch.multiprocessing runs)
    start_method: str | None = None  # torch.multiprocessing baselines
    partitions: int | None = None  # model-parallel partitions per replica
    evaluation: str | None = None  # "paused" / "concurrent" (strategies with a parameter server)
    durability: str | None = None

    # -- the parameters' owner: shards, or one shared vector --
    shards: int | None = None
    optimizer: str | None = None
    updates_per_shard: list[int] | None = None
    staleness_mean: float | None = None  # in updates, over every applied push (asynchronous strategies)
    staleness_max: int | None = None
    rejected_pushes: int | None = None  # non-finite gradients the shards refused
    # applied updates by staleness, in the buckets 0, 1, 2, 3, 4-7, 8-15, 16-31, 32+ (all shards together)
    staleness_histogram: list[int] | None = None

    # -- Downpour's consistency knob (docs/consistency.md) --
    consistency: str | None = None  # async, ssp or sync
    staleness_bound: int | None = None  # ssp: the bound s
    clock_gap_max: int | None = None  # ssp: the most steps any replica ran ahead of the slowest live one
    clock_waits: int | None = None  # ssp: steps a replica had to wait for before starting
    clock_wait_s: float | None = None  # ssp: replica-seconds spent waiting on the bound (latest incarnations)
    backup_replicas: int | None = None  # sync: replicas beyond ``replicas`` whose gradients may be dropped
    dropped_gradients: int | None = None  # sync: gradients that came after a step had its ``replicas``

    # -- Downpour's data plane (the replicas' latest incarnations) --
    push_fetch_calls: int | None = None
    replicas_zero_copy: int | None = None
    replicas_colocated: int | None = None
    replica_transports: dict[str, int] | None = None  # replicas per transport: colocated, shared-memory, ...

    # -- embedding tables held row-sharded on the shards (ps/slicer.py) --
    table_rows: int | None = None  # rows of all tables together
    table_parameters: int | None = None  # their floats (num_parameters includes them)
    rows_pushed: int | None = None  # rows the shards updated (each push's unique rows, per shard)
    rows_fetched: int | None = None  # rows the replicas fetched
    # (these two for every downpour and sync run)
    bytes_pushed_per_shard: list[int] | None = None  # gradient bytes read by each shard (dense + rows with ids)
    bytes_fetched_per_shard: list[int] | None = None  # parameter bytes served by each shard (rows with ids)

    # -- compressed pushes (--compress; distbelief/compression) --
    compress: str | None = None  # the scheme and its parameter, e.g. "topk (ratio 0.01)"
    compress_fetch: str | None = None  # none, fp16 or delta
    compressed_push_bytes: int | None = None  # payload bytes the replicas' pushes sent (their latest processes)
    residuals_dropped: int | None = None  # error-feedback residuals lost with a replica's process (restarts, losses)

    # -- elastic Downpour (--replicas MIN:MAX): replicas is MIN --
    max_replicas: int | None = None
    replicas_added: int | None = None  # started while the run went on (free CPUs appeared)
    replicas_removed: int | None = None  # failed with no free CPU to restart on (their node left)
    replica_first_push_s: list[float] | None = None  # each added replica: from its start to its first applied push

    # -- failures --
    replica_restarts: int | None = None
    replicas_lost: int | None = None
    replica_recovery_s: list[float] | None = None
    shard_restarts: int | None = None
    updates_lost: int | None = None
    shard_recovery_s: list[float] | None = None
    # --durability replicate: backups made anew (after a failover or a backup's own failure); pushes re-sent to a
    # shard that already had them, recognised and not applied again
    backups_replaced: int | None = None
    duplicate_pushes: int | None = None

    # -- model parallelism --
    partition_bytes_per_step: list[float] | None = None
    partition_messages_per_step: list[float] | None = None
    partition_cpu_s_per_step: list[float] | None = None  # each partition process's CPU in a step's passes

    # -- DDP --
    global_batch_size: int | None = None
    rank_param_digests: list[str | None] | None = None
    ranks_in_sync: bool | None = None

    # -- click-through rate (task ctr: the metric is the test AUC; final/best_test_accuracy hold it too) --
    best_test_auc: float | None = None
    final_test_auc: float | None = None
    test_logloss: float | None = None  # mean log-loss of the final parameters on the test set
    planted_auc: float | None = None  # the AUC of the teacher's true probabilities: the best reachable

    # -- Sandblaster L-BFGS --
    iterations: int | None = None
    iterations_redone: int | None = None
    gradient_evals: int | None = None
    line_search_evals: int | None = None
    portions_done: int | None = None
    portions_duplicated: int | None = None
    backup_tasks_issued: int | None = None
    portions_requeued: int | None = None
    final_train_loss: float | None = None
    lbfgs_batch: int | None = None
    portion_size: int | None = None
    history: int | None = None
    mean_iteration_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """What ``summary.json`` holds, in declaration order: every run's fields (``time_to_target_s`` is null
        when the target was not reached), and the others where they apply to this run."""
        return {k: v for k, v in asdict(self).items() if v is not None or k in _EVERY_RUN}


_EVERY_RUN = frozenset(f.name for f in fields(RunSummary) if f.default is MISSING and f.default_factory is MISSING)


def rate(examples: int, wall_s: float) -> float:
    """Examples per second over a run's training time (0 for a run that did not start)."""
    return examples / wall_s if wall_s > 0 else 0.0


@dataclass(frozen=True)
class Evaluation:
    """One evaluation of a run, as ``train(..., callbacks=[f])`` hands it to ``f`` (in the driver process, right
    after the line is written to ``metrics.jsonl``), whatever the strategy.

    ``values`` is the whole record (the same keys as the ``metrics.jsonl`` line, e.g. ``staleness_mean`` for
    Downpour, ``iterations`` for Sandblaster); the attributes are the ones every strategy records. Times are
    training time: evaluations that pause training are not counted.
    """

    wall_s: float
    examples: int
    examples_per_s: float
    test_accuracy: float  # or the metric the run evaluates
    test_loss: float | None
    train_loss: float | None  # the replicas' recent training loss (None before any step)
    train_accuracy: float | None  # None unless train_eval_samples is set
    values: dict[str, Any]

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> "Evaluation":
        return cls(wall_s=rec["wall_s"], examples=rec["examples"], examples_per_s=rec.get("examples_per_s", 0.0),
                   test_accuracy=rec["test_accuracy"], test_loss=rec.get("test_loss"),
                   train_loss=rec.get("train_loss"), train_accuracy=rec.get("train_accuracy"), values=dict(rec))
