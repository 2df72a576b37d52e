"""The run configuration: one typed, validated dataclass; TOML files and command-line overrides map onto it.

Every field is documented in ``FIELD_HELP`` (also the CLI's ``--help``). ``validate()`` raises ConfigError
naming the field before any worker starts.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from distbelief.exceptions import ConfigError

STRATEGIES = ("sgd", "sync", "downpour", "sandblaster", "hogwild", "ddp")
LOCAL_STRATEGIES = ("hogwild", "ddp")  # torch.multiprocessing baselines: this machine, no parameter server
SERVER_OPTIMIZERS = ("sgd", "adagrad")
RUNTIMES = ("ray", "inprocess")


@dataclass
class RunConfig:
    # what to train
    task: str = "mnist1d"
    model: str = "mlp"
    num_samples: int = 40000
    num_classes: int = 0
    class_prior: float = 0.0
    # how
    strategy: str = "downpour"
    replicas: int = 2
    shards: int = 2
    partitions: int = 1
    fetch_every: int = 1
    push_every: int = 1
    server_optimizer: str = "adagrad"
    lr: float = 0.05
    local_lr: float = 0.0
    adagrad_eps: float = 1e-10
    adagrad_initial_accumulator: float = 0.0
    batch_size: int = 32
    warmstart_steps: int = 0
    init_params: str = ""
    overlap: bool = True
    # when to stop
    max_steps: int = 0
    max_seconds: float = 60.0
    target_accuracy: float = 0.0
    eval_every_seconds: float = 2.0
    eval_samples: int = 0
    train_eval_samples: int = 0
    # where and how to run
    seed: int = 0
    out: str = ""
    tensorboard: bool = False
    address: str = ""
    runtime: str = "ray"
    threads: int = 0
    max_replica_restarts: int = 3
    remote_timeout_s: float = 120.0
    # durability: shard checkpoints and write-ahead log
    checkpoint_every_seconds: float = 30.0
    checkpoint_every_updates: int = 0
    wal: bool = True
    max_shard_restarts: int = 5
    # fault injection (testing and demos): kill a replica / a shard this many seconds into training
    kill_replica_after_s: float = 0.0
    kill_replica_id: int = 0
    kill_partition_id: int = -1
    kill_shard_after_s: float = 0.0
    kill_shard_id: int = 0
    # Sandblaster L-BFGS (strategy = "sandblaster"; batch_size is then the examples per L-BFGS iteration)
    portion_size: int = 64
    history: int = 10
    push_every_portions: int = 4
    backup_tasks: bool = True
    # straggler emulation (benchmarks and tests): every portion takes at least portion_delay_s, and replica
    # straggler_id takes straggler_slowdown times as long
    portion_delay_s: float = 0.0
    straggler_id: int = -1
    straggler_slowdown: float = 1.0

    def validate(self) -> "RunConfig":
        from distbelief.data.tasks import TASKS
        from distbelief.models import MODELS

        def choose(name, value, options):
            if value not in options:
                raise ConfigError(name, f"unknown value {value!r}; choose one of: {', '.join(options)}")

        def positive(name, minimum=1):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < minimum or not math.isfinite(v):
                raise ConfigError(name, f"must be >= {minimum}, got {v!r}")

        choose("task", self.task, TASKS)
        choose("model", self.model, MODELS)
        choose("strategy", self.strategy, STRATEGIES)
        choose("server_optimizer", self.server_optimizer, SERVER_OPTIMIZERS)
        choose("runtime", self.runtime, RUNTIMES)
        for name in ("replicas", "shards", "fetch_every", "push_every", "batch_size", "partitions"):
            positive(name)
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
        positive("num_samples", 20)
        for name in ("warmstart_steps", "max_steps", "threads", "max_replica_restarts", "num_classes",
                     "eval_samples", "train_eval_samples"):
            positive(name, 0)
        for name in ("checkpoint_every_updates", "max_shard_restarts", "kill_shard_id"):
            positive(name, 0)
        for name in ("max_seconds", "target_accuracy", "local_lr", "adagrad_initial_accumulator",
                     "kill_replica_after_s", "kill_shard_after_s", "checkpoint_every_seconds"):
            positive(name, 0)
        for name in ("lr", "eval_every_seconds", "remote_timeout_s", "adagrad_eps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(name, f"must be > 0, got {v!r}")
        if self.target_accuracy > 1:
            raise ConfigError("target_accuracy", f"is a fraction in [0, 1], got {self.target_accuracy}")
        if self.max_steps == 0 and self.max_seconds == 0 and self.target_accuracy == 0:
            raise ConfigError("max_seconds", "no stop condition: set max_seconds, max_steps or target_accuracy")
        if self.task == "mnist1d" and self.num_classes not in (0, 10):
            raise ConfigError("num_classes", "mnist1d has 10 classes; leave num_classes at 0")
        if not (math.isfinite(self.class_prior) and self.class_prior >= 0):
            raise ConfigError("class_prior", f"must be >= 0 (a Zipf exponent), got {self.class_prior!r}")
        if self.class_prior and self.task != "speech":
            raise ConfigError("class_prior", f"only the speech task has a class prior; task {self.task!r} "
                                             f"needs class_prior = 0")
        if self.task == "speech" and not 0 <= self.num_classes <= 8192:
            raise ConfigError("num_classes", f"speech supports up to 8192 classes, got {self.num_classes}")
        if self.strategy == "sgd" and self.replicas != 1:
            # sgd is one process by definition; the replica count is not used.
            self.replicas = 1
        if self.kill_replica_after_s and not 0 <= self.kill_replica_id < self.replicas:
            raise ConfigError("kill_replica_id", f"must name a replica in [0, {self.replicas}), got "
                                                 f"{self.kill_replica_id}")
        if self.kill_partition_id != -1:
            if self.partitions == 1 or not 0 <= self.kill_partition_id < self.partitions:
                raise ConfigError("kill_partition_id", f"must name a partition in [0, {self.partitions}) of a "
                                                       f"partitioned replica (partitions > 1), or be -1 (the whole "
                                                       f"replica), got {self.kill_partition_id!r}")
            if not self.kill_replica_after_s:
                import warnings

                warnings.warn("kill_partition_id has no effect without kill_replica_after_s", stacklevel=2)
        if self.kill_shard_after_s and not 0 <= self.kill_shard_id < self.shards:
            raise ConfigError("kill_shard_id", f"must name a shard in [0, {self.shards}), got {self.kill_shard_id}")
        self._validate_sandblaster()
        if self.address and self.strategy in LOCAL_STRATEGIES:
            raise ConfigError("address", f"the {self.strategy} baseline runs its workers on this machine; drop "
                                         f"--address")
        if self.address and self.runtime != "ray":
            raise ConfigError("address", "--address needs the ray runtime (runtime = \"ray\")")
        return self

    def _validate_sandblaster(self) -> None:
        for name in ("portion_size", "history", "push_every_portions"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(name, f"must be an integer >= 1, got {v!r}")
        if not (math.isfinite(self.portion_delay_s) and self.portion_delay_s >= 0):
            raise ConfigError("portion_delay_s", f"must be >= 0, got {self.portion_delay_s!r}")
        if not (math.isfinite(self.straggler_slowdown) and self.straggler_slowdown >= 1):
            raise ConfigError("straggler_slowdown", f"must be >= 1 (a factor), got {self.straggler_slowdown!r}")
        if not -1 <= self.straggler_id < self.replicas:
            raise ConfigError("straggler_id", f"must name a replica in [0, {self.replicas}) or be -1 (none), got "
                                              f"{self.straggler_id}")
        if self.strategy != "sandblaster":
            return
        if self.partitions > 1:
            raise ConfigError("partitions", "sandblaster runs unpartitioned replicas; use partitions = 1")
        if self.portion_size * self.replicas > self.batch_size:
            import warnings

            warnings.warn(f"portion_size ({self.portion_size}) x replicas ({self.replicas}) exceeds batch_size "
                          f"({self.batch_size}): portions are not much smaller than batch/replicas, so load "
                          f"balancing and backup tasks have little room; lower portion_size", stacklevel=3)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELD_HELP: dict[str, str] = {
    "task": "dataset: mnist1d (MNIST-1D, generated offline), speech (paper-shaped synthetic frames) or shapes "
            "(synthetic 32x32 images of 8 shapes, for locally connected models)",
    "model": "model name: mlp, mlp-small, cnn, speech-tiny, speech-small, speech-medium, speech-paper, "
             "lc1d (locally connected, mnist1d), lc-image-small, lc-image-medium (locally connected, shapes)",
    "num_samples": "examples generated for the task (train + test; 20%% test)",
    "num_classes": "speech only: number of classes (0 = 256; the paper used 8192)",
    "class_prior": "speech only: Zipf exponent s of the class frequencies, p(k) ~ 1/(k+1)^s (0 = balanced; "
                   "real acoustic states are highly skewed)",
    "strategy": "sgd (one process, plain torch loop), sync (synchronous data parallel), downpour (async), "
                "sandblaster (batch L-BFGS driven by a coordinator, vectors on the shards), hogwild (lock-free "
                "updates of shared-memory parameters by local processes), ddp (torch DistributedDataParallel, "
                "gloo, local processes; global batch = replicas x batch_size)",
    "replicas": "number of model replicas (data-parallel workers)",
    "shards": "number of parameter-server shards",
    "partitions": "model parallelism: run every replica as this many partition processes (lc1d, lc-image-*, "
                  "mlp and speech models)",
    "fetch_every": "n_fetch: fetch parameters every N steps",
    "push_every": "n_push: push the accumulated gradient every N steps",
    "server_optimizer": "update rule on the shards: sgd (fixed rate) or adagrad (the paper's)",
    "lr": "server learning rate (gamma for adagrad, eta for sgd); also the rate of --strategy sgd",
    "local_lr": "alpha: the replica's local step between fetches (0 = none, as in the paper's experiments)",
    "adagrad_eps": "epsilon added to sqrt(sum g^2) (not in the paper)",
    "adagrad_initial_accumulator": "initial value of adagrad's sum of squared gradients",
    "batch_size": "minibatch size per replica step (sandblaster: examples per L-BFGS iteration; >= the training "
                  "set = full batch)",
    "warmstart_steps": "steps one replica trains alone before the others join",
    "init_params": "start every model from these parameters: a params.safetensors file or the run directory "
                   "holding one (e.g. a short single-process run: the paper's shared warmstart for Fig. 4)",
    "overlap": "prefetch the next parameters while computing (one step staler, faster)",
    "max_steps": "stop after this many steps per replica (sandblaster: L-BFGS iterations) (0 = no limit)",
    "max_seconds": "stop after this many seconds of training (0 = no limit)",
    "target_accuracy": "stop when test accuracy reaches this fraction (0 = never)",
    "eval_every_seconds": "evaluate the server's parameters on the test set every T seconds",
    "eval_samples": "evaluate on the first N test examples only (0 = the whole test set); keeps evaluation cheap "
                    "next to training for large test sets",
    "train_eval_samples": "also measure training accuracy, on a fixed random sample of N training examples, at "
                          "every evaluation (0 = off)",
    "seed": "random seed (model init, data order, data generation)",
    "out": "run directory (default runs/<timestamp>)",
    "tensorboard": "also write the run's scalars (loss, accuracy, examples/s, per-shard update rate, staleness, "
                   "bytes pushed/fetched) to RUN_DIR/tensorboard/ for TensorBoard",
    "address": "HOST:PORT of an existing Ray cluster (default: start a local Ray)",
    "runtime": "ray (one process per role) or inprocess (threads; for tests and debugging)",
    "threads": "torch threads per worker process (0 = cores / replicas)",
    "max_replica_restarts": "how many times a dead replica is restarted before the run goes on without it",
    "remote_timeout_s": "how long any remote call may take before the run fails with a timeout",
    "checkpoint_every_seconds": "each shard checkpoints its slice and optimizer state this often (0 = never)",
    "checkpoint_every_updates": "each shard also checkpoints after this many updates (0 = not by count)",
    "wal": "shards log applied pushes between checkpoints, so a restarted shard loses no update",
    "max_shard_restarts": "how many times a dead parameter shard is restarted from its checkpoint",
    "kill_replica_after_s": "fault injection: kill a replica this many seconds into training (0 = never)",
    "kill_replica_id": "fault injection: which replica to kill",
    "kill_partition_id": "fault injection: kill only this partition of replica kill_replica_id (its process on "
                         "ray); the replica's whole partition group is then restarted (-1 = kill the whole replica)",
    "kill_shard_after_s": "fault injection: kill a parameter shard this many seconds into training (0 = never)",
    "kill_shard_id": "fault injection: which shard to kill",
    "portion_size": "sandblaster: examples per portion, the unit of work handed to a free replica (keep it much "
                    "smaller than batch_size / replicas)",
    "history": "sandblaster: L-BFGS memory m, the number of (s, y) pairs kept on the shards",
    "push_every_portions": "sandblaster: a replica sends its accumulated gradient after this many portions",
    "backup_tasks": "sandblaster: near the end of a batch, also give running portions to idle replicas "
                    "(first result wins)",
    "portion_delay_s": "straggler emulation: every portion takes at least this long (benchmarks)",
    "straggler_id": "straggler emulation: the replica that is slowed down (-1 = none)",
    "straggler_slowdown": "straggler emulation: the straggler takes this many times as long per portion",
}


def _coerce(name: str, typ, raw: Any) -> Any:
    try:
        if typ in (bool, "bool"):
            if isinstance(raw, bool):
                return raw
            s = str(raw).lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if typ in (int, "int"):
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError(raw)
            if isinstance(raw, bool):
                raise ValueError(raw)
            return int(raw)
        if typ in (float, "float"):
            if isinstance(raw, bool):
                raise ValueError(raw)
            return float(raw)
        return str(raw)
    except (TypeError, ValueError):
        tname = getattr(typ, "__name__", typ)
        raise ConfigError(name, f"expected {tname}, got {raw!r}") from None


def config_from(values: dict[str, Any], base: RunConfig | None = None) -> RunConfig:
    """A config from ``base`` (defaults if None) with ``values`` applied; unknown keys are errors."""
    known = {f.name: f for f in fields(RunConfig)}
    cfg = dataclasses.replace(base) if base is not None else RunConfig()
    for key, raw in values.items():
        name = key.replace("-", "_")
        if name not in known:
            close = [k for k in known if k.startswith(name[:4])]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(name, f"unknown setting{hint}")
        setattr(cfg, name, _coerce(name, known[name].type, raw))
    return cfg


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config; tables (e.g. ``[downpour]``) are flattened into the one namespace."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("config", f"no such file: {p}")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("config", f"{p} is not valid TOML: {e}") from None
    flat: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            flat.update(v)
        else:
            flat[k] = v
    return flat
