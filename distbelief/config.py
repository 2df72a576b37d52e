"""The run configuration: one typed dataclass, its normalisation and its validation; TOML files and command-line
overrides map onto it (``config_from``; reading the files is ``distbelief.config_files``).

Every field is documented in ``FIELD_HELP`` (also the CLI's ``--help``). ``normalized()`` returns a copy with the
"auto" settings resolved; ``validate()`` returns that copy once every setting is checked, and raises ConfigError
naming the field before any worker starts. Neither changes the config it is called on.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

# Re-exported: the rest of the package imports the file side from here too (config_files knows no RunConfig).
from distbelief.config_files import (
    SECTIONS,
    coerce_value,
    load_toml,
    refuse_former_test_hook,
    saved_run_values,
    section_of,
    upgrade_legacy,
)
from distbelief.exceptions import ConfigError
from distbelief.ps.rules import RULES, has_torch_optimizer

__all__ = [
    "APPLIES_TO", "COMPRESSION", "CONSISTENCY_MODES", "FETCH_COMPRESSION", "DURABILITY_MODES", "EVALUATION_MODES", "FIELD_HELP",
    "LOCAL_STRATEGIES", "RANGES", "RUNTIMES", "RunConfig", "OPTIMIZERS", "SECTIONS", "STRATEGIES", "config_from",
    "ignored_by_strategy", "load_toml", "saved_run_values", "section_of",
]

STRATEGIES = ("sgd", "sync", "downpour", "sandblaster", "hogwild", "ddp")
LOCAL_STRATEGIES = ("hogwild", "ddp")  # torch.multiprocessing baselines: this machine, no parameter server
CONSISTENCY_MODES = ("async", "ssp", "sync")  # Downpour's consistency knob (docs/consistency.md)
COMPRESSION = ("none", "fp16", "topk", "qsgd", "powersgd")  # what a push sends (distbelief/compression)
FETCH_COMPRESSION = ("none", "fp16", "delta")  # what a fetch sends
# The server update rules (distbelief/ps/rules); auto: adagrad on a parameter server (downpour, sync), sgd otherwise
OPTIMIZERS = ("auto", *RULES)
DURABILITY_MODES = ("off", "snapshot", "log", "replicate")
EVALUATION_MODES = ("auto", "paused", "concurrent")
RUNTIMES = ("ray", "inprocess")


# ---------------------------------------------------------------- the values of every numeric setting
@dataclass(frozen=True)
class Range:
    """The values a numeric setting takes: from ``low`` (excluded when ``open_low``) up to ``high``."""

    low: float
    open_low: bool = False
    high: float = math.inf

    def admits(self, v: float) -> bool:
        return (v > self.low if self.open_low else v >= self.low) and v <= self.high

    def describe(self, integer: bool) -> str:
        kind = "an integer" if integer else "a number"
        low, high = (int(x) if float(x).is_integer() else x for x in (self.low, self.high))
        if self.high < math.inf:
            return f"{kind} in {'(' if self.open_low else '['}{low}, {high}]"
        return f"{kind} {'>' if self.open_low else '>='} {low}"


# Every int and float setting of RunConfig and its values, checked in one place (RunConfig._check_numbers, the
# first step of normalized()); tests/unit/test_config_validation.py fails for a numeric setting missing here. A
# setting whose default is None ("auto": its value depends on the task, model or strategy, or on the machine)
# takes None for that default; 0 or a negative value never stands for it. 0 is allowed where it has a meaning of
# its own, said next to it.
RANGES: dict[str, Range] = {
    "num_samples": Range(20),  # train + test, 20% test: fewer leaves no test set to speak of
    "num_classes": Range(2),  # speech: at most 8192 (checked with the task)
    "class_prior": Range(0),  # 0: balanced classes (a Zipf exponent)
    "ctr_max_rows": Range(1),  # at most 2^24 (checked with the task: _check_ctr)
    "replicas": Range(1),
    "max_replicas": Range(0),  # 0: a fixed replica count (not elastic)
    "shards": Range(1),
    "partitions": Range(1),
    "fetch_every": Range(1),
    "push_every": Range(1),
    "lr": Range(0, open_low=True),
    "local_lr": Range(0),  # 0: no local step between fetches (the paper's experiments)
    "adagrad_eps": Range(0, open_low=True),
    "adagrad_initial_accumulator": Range(0),  # 0: torch's Adagrad default
    "batch_size": Range(1),
    "warmstart_steps": Range(0),  # 0: no warmstart, every replica starts at once
    "staleness_bound": Range(0),  # 0: lockstep without a barrier
    "backup_replicas": Range(0),  # 0: no backup replicas
    "compress_ratio": Range(0, open_low=True, high=1),
    "compress_bits": Range(2, high=8),  # and one of 2, 4, 8 (_check_choices)
    "compress_rank": Range(1),
    "max_steps": Range(0),  # 0: no step limit (another stop condition must be set)
    "max_seconds": Range(0),  # 0: no time limit (another stop condition must be set)
    "target_accuracy": Range(0, high=1),  # 0: no target
    "target_auc": Range(0, high=1),  # 0: no target; else (0.5, 1] (checked with the task: _check_target_auc)
    "eval_every_seconds": Range(0, open_low=True),
    "eval_samples": Range(0),  # 0: the whole test set
    "train_eval_samples": Range(0),  # 0: no training accuracy
    "metrics_port": Range(0, high=65535),  # 0: no metrics server
    "seed": Range(0),  # 0 is a seed like any other; numpy's generators refuse negative ones
    "threads": Range(1),
    "max_replica_restarts": Range(0),  # 0: a dead replica is not restarted
    "remote_timeout_s": Range(0, open_low=True),
    "checkpoint_every_seconds": Range(0),  # 0: no snapshots by time
    "checkpoint_every_updates": Range(0),  # 0: no snapshots by update count
    "log_max_mb": Range(0, open_low=True),
    "max_shard_restarts": Range(0),  # 0: a dead shard is not restarted
    "lbfgs_batch": Range(1),
    "portion_size": Range(1),
    "history": Range(1),
    "push_every_portions": Range(1),
}
# The type of a numeric field (its annotation is a string: ``from __future__ import annotations``) -> whether it
# is an integer.
NUMBER_TYPES = {"int": True, "int | None": True, "float": False, "float | None": False}


@dataclass
class RunConfig:
    # what to train
    task: str = "mnist1d"
    model: str = "mlp"
    # None ("auto"): the value distbelief/defaults.py gives for the task, model and strategy (normalized())
    num_samples: int | None = None
    num_classes: int | None = None  # None: the task's (speech: the model's)
    class_prior: float = 0.0
    ctr_max_rows: int = 200_000  # ctr: cap on each categorical field's rows (data/ctr.py CTR_MAX_ROWS)
    # how
    strategy: str = "downpour"
    replicas: int = 2
    max_replicas: int = 0  # elastic Downpour (--replicas MIN:MAX): up to this many; 0 = a fixed count
    shards: int = 2
    partitions: int = 1
    fetch_every: int = 1
    push_every: int = 1
    optimizer: str = "auto"
    lr: float | None = None
    local_lr: float = 0.0
    adagrad_eps: float = 1e-10
    adagrad_initial_accumulator: float = 0.0
    batch_size: int | None = None
    warmstart_steps: int = 0
    init_params: str = ""
    overlap: bool = False
    staleness_aware: bool = False
    consistency: str = "async"
    staleness_bound: int = 3
    backup_replicas: int = 0
    # compressed pushes (distbelief/compression): none, fp16, topk, qsgd or powersgd
    compress: str = "none"
    compress_ratio: float = 0.01  # topk: the share of each shard range's values a push keeps
    compress_bits: int = 4  # qsgd: bits per value (2, 4 or 8)
    compress_rank: int = 4  # powersgd: the rank of each weight matrix's approximation
    compress_fetch: str = "none"  # what a fetch sends: none (float32), fp16 or delta (the values changed since)
    # when to stop
    max_steps: int = 0
    max_seconds: float = 60.0
    target_accuracy: float = 0.0
    target_auc: float = 0.0  # ctr: the target_accuracy of a run whose metric is the AUC
    eval_every_seconds: float = 2.0
    evaluation: str = "auto"
    eval_samples: int = 0
    train_eval_samples: int = 0
    metrics_port: int = 0
    # where and how to run
    seed: int = 0
    out: str = ""
    tensorboard: bool = False
    address: str = ""
    runtime: str = "ray"
    threads: int | None = None  # None: cores / replicas, when the run starts
    device: str = "cpu"
    max_replica_restarts: int = 3
    remote_timeout_s: float = 120.0
    streams: bool = True
    # durability of the parameter shards: off, snapshot (background snapshots) or log (snapshots + write-ahead log)
    durability: str = "snapshot"
    checkpoint_every_seconds: float = 30.0
    checkpoint_every_updates: int = 0
    log_max_mb: float = 1024.0
    max_shard_restarts: int = 5
    # Sandblaster L-BFGS (strategy = "sandblaster")
    lbfgs_batch: int | None = None
    portion_size: int | None = None
    history: int = 10
    push_every_portions: int = 4
    backup_tasks: bool = True

    @property
    def replicas_started(self) -> int:
        """Replica processes the run starts: ``replicas`` plus sync's ``backup_replicas``."""
        return self.replicas + (self.backup_replicas if self.consistency == "sync" else 0)

    # ---------------------------------------------------------------- normalisation
    def normalized(self) -> RunConfig:
        """A copy of this config with its derived settings filled in (this config is not changed):

        - None ("auto") in ``num_samples``, ``num_classes``, ``lr``, ``batch_size``, ``lbfgs_batch`` and
          ``portion_size`` becomes the value of ``distbelief.defaults`` for the task, model and strategy (so
          config.toml records what the run really used); a value the user set is kept (``num_classes`` stays None
          where the data decides it, and ``threads`` until the run starts);
        - ``optimizer = "auto"`` becomes Adagrad on a parameter server (downpour, sync: the paper's choice) and
          plain SGD otherwise (sgd, hogwild, ddp; sandblaster does not read it);
        - ``strategy = "sgd"`` is one process by definition: its ``replicas`` becomes 1 (the count is not used);
        - ``consistency = "sync"`` is the ``sync`` strategy: Downpour with it becomes ``strategy = "sync"``, and the
          sync strategy records ``consistency = "sync"``;
        - ``target_auc`` (the ctr task, whose metric is the AUC) is that task's ``target_accuracy``: it is copied
          there, where every strategy's stop rule reads it.

        Raises ConfigError for a setting these depend on that is not valid: an unknown choice (task, model,
        strategy, ...), or any numeric setting out of its range (``RANGES``: e.g. ``batch_size = 0``, which is not
        read as the default). Normalising a normalised config changes nothing.
        """
        self._check_choices()
        self._check_numbers()
        cfg, changes = self, {}
        if self.consistency == "sync" and self.strategy == "downpour":
            changes["strategy"] = "sync"
        if self.strategy == "sync" and self.consistency == "async":
            changes["consistency"] = "sync"
        if self._check_target_auc():
            changes["target_accuracy"] = self.target_auc
        if changes:
            cfg = dataclasses.replace(self, **changes)
        changes.update(cfg._resolved_defaults())
        if self.strategy == "sgd" and self.replicas != 1:
            changes["replicas"] = 1
        return dataclasses.replace(self, **changes)

    def _check_choices(self) -> None:
        from distbelief.data.tasks import TASKS
        from distbelief.models import MODELS

        def choose(name, value, options):
            if value not in options:
                raise ConfigError(name, f"unknown value {value!r}; choose one of: {', '.join(options)}")

        choose("task", self.task, TASKS)
        choose("model", self.model, MODELS)
        choose("strategy", self.strategy, STRATEGIES)
        choose("optimizer", self.optimizer, ("auto", *RULES))  # RULES, not OPTIMIZERS: rules registered later too
        choose("consistency", self.consistency, CONSISTENCY_MODES)
        choose("runtime", self.runtime, RUNTIMES)
        choose("durability", self.durability, DURABILITY_MODES)
        choose("evaluation", self.evaluation, EVALUATION_MODES)
        choose("compress", self.compress, COMPRESSION)
        choose("compress_fetch", self.compress_fetch, FETCH_COMPRESSION)
        if self.compress_bits not in (2, 4, 8):
            raise ConfigError("compress_bits", f"must be 2, 4 or 8 (bits per value, packed into bytes), got "
                                               f"{self.compress_bits!r}")

    def _check_target_auc(self) -> bool:
        """Whether ``target_auc`` is set (it is then a valid AUC, for the ctr task, not contradicting
        ``target_accuracy``)."""
        v = self.target_auc
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not (v == 0 or 0.5 < v <= 1):
            raise ConfigError("target_auc", f"is an AUC in (0.5, 1] (0.5 is a random ranking), or 0 for none; "
                                            f"got {v!r}")
        if not v:
            return False
        if self.task != "ctr":
            raise ConfigError("target_auc", f"the {self.task} task's metric is the accuracy: use target_accuracy "
                                            f"(target_auc is for task ctr)")
        if self.target_accuracy and self.target_accuracy != v:
            raise ConfigError("target_auc", f"set either target_auc ({v}) or target_accuracy "
                                            f"({self.target_accuracy}), not both: for task ctr both are the AUC")
        return True

    def _check_numbers(self) -> None:
        """Every numeric setting is a number of its type within its ``RANGES`` (None, where that is the
        setting's default, stands for the default); ConfigError naming the first that is not."""
        for f in fields(self):
            integer = NUMBER_TYPES.get(f.type)
            if integer is None:
                continue
            v, rule = getattr(self, f.name), RANGES[f.name]
            if v is None and f.default is None:
                continue
            number = isinstance(v, int) if integer else isinstance(v, (int, float)) and math.isfinite(v)
            if isinstance(v, bool) or not number or not rule.admits(v):
                unset = "; leave it out for the default" if f.default is None else ""
                raise ConfigError(f.name, f"must be {rule.describe(integer)}, got {v!r}{unset}")

    def _resolved_defaults(self) -> dict[str, Any]:
        """The settings whose good value depends on the model and strategy and that are None ("auto"), with the
        value of ``distbelief.defaults``: ``{name: value}``. A value the user set is not in it."""
        import distbelief.defaults as defaults

        out: dict[str, Any] = {}
        optimizer = self.optimizer
        if optimizer == "auto":
            optimizer = out["optimizer"] = "adagrad" if self.strategy in ("downpour", "sync") else "sgd"
        if self.num_samples is None:
            out["num_samples"] = defaults.default_num_samples(self.task)
        if self.num_classes is None:  # stays None where the data decides it (tasks other than speech)
            num_classes = defaults.default_num_classes(self.task, self.model)
            if num_classes is not None:
                out["num_classes"] = num_classes
        if self.lr is None:
            out["lr"] = defaults.recommended_lr(self.model, self.strategy, optimizer)
        if self.batch_size is None:
            out["batch_size"] = defaults.default_batch_size(self.model)
        lbfgs_batch = self.lbfgs_batch
        if lbfgs_batch is None:
            lbfgs_batch = out["lbfgs_batch"] = defaults.SANDBLASTER_BATCH
        if self.portion_size is None:
            out["portion_size"] = defaults.default_portion_size(self.strategy, lbfgs_batch)
        return out

    # ---------------------------------------------------------------- validation
    def validate(self) -> RunConfig:
        """``normalized()``, once every setting of it is checked: raises ConfigError naming the first setting that
        is wrong. This config is not changed; use the config returned (callers take the normalised settings, e.g.
        the resolved ``lr``, from it)."""
        cfg = self.normalized()
        cfg._check()
        return cfg

    def _check(self) -> None:
        """Every check of a normalised config beyond those ``normalized()`` makes (the range of each numeric
        setting alone is ``_check_numbers``, there)."""
        if self.partitions > 1:
            from distbelief.models import PARTITIONABLE

            if self.model not in PARTITIONABLE:
                raise ConfigError("partitions", f"model {self.model!r} cannot be partitioned; choose one of: "
                                                f"{', '.join(PARTITIONABLE)}, or partitions = 1")
            if self.strategy == "sync":
                raise ConfigError("partitions", "the sync strategy runs unpartitioned replicas; use downpour or sgd")
            if self.strategy in LOCAL_STRATEGIES:
                raise ConfigError("partitions", f"the {self.strategy} baseline runs unpartitioned replicas; use "
                                                f"partitions = 1")
        if self.max_steps == 0 and self.max_seconds == 0 and self.target_accuracy == 0:
            raise ConfigError("max_seconds", "no stop condition: set max_seconds, max_steps or target_accuracy")
        from distbelief.data.tasks import SHAPES

        fixed = {"mnist1d": 10, "shapes": len(SHAPES)}  # the classes of these tasks' data (ctr: _check_ctr)
        if self.task in fixed and self.num_classes not in (None, fixed[self.task]):
            raise ConfigError("num_classes", f"{self.task} has {fixed[self.task]} classes; leave num_classes out")
        if self.class_prior and self.task != "speech":
            raise ConfigError("class_prior", f"only the speech task has a class prior; task {self.task!r} "
                                             f"needs class_prior = 0")
        if self.task == "speech" and self.num_classes > 8192:
            raise ConfigError("num_classes", f"speech supports up to 8192 classes, got {self.num_classes}")
        self._check_ctr()
        self._check_sandblaster()
        self._check_optimizer()
        self._check_consistency()
        self._check_compression()
        self._check_elastic()
        self._check_device()
        if self.address and self.strategy in LOCAL_STRATEGIES:
            raise ConfigError("address", f"the {self.strategy} baseline runs its workers on this machine; drop "
                                         f"--address")
        if self.address and self.strategy == "sgd" and self.partitions == 1:
            raise ConfigError("address", "single-process sgd runs in this process; drop --address (or add "
                                         "--partitions P to spread its one replica over the cluster)")
        if self.staleness_aware and self.durability == "log" and self.strategy == "downpour":
            raise ConfigError("staleness_aware", "is not available with durability = \"log\" yet (the write-ahead "
                                                 "log does not record each push's staleness, so a replay could not "
                                                 "repeat its rate); use durability snapshot or off")
        if self.address and self.runtime != "ray":
            raise ConfigError("address", "--address needs the ray runtime (runtime = \"ray\")")
        if self.durability == "replicate" and self.strategy == "sandblaster":
            raise ConfigError("durability", "replicate keeps backups of Downpour's parameter shards (downpour and "
                                            "sync); sandblaster recovers its shards from iteration checkpoints: "
                                            "use durability snapshot or log (or off)")

    def _check_optimizer(self) -> None:
        """The sgd (one partition), hogwild and ddp strategies train with ``torch.optim``: the rule needs a
        counterpart there (partitioned sgd applies the server rule itself)."""
        torch_optim = self.strategy in LOCAL_STRATEGIES or (self.strategy == "sgd" and self.partitions == 1)
        if torch_optim and not has_torch_optimizer(self.optimizer):
            with_torch = ", ".join(n for n in RULES if has_torch_optimizer(n))
            raise ConfigError("optimizer", f"{self.optimizer} is a parameter-server rule with no torch.optim "
                                           f"counterpart; the {self.strategy} strategy trains with torch.optim: "
                                           f"choose one of {with_torch}, or strategy downpour or sync")

    def _check_ctr(self) -> None:
        """The ctr task and its model go together; its field cap keeps every id exact in float32."""
        from distbelief.data.ctr import MAX_EXACT_ID

        v = self.ctr_max_rows
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_EXACT_ID:
            raise ConfigError("ctr_max_rows", f"must be an integer in [1, 2^24 = {MAX_EXACT_ID}] (the ids travel "
                                              f"as exact integers in float32), got {v!r}")
        if self.task == "ctr" and self.model != "dlrm-small":
            raise ConfigError("model", f"task ctr (ids of 26 categorical fields) trains model dlrm-small, not "
                                       f"{self.model!r}; use model = dlrm-small")
        if self.model == "dlrm-small" and self.task != "ctr":
            raise ConfigError("model", f"dlrm-small reads click logs (13 dense features and 26 ids): it trains on "
                                       f"task ctr, not {self.task!r}; use task = ctr")
        if self.task == "ctr" and self.num_classes not in (None, 2):
            raise ConfigError("num_classes", "ctr has 2 classes (click or not; one logit); leave num_classes out")

    def _check_elastic(self) -> None:
        if not self.max_replicas:
            return
        if self.max_replicas < self.replicas:
            raise ConfigError("replicas", f"MIN:MAX needs MIN <= MAX, got {self.replicas}:{self.max_replicas}")
        if self.strategy != "downpour":
            raise ConfigError("replicas", f"MIN:MAX (elastic replicas) is for downpour; the {self.strategy} "
                                          f"strategy runs a fixed number of replicas")
        if self.partitions > 1:
            raise ConfigError("replicas", "MIN:MAX (elastic replicas) runs unpartitioned replicas; use "
                                          "partitions = 1 or a fixed replica count")

    def _check_compression(self) -> None:
        for name in ("compress", "compress_fetch"):
            if getattr(self, name) != "none" and self.partitions > 1:
                raise ConfigError(name, "partitioned replicas push and fetch uncompressed (each partition its own "
                                        "range); use none or --partitions 1")
        if self.compress_fetch == "delta" and self.local_lr:
            raise ConfigError("compress_fetch", "delta fetches update only the values the shards changed, so the "
                                                "replica's copy must be the shards' own: drop --local-lr (or "
                                                "fetch whole, none or fp16)")

    def _check_consistency(self) -> None:
        if self.consistency == "ssp" and self.strategy != "downpour":
            raise ConfigError("consistency", f"ssp bounds the staleness of Downpour's replicas; the {self.strategy} "
                                             f"strategy has none to bound (use strategy = \"downpour\")")
        if self.consistency == "sync" and self.strategy != "sync":
            raise ConfigError("consistency", f"sync is Downpour's replicas in lockstep (strategy downpour or sync); "
                                             f"the {self.strategy} strategy cannot run it")
        if self.backup_replicas and self.consistency != "sync":
            raise ConfigError("backup_replicas", "backup replicas serve synchronous steps; add consistency = "
                                                 "\"sync\"")

    def _check_device(self) -> None:
        """``device``: a known value, asked of a strategy whose replicas can compute on it, and a CUDA device this
        process has where the computing happens in this process (in-process runtime, single-process sgd)."""
        from distbelief.devices import DEVICE_STRATEGIES, check_cuda_here, device_error, wants_gpu

        problem = device_error(self.device)
        if problem:
            raise ConfigError("device", problem)
        if not wants_gpu(self.device):
            return
        if self.strategy not in DEVICE_STRATEGIES:
            raise ConfigError("device", f"the {self.strategy} strategy computes on the CPU only; use device = "
                                        f"\"cpu\" (device = \"auto\" runs it on the CPU too); for a GPU, use strategy "
                                        f"downpour, sync or sgd")
        if self.partitions > 1:
            raise ConfigError("device", "partitioned replicas compute on the CPU only; use device = \"cpu\" (device "
                                        "= \"auto\" runs them on the CPU too), or partitions = 1 for a GPU")
        if self.strategy == "sgd" or self.runtime == "inprocess":
            where = "single-process sgd" if self.strategy == "sgd" else "the inprocess runtime"
            check_cuda_here(self.device, where)
        elif self.device != "cuda":
            raise ConfigError("device", f"{self.device!r} picks a GPU of this process, but on Ray each replica "
                                        f"computes on the GPU Ray assigns it; use device = \"cuda\"")

    def _check_sandblaster(self) -> None:
        if self.strategy != "sandblaster":
            return
        if self.partitions > 1:
            raise ConfigError("partitions", "sandblaster runs unpartitioned replicas; use partitions = 1")
        if self.portion_size * self.replicas > self.lbfgs_batch:
            import warnings

            # stacklevel 4: the caller of validate() (validate -> _check -> _check_sandblaster)
            warnings.warn(f"portion_size ({self.portion_size}) x replicas ({self.replicas}) exceeds lbfgs_batch "
                          f"({self.lbfgs_batch}): portions are not much smaller than batch/replicas, so load "
                          f"balancing and backup tasks have little room; lower portion_size", stacklevel=4)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELD_HELP: dict[str, str] = {
    "task": "dataset: mnist1d (MNIST-1D, generated offline), speech (paper-shaped synthetic frames), shapes "
            "(synthetic 32x32 images of 8 shapes, for locally connected models) or ctr (Criteo-shaped synthetic "
            "click logs labelled by a planted teacher; metric AUC; docs/ctr.md)",
    "model": "model name: mlp, mlp-small, cnn, speech-tiny, speech-small, speech-medium, speech-paper, "
             "lc1d (locally connected, mnist1d), lc-image-small, lc-image-medium (locally connected, shapes), "
             "dlrm-small (DLRM with one sparse embedding table per field; task ctr)",
    "num_samples": "examples generated for the task (train + test; 20%% test) [default: 40000; ctr 1000000]",
    "num_classes": "speech only: number of classes [default: the model's: 8192 for speech-paper, the paper's "
                   "440-2560x4-8192; 256 for the other speech models; the other tasks' data decides it]",
    "class_prior": "speech only: Zipf exponent s of the class frequencies, p(k) ~ 1/(k+1)^s (0 = balanced; "
                   "real acoustic states are highly skewed)",
    "ctr_max_rows": "ctr only: cap on the rows of each of the 26 categorical fields (Criteo's cardinalities, up "
                    "to 10M, capped; at most 2^24). The default gives 1.48M rows, 23.7M parameters in dlrm-small's "
                    "tables",
    "strategy": "sgd (one process, plain torch loop), sync (synchronous data parallel), downpour (async), "
                "sandblaster (batch L-BFGS driven by a coordinator, vectors on the shards), hogwild (lock-free "
                "updates of shared-memory parameters by local processes), ddp (torch DistributedDataParallel, "
                "gloo, local processes; global batch = replicas x batch_size)",
    "replicas": "number of model replicas (data-parallel workers); downpour also takes MIN:MAX (elastic: starts "
                "with as many as the cluster's free CPUs hold, at least MIN, adds one whenever CPUs appear and "
                "removes one when its node goes, without restarting anything else)",
    "max_replicas": "elastic downpour: the most replicas (what --replicas MIN:MAX sets; 0 = a fixed count)",
    "shards": "number of parameter-server shards",
    "partitions": "model parallelism: run every replica as this many partition processes (lc1d, lc-image-*, "
                  "mlp and speech models)",
    "fetch_every": "n_fetch: fetch parameters every N steps",
    "push_every": "n_push: push the accumulated gradient every N steps",
    "optimizer": "update rule: " + "; ".join(f"{name} ({cls.summary})" for name, cls in RULES.items())
                 + "; applied by the shards for downpour and sync, by torch.optim for sgd, hogwild and ddp; auto = "
                   "adagrad for downpour and sync, sgd otherwise",
    "lr": "learning rate of the update rule (gamma for adagrad, eta for sgd), on the shards or in the sgd, "
          "hogwild and ddp workers; unused by sandblaster's L-BFGS [default: the recommended rate for the model, "
          "strategy and server optimizer, from distbelief/defaults.py: e.g. mlp 0.05 with adagrad]",
    "local_lr": "alpha: the replica's local step between fetches (0 = none, as in the paper's experiments)",
    "adagrad_eps": "epsilon added to sqrt(sum g^2) (not in the paper)",
    "adagrad_initial_accumulator": "initial value of adagrad's sum of squared gradients",
    "batch_size": "minibatch size per replica step (sandblaster's batch is lbfgs_batch) [default: 32, 256 "
                  "for dlrm-small]",
    "lbfgs_batch": "sandblaster: examples per L-BFGS iteration (the batch of its gradient; >= the training set = "
                   "full batch) [default: 8000]",
    "warmstart_steps": "steps one replica trains alone before the others join",
    "init_params": "start every model from these parameters: a params.safetensors file or the run directory "
                   "holding one (e.g. a short single-process run: the paper's shared warmstart for Fig. 4)",
    "staleness_aware": "scale each push's step by 1/staleness (the updates the shard applied since the replica "
                       "fetched; Zhang et al., IJCAI 2016), so stale gradients move the parameters less",
    "consistency": "downpour: async (the paper's: no replica waits for another), ssp (stale-synchronous: no "
                   "replica runs more than staleness_bound steps ahead of the slowest live one) or sync (lockstep: "
                   "each step applies the mean of the replicas' gradients; the same as strategy sync)",
    "staleness_bound": "consistency ssp: how many steps a replica may run ahead of the slowest live replica "
                       "(0 = lockstep without a barrier)",
    "backup_replicas": "consistency sync: start this many replicas beyond --replicas; each step applies the mean "
                       "of the first --replicas gradients and drops the rest (stragglers do not hold a step up)",
    "compress": "what each push sends the shards: none (float32), fp16 (2 bytes a value), topk (the largest "
                "compress_ratio of each shard's values, with their positions), qsgd (QSGD: compress_bits bits a "
                "value, randomly rounded, unbiased) or powersgd (PowerSGD: each weight matrix as a rank "
                "compress_rank product); with error feedback (what a push leaves out is added to the next). For "
                "links slower than the replicas: on one machine it only costs (docs/compression.md)",
    "compress_ratio": "compress topk: the share of each shard range's values a push keeps, in (0, 1]",
    "compress_bits": "compress qsgd: bits per value (2, 4 or 8)",
    "compress_rank": "compress powersgd: the rank of each weight matrix's approximation",
    "compress_fetch": "what a fetch sends the replicas: none (float32), fp16 (half the bytes; the replicas "
                      "compute on parameters rounded to float16, the shards keep float32) or delta (only the "
                      "values changed since the replica's last fetch, with their positions, when that is smaller: "
                      "with topk pushes most values do not change between two fetches; exact)",
    "overlap": "prefetch the next parameters while computing (one step staler; measured slower than the default "
               "fused push-fetch loop on one machine, see benchmarks/RESULTS.md)",
    "max_steps": "stop after this many steps per replica (sandblaster: L-BFGS iterations) (0 = no limit)",
    "max_seconds": "stop after this many seconds of training (0 = no limit)",
    "target_accuracy": "stop when test accuracy reaches this fraction (0 = never)",
    "target_auc": "ctr: stop when the test AUC reaches this value, in (0.5, 1] (0 = never); compare with the "
                  "run's planted_auc, the best reachable",
    "eval_every_seconds": "evaluate the server's parameters on the test set every T seconds",
    "evaluation": "how Downpour evaluates without slowing training: paused (the replicas hold at a step boundary "
                  "and the training clock stops while the driver evaluates the server's parameters), concurrent "
                  "(the driver evaluates on a core of its own while the replicas train) or auto (concurrent when "
                  "the replicas leave the driver's machine a free core, else paused). Every strategy's time axis "
                  "is training time",
    "eval_samples": "evaluate on the first N test examples only (0 = the whole test set); keeps evaluation cheap "
                    "next to training for large test sets",
    "train_eval_samples": "also measure training accuracy, on a fixed random sample of N training examples, at "
                          "every evaluation (0 = off)",
    "metrics_port": "serve the run's metrics for Prometheus at http://HOST:PORT/metrics from the driver "
                    "(examples/s, accuracy, loss, staleness, per-shard update rate, bytes; updated at every "
                    "evaluation) (0 = off)",
    "seed": "random seed (model init, data order, data generation)",
    "out": "run directory (default runs/<timestamp>)",
    "tensorboard": "also write the run's scalars (loss, accuracy, examples/s, per-shard update rate, staleness, "
                   "bytes pushed/fetched) to RUN_DIR/tensorboard/ for TensorBoard",
    "address": "HOST:PORT of an existing Ray cluster (default: start a local Ray)",
    "runtime": "ray (one process per role) or inprocess (threads; for tests and debugging)",
    "threads": "torch threads per worker process [default: cores / replicas]",
    "device": "where replicas compute: cpu, cuda (on Ray: one GPU per replica, refused when the cluster has too "
              "few), cuda:N (this process's GPU N: inprocess runtime or sgd) or auto (cuda where the replica's "
              "process has a GPU, else cpu); downpour, sync and sgd only. Shards, evaluation and checkpoints "
              "stay on the CPU; the CUDA path is not run by the test suite (docs/api.md, Devices)",
    "max_replica_restarts": "how many times a dead replica is restarted before the run goes on without it",
    "remote_timeout_s": "how long any remote call may take before the run fails with a timeout",
    "streams": "across nodes, move a replica's uncompressed pushes and fetches on a gloo stream (torch.distributed) "
               "per shard instead of Ray's object store, which filled under half of a link in Downpour's pattern "
               "(docs/cluster.md); --no-streams: the object store",
    "durability": "how a dead parameter shard gets its state back: off (the run fails), snapshot (each shard "
                  "saves its slice and optimizer state in the background every checkpoint_every_seconds; a "
                  "restarted shard loses the updates since its last snapshot, counted in updates_lost), log "
                  "(snapshots plus a write-ahead log of every applied push: nothing acknowledged is lost, at a "
                  "disk and throughput cost) or replicate (each shard has a backup in another process, on another "
                  "node where there is one, that applies every push before it is acknowledged; a dead shard's "
                  "backup takes over at once and loses nothing; no disk, but no checkpoints to resume from; "
                  "downpour and sync)",
    "checkpoint_every_seconds": "durability snapshot/log: each shard snapshots its slice and optimizer state this "
                                "often (0 = not by time)",
    "checkpoint_every_updates": "durability snapshot/log: each shard also snapshots after this many updates (0 = "
                                "not by count)",
    "log_max_mb": "durability log: a shard whose write-ahead log grows past this many MB takes a snapshot, which "
                  "starts a new log (bounds the disk use: at most about 2x this per shard)",
    "max_shard_restarts": "how many times a dead parameter shard is restarted from its checkpoint (or, with "
                          "durability replicate, replaced by its backup)",
    "portion_size": "sandblaster: examples per portion, the unit of work handed to a free replica (keep it much "
                    "smaller than lbfgs_batch / replicas) [default: lbfgs_batch / 16]",
    "history": "sandblaster: L-BFGS memory m, the number of (s, y) pairs kept on the shards",
    "push_every_portions": "sandblaster: a replica sends its accumulated gradient after this many portions",
    "backup_tasks": "sandblaster: near the end of a batch, also give running portions to idle replicas "
                    "(first result wins)",
}


def config_from(values: dict[str, Any], base: RunConfig | None = None) -> RunConfig:
    """A config from ``base`` (defaults if None) with ``values`` applied; unknown keys are errors. Settings that
    older run directories wrote are upgraded first (``config_files.upgrade_legacy``); ``values`` is not changed."""
    known = {f.name: f for f in fields(RunConfig)}
    values = upgrade_legacy(dict(values))
    applied: dict[str, Any] = {}
    for key, raw in values.items():
        name = key.replace("-", "_")
        refuse_former_test_hook(name)
        if name not in known:
            close = [k for k in known if k.startswith(name[:4])]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(name, f"unknown setting{hint}")
        if name == "replicas" and isinstance(raw, str) and ":" in raw:  # MIN:MAX, elastic Downpour
            low, _, high = raw.partition(":")
            applied["max_replicas"] = coerce_value("replicas", "int", high.strip())
            raw = low.strip()
        applied[name] = coerce_value(name, known[name].type, raw)
    return dataclasses.replace(base if base is not None else RunConfig(), **applied)


# ---------------------------------------------------------------- which strategies read which settings
# Settings that only some strategies read (the others would silently ignore them).
_DOWNPOUR_ONLY = ("fetch_every", "push_every", "local_lr", "overlap", "warmstart_steps", "staleness_aware",
                  "staleness_bound")
_COMPRESSION = ("compress", "compress_ratio", "compress_bits", "compress_rank", "compress_fetch")
_WITH_SERVER = ("downpour", "sync", "sandblaster")  # strategies with parameter shards
APPLIES_TO: dict[str, tuple[str, ...]] = {
    **{name: ("downpour",) for name in _DOWNPOUR_ONLY},
    **{name: ("sandblaster",) for name in SECTIONS["sandblaster"]},
    "consistency": ("downpour", "sync"),
    "backup_replicas": ("sync",),
    **{name: ("downpour", "sync") for name in _COMPRESSION},
    "device": ("sgd", "sync", "downpour"),
    **{name: _WITH_SERVER for name in SECTIONS["durability"]},
    # sandblaster's shards checkpoint their vectors after every iteration: no snapshot cadence, no write-ahead log
    **{name: ("downpour", "sync") for name in ("checkpoint_every_seconds", "checkpoint_every_updates",
                                                 "log_max_mb")},
    # the trainers that restart a dead replica; sgd, hogwild and ddp restart none (hogwild goes on without it)
    "max_replica_restarts": ("downpour", "sync", "sandblaster"),
    **{name: ("sgd", "sync", "downpour", "hogwild", "ddp")
       for name in ("optimizer", "lr", "adagrad_eps", "adagrad_initial_accumulator", "batch_size")},
}


def ignored_by_strategy(names, strategy: str) -> list[str]:
    """Of the settings ``names`` (those a user set), the ones ``strategy`` does not read."""
    return [n for n in names if n in APPLIES_TO and strategy not in APPLIES_TO[n]]
