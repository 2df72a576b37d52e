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
DURABILITY_MODES = ("off", "snapshot", "log")
EVALUATION_MODES = ("auto", "paused", "concurrent")
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
    lr: float = 0.0
    local_lr: float = 0.0
    adagrad_eps: float = 1e-10
    adagrad_initial_accumulator: float = 0.0
    batch_size: int = 0
    warmstart_steps: int = 0
    init_params: str = ""
    overlap: bool = False
    # when to stop
    max_steps: int = 0
    max_seconds: float = 60.0
    target_accuracy: float = 0.0
    eval_every_seconds: float = 2.0
    evaluation: str = "auto"
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
    # durability of the parameter shards: off, snapshot (background snapshots) or log (snapshots + write-ahead log)
    durability: str = "snapshot"
    checkpoint_every_seconds: float = 30.0
    checkpoint_every_updates: int = 0
    log_max_mb: float = 1024.0
    max_shard_restarts: int = 5
    # Sandblaster L-BFGS (strategy = "sandblaster"; batch_size is then the examples per L-BFGS iteration)
    portion_size: int = 0
    history: int = 10
    push_every_portions: int = 4
    backup_tasks: bool = True

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
        choose("durability", self.durability, DURABILITY_MODES)
        choose("evaluation", self.evaluation, EVALUATION_MODES)
        self._resolve_defaults()
        for name in ("replicas", "shards", "fetch_every", "push_every", "partitions"):
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
        for name in ("checkpoint_every_updates", "max_shard_restarts"):
            positive(name, 0)
        for name in ("max_seconds", "target_accuracy", "local_lr", "adagrad_initial_accumulator",
                     "checkpoint_every_seconds"):
            positive(name, 0)
        if not (isinstance(self.log_max_mb, (int, float)) and math.isfinite(self.log_max_mb)
                and self.log_max_mb > 0):
            raise ConfigError("log_max_mb", f"must be > 0 (megabytes of write-ahead log per shard), got "
                                            f"{self.log_max_mb!r}")
        for name in ("eval_every_seconds", "remote_timeout_s", "adagrad_eps"):
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
        self._validate_sandblaster()
        if self.address and self.strategy in LOCAL_STRATEGIES:
            raise ConfigError("address", f"the {self.strategy} baseline runs its workers on this machine; drop "
                                         f"--address")
        if self.address and self.strategy == "sgd" and self.partitions == 1:
            raise ConfigError("address", "single-process sgd runs in this process; drop --address (or add "
                                         "--partitions P to spread its one replica over the cluster)")
        if self.address and self.runtime != "ray":
            raise ConfigError("address", "--address needs the ray runtime (runtime = \"ray\")")
        return self

    def _resolve_defaults(self) -> None:
        """Settings whose good value depends on the model and strategy: 0 means "auto" and is replaced here by
        the value of ``distbelief.defaults`` (so config.toml records what the run really used). A value the user
        set is kept. Called again on a validated config, it changes nothing."""
        import distbelief.defaults as defaults

        for name in ("num_classes", "batch_size", "portion_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(name, f"must be an integer >= 0 (0 = the default for the model and strategy), "
                                        f"got {v!r}")
        if not (isinstance(self.lr, (int, float)) and not isinstance(self.lr, bool) and math.isfinite(self.lr)
                and self.lr >= 0):
            raise ConfigError("lr", f"must be > 0, or 0 for the recommended rate of the model, strategy and "
                                    f"server optimizer; got {self.lr!r}")
        if self.num_classes == 0:
            self.num_classes = defaults.default_num_classes(self.task, self.model)
        if self.lr == 0:
            self.lr = defaults.recommended_lr(self.model, self.strategy, self.server_optimizer)
        if self.batch_size == 0:
            self.batch_size = defaults.default_batch_size(self.strategy)
        if self.portion_size == 0:
            self.portion_size = defaults.default_portion_size(self.strategy, self.batch_size)

    def _validate_sandblaster(self) -> None:
        for name in ("portion_size", "history", "push_every_portions"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(name, f"must be an integer >= 1, got {v!r}")
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
    "num_classes": "speech only: number of classes (0 = the model's: 8192 for speech-paper, the paper's "
                   "440-2560x4-8192; 256 for the other speech models)",
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
    "lr": "learning rate of the update rule (gamma for adagrad, eta for sgd), on the shards or in the sgd, "
          "hogwild and ddp workers (0 = the recommended rate for the model, strategy and server optimizer, "
          "from distbelief/defaults.py: e.g. mlp 0.05 with adagrad; unused by sandblaster's L-BFGS)",
    "local_lr": "alpha: the replica's local step between fetches (0 = none, as in the paper's experiments)",
    "adagrad_eps": "epsilon added to sqrt(sum g^2) (not in the paper)",
    "adagrad_initial_accumulator": "initial value of adagrad's sum of squared gradients",
    "batch_size": "minibatch size per replica step (sandblaster: examples per L-BFGS iteration; >= the training "
                  "set = full batch) (0 = 32, or 8000 for sandblaster)",
    "warmstart_steps": "steps one replica trains alone before the others join",
    "init_params": "start every model from these parameters: a params.safetensors file or the run directory "
                   "holding one (e.g. a short single-process run: the paper's shared warmstart for Fig. 4)",
    "overlap": "prefetch the next parameters while computing (one step staler; measured slower than the default "
               "fused push-fetch loop on one machine, see benchmarks/RESULTS.md)",
    "max_steps": "stop after this many steps per replica (sandblaster: L-BFGS iterations) (0 = no limit)",
    "max_seconds": "stop after this many seconds of training (0 = no limit)",
    "target_accuracy": "stop when test accuracy reaches this fraction (0 = never)",
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
    "seed": "random seed (model init, data order, data generation)",
    "out": "run directory (default runs/<timestamp>)",
    "tensorboard": "also write the run's scalars (loss, accuracy, examples/s, per-shard update rate, staleness, "
                   "bytes pushed/fetched) to RUN_DIR/tensorboard/ for TensorBoard",
    "address": "HOST:PORT of an existing Ray cluster (default: start a local Ray)",
    "runtime": "ray (one process per role) or inprocess (threads; for tests and debugging)",
    "threads": "torch threads per worker process (0 = cores / replicas)",
    "max_replica_restarts": "how many times a dead replica is restarted before the run goes on without it",
    "remote_timeout_s": "how long any remote call may take before the run fails with a timeout",
    "durability": "how a dead parameter shard gets its state back: off (the run fails), snapshot (each shard "
                  "saves its slice and optimizer state in the background every checkpoint_every_seconds; a "
                  "restarted shard loses the updates since its last snapshot, counted in updates_lost) or log "
                  "(snapshots plus a write-ahead log of every applied push: nothing acknowledged is lost, at a "
                  "disk and throughput cost)",
    "checkpoint_every_seconds": "durability snapshot/log: each shard snapshots its slice and optimizer state this "
                                "often (0 = not by time)",
    "checkpoint_every_updates": "durability snapshot/log: each shard also snapshots after this many updates (0 = "
                                "not by count)",
    "log_max_mb": "durability log: a shard whose write-ahead log grows past this many MB takes a snapshot, which "
                  "starts a new log (bounds the disk use: at most about 2x this per shard)",
    "max_shard_restarts": "how many times a dead parameter shard is restarted from its checkpoint",
    "portion_size": "sandblaster: examples per portion, the unit of work handed to a free replica (keep it much "
                    "smaller than batch_size / replicas) (0 = batch_size / 16)",
    "history": "sandblaster: L-BFGS memory m, the number of (s, y) pairs kept on the shards",
    "push_every_portions": "sandblaster: a replica sends its accumulated gradient after this many portions",
    "backup_tasks": "sandblaster: near the end of a batch, also give running portions to idle replicas "
                    "(first result wins)",
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


LEGACY = {"wal": "durability"}
# Fault injection and straggler emulation were settings once; they are test tooling now (distbelief.testing).
# A run directory written then still resumes (saved_run_values drops them: a fault never fires again on resume);
# anywhere else they are refused with a message saying where they went.
FORMER_TEST_HOOKS = ("kill_replica_at_step", "kill_replica_id", "kill_partition_id", "kill_shard_at_step",
                     "kill_shard_id", "kill_replica_after_s", "kill_shard_after_s", "portion_delay_s",
                     "straggler_id", "straggler_slowdown")


def _upgrade_legacy(values: dict[str, Any]) -> dict[str, Any]:
    """Settings of runs written before ``durability`` replaced ``wal`` (their config.toml must still resume):
    ``wal = true`` is ``durability = "log"``; ``wal = false`` is ``"snapshot"``, or ``"off"`` when checkpoints
    were off too."""
    if "wal" in values:
        wal = str(values.pop("wal")).lower() in ("1", "true", "yes", "on")
        if "durability" not in values:
            ckpt = values.get("checkpoint_every_seconds", 30.0) or values.get("checkpoint_every_updates", 0)
            values["durability"] = "log" if wal else ("snapshot" if ckpt else "off")
    return values


def saved_run_values(values: dict[str, Any]) -> dict[str, Any]:
    """The settings of a run directory's config.toml, as a resume reads them (FORMER_TEST_HOOKS dropped)."""
    return {k: v for k, v in values.items() if k not in FORMER_TEST_HOOKS}


def config_from(values: dict[str, Any], base: RunConfig | None = None) -> RunConfig:
    """A config from ``base`` (defaults if None) with ``values`` applied; unknown keys are errors."""
    known = {f.name: f for f in fields(RunConfig)}
    cfg = dataclasses.replace(base) if base is not None else RunConfig()
    values = _upgrade_legacy(dict(values))
    for key, raw in values.items():
        name = key.replace("-", "_")
        if name in FORMER_TEST_HOOKS:
            raise ConfigError(name, "fault injection is test tooling, not a run setting: pass "
                                    "distbelief.testing.Faults(...) to train(..., faults=...)")
        if name not in known:
            close = [k for k in known if k.startswith(name[:4])]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(name, f"unknown setting{hint}")
        setattr(cfg, name, _coerce(name, known[name].type, raw))
    return cfg


# The sections of a TOML config and the settings each holds. A file may also name any setting at its top level
# (a run directory's config.toml does); in a section, a setting must be one of that section's.
SECTIONS: dict[str, tuple[str, ...]] = {
    "task": ("task", "model", "num_samples", "num_classes", "class_prior"),
    "run": ("strategy", "replicas", "shards", "partitions", "batch_size", "lr", "seed", "out", "tensorboard",
            "runtime", "threads", "init_params"),
    "stop": ("max_steps", "max_seconds", "target_accuracy"),
    "downpour": ("fetch_every", "push_every", "server_optimizer", "local_lr", "adagrad_eps",
                 "adagrad_initial_accumulator", "overlap", "warmstart_steps", "max_replica_restarts"),
    "sandblaster": ("portion_size", "history", "push_every_portions", "backup_tasks"),
    "eval": ("eval_every_seconds", "evaluation", "eval_samples", "train_eval_samples"),
    "durability": ("durability", "checkpoint_every_seconds", "checkpoint_every_updates", "log_max_mb",
                   "max_shard_restarts"),
    "cluster": ("address", "remote_timeout_s"),
}


def section_of(name: str) -> str | None:
    return next((sec for sec, names in SECTIONS.items() if name in names), None)


# Settings that only some strategies read (the others would silently ignore them).
_DOWNPOUR_ONLY = ("fetch_every", "push_every", "local_lr", "overlap", "warmstart_steps")
_WITH_SERVER = ("downpour", "sync", "sandblaster")  # strategies with parameter shards
APPLIES_TO: dict[str, tuple[str, ...]] = {
    **{name: ("downpour",) for name in _DOWNPOUR_ONLY},
    **{name: ("sandblaster",) for name in SECTIONS["sandblaster"]},
    **{name: _WITH_SERVER for name in SECTIONS["durability"]},
    **{name: ("sgd", "sync", "downpour", "hogwild", "ddp")
       for name in ("server_optimizer", "lr", "adagrad_eps", "adagrad_initial_accumulator")},
}


def ignored_by_strategy(names, strategy: str) -> list[str]:
    """Of the settings ``names`` (those a user set), the ones ``strategy`` does not read."""
    return [n for n in names if n in APPLIES_TO and strategy not in APPLIES_TO[n]]


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config into one namespace of settings. Settings may sit at the top level or in their section
    (``[downpour]``, ``[sandblaster]``, ... see SECTIONS); an unknown section, or a setting in a section that is
    not its own, is a ConfigError naming the file, the section and the key (it would otherwise silently set the
    setting for every strategy)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("config", f"no such file: {p}")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("config", f"{p} is not valid TOML: {e}") from None
    flat: dict[str, Any] = {}
    for k, v in data.items():
        if not isinstance(v, dict):
            flat[k] = v
            continue
        if k not in SECTIONS:
            raise ConfigError("config", f"{p}: unknown section [{k}]; sections are "
                                        f"{', '.join(f'[{s}]' for s in SECTIONS)}")
        for key, value in v.items():
            name = key.replace("-", "_")
            if name not in SECTIONS[k]:
                home = section_of(name)
                where = f"it belongs in [{home}]" if home else "it is not a setting"
                raise ConfigError("config", f"{p}: [{k}] {key}: {where}")
            if name in flat:
                raise ConfigError("config", f"{p}: {key} is set twice")
            flat[name] = value
    return flat
