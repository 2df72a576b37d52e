"""Settings as a file or a run directory writes them: TOML config files (settings at the top level or in their
section, see ``SECTIONS``), the coercion of a raw value (TOML, command line) to a setting's type, and the upgrade
of settings that older run directories wrote.

This module knows the settings by name only; ``distbelief.config`` applies what it returns onto a RunConfig
(``config_from``) and re-exports the names the rest of the package uses.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from distbelief.exceptions import ConfigError

# ---------------------------------------------------------------- sections of a TOML config
# The sections of a TOML config and the settings each holds. A file may also name any setting at its top level
# (a run directory's config.toml does); in a section, a setting must be one of that section's.
SECTIONS: dict[str, tuple[str, ...]] = {
    "task": ("task", "model", "num_samples", "num_classes", "class_prior", "ctr_max_rows"),
    "run": ("strategy", "replicas", "max_replicas", "shards", "partitions", "batch_size", "optimizer", "lr",
            "adagrad_eps", "adagrad_initial_accumulator", "seed", "out", "tensorboard", "runtime", "threads",
            "init_params", "device"),
    "stop": ("max_steps", "max_seconds", "target_accuracy", "target_auc"),
    "downpour": ("fetch_every", "push_every", "local_lr", "overlap", "staleness_aware", "warmstart_steps",
                 "max_replica_restarts", "consistency", "staleness_bound", "backup_replicas", "compress",
                 "compress_ratio", "compress_bits", "compress_rank", "compress_fetch"),
    "sandblaster": ("lbfgs_batch", "portion_size", "history", "push_every_portions", "backup_tasks"),
    "eval": ("eval_every_seconds", "evaluation", "eval_samples", "train_eval_samples", "metrics_port"),
    "durability": ("durability", "checkpoint_every_seconds", "checkpoint_every_updates", "log_max_mb",
                   "max_shard_restarts"),
    "cluster": ("address", "remote_timeout_s", "streams"),
}


def section_of(name: str) -> str | None:
    return next((sec for sec, names in SECTIONS.items() if name in names), None)


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


# ---------------------------------------------------------------- raw values
def coerce_value(name: str, typ, raw: Any) -> Any:
    """``raw`` (a TOML value or a command-line string) as a value of the setting ``name`` of type ``typ`` (the
    type or, under ``from __future__ import annotations``, its name); ConfigError when it is not one. A setting
    of type ``int | None`` (None: its default) takes None, or an int."""
    if isinstance(typ, str) and typ.endswith(" | None"):
        if raw is None:
            return None
        typ = typ.removesuffix(" | None")
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


# ---------------------------------------------------------------- settings of older runs
LEGACY = {"wal": "durability", "server_optimizer": "optimizer"}
# Fault injection and straggler emulation were settings once; they are test tooling now (distbelief.testing).
# A run directory written then still resumes (saved_run_values drops them: a fault never fires again on resume);
# anywhere else they are refused with a message saying where they went.
FORMER_TEST_HOOKS = ("kill_replica_at_step", "kill_replica_id", "kill_partition_id", "kill_shard_at_step",
                     "kill_shard_id", "kill_replica_after_s", "kill_shard_after_s", "portion_delay_s",
                     "straggler_id", "straggler_slowdown")


def upgrade_legacy(values: dict[str, Any]) -> dict[str, Any]:
    """Settings of older runs (their config.toml must still resume): ``server_optimizer`` is ``optimizer``
    (the update rule of every SGD-family strategy, not only a server's); before ``durability`` replaced
    ``wal``, ``wal = true`` is ``durability = "log"``; ``wal = false`` is ``"snapshot"``, or ``"off"`` when
    checkpoints were off too. Changes ``values`` in place and returns it."""
    if "server_optimizer" in values:
        values.setdefault("optimizer", values.pop("server_optimizer"))
    if "wal" in values:
        wal = str(values.pop("wal")).lower() in ("1", "true", "yes", "on")
        if "durability" not in values:
            ckpt = values.get("checkpoint_every_seconds", 30.0) or values.get("checkpoint_every_updates", 0)
            values["durability"] = "log" if wal else ("snapshot" if ckpt else "off")
    return values


def refuse_former_test_hook(name: str) -> None:
    """ConfigError when ``name`` is one of FORMER_TEST_HOOKS, saying where fault injection went."""
    if name in FORMER_TEST_HOOKS:
        raise ConfigError(name, "fault injection is test tooling, not a run setting: pass "
                                "distbelief.testing.Faults(...) to train(..., hooks=...)")


# Settings whose default ("auto") was written 0 before None stood for it: an older run's config.toml holds
# ``threads = 0`` and (for tasks other than speech) ``num_classes = 0``; 0 is refused now.
FORMER_AUTO_ZERO = ("num_samples", "num_classes", "lr", "batch_size", "threads", "lbfgs_batch", "portion_size")


def saved_run_values(values: dict[str, Any]) -> dict[str, Any]:
    """The settings of a run directory's config.toml, as a resume reads them: FORMER_TEST_HOOKS dropped, the 0 of
    a FORMER_AUTO_ZERO setting read as its default (left out), and a sandblaster run written before
    ``lbfgs_batch`` existed keeps its L-BFGS batch (it was ``batch_size``)."""
    out = {k: v for k, v in values.items()
           if k not in FORMER_TEST_HOOKS and not (k in FORMER_AUTO_ZERO and v == 0 and not isinstance(v, bool))}
    if out.get("strategy") == "sandblaster" and "batch_size" in out and "lbfgs_batch" not in out:
        out["lbfgs_batch"] = out["batch_size"]
    return out
