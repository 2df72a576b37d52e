"""Bad numbers are refused, not replaced (issue 26: ``--batch-size 0`` silently trained with the default).

Every int and float setting of RunConfig has a range (``config.RANGES``), checked before any worker starts: a 0
or negative value that means nothing for a setting is refused with an error naming it (the flag on the command
line); None, for the settings whose default depends on the task, model, strategy or machine, is that default.
The tables below are the test's own: a new numeric setting fails here until it is given a rule, a good value and,
where 0 means something, an entry in ZERO_OK.
"""

import dataclasses
import math
import typing

import pytest
import torch
from torch.utils.data import TensorDataset

from distbelief.cli import as_flags, build_parser, config_from_args, main
from distbelief.config import RANGES, RunConfig, config_from, ignored_by_strategy, saved_run_values
from distbelief.exceptions import ConfigError


def _numeric(hint) -> bool:
    return hint in (int, float) or any(a in (int, float) for a in typing.get_args(hint))


HINTS = typing.get_type_hints(RunConfig)
NUMERIC = [f.name for f in dataclasses.fields(RunConfig) if _numeric(HINTS[f.name])]
INTEGER = {name for name in NUMERIC if int in (HINTS[name], *typing.get_args(HINTS[name]))}

# The settings for which 0 is a value of its own (not "the default", which is None), and what it means.
ZERO_OK = {
    "class_prior": "balanced classes",
    "max_replicas": "a fixed replica count (not elastic)",
    "local_lr": "no local step (the paper's)",
    "adagrad_initial_accumulator": "torch's Adagrad default",
    "warmstart_steps": "no warmstart",
    "staleness_bound": "lockstep without a barrier",
    "backup_replicas": "no backup replicas",
    "max_steps": "no step limit",
    "max_seconds": "no time limit",
    "target_accuracy": "no target",
    "target_auc": "no target",
    "eval_samples": "the whole test set",
    "train_eval_samples": "no training accuracy",
    "metrics_port": "no metrics server",
    "seed": "a seed like any other",
    "max_replica_restarts": "no restart",
    "checkpoint_every_seconds": "no snapshot by time",
    "checkpoint_every_updates": "no snapshot by count",
    "max_shard_restarts": "no restart",
}
NEGATIVE_OK: dict[str, str] = {}  # none: no setting takes a negative value

# A value other than the default that each setting takes, with the settings it needs beside it.
GOOD = {
    "num_samples": (1000, {}),
    "num_classes": (64, {"task": "speech"}),
    "class_prior": (1.0, {"task": "speech"}),
    "ctr_max_rows": (1000, {}),
    "replicas": (3, {}),
    "max_replicas": (4, {}),
    "shards": (3, {}),
    "partitions": (2, {}),
    "fetch_every": (2, {}),
    "push_every": (2, {}),
    "lr": (0.1, {}),
    "local_lr": (0.01, {}),
    "adagrad_eps": (1e-8, {}),
    "adagrad_initial_accumulator": (0.1, {}),
    "batch_size": (1, {}),
    "warmstart_steps": (5, {}),
    "staleness_bound": (1, {"consistency": "ssp"}),
    "backup_replicas": (1, {"consistency": "sync"}),
    "max_steps": (10, {}),
    "max_seconds": (0.5, {}),
    "target_accuracy": (1.0, {}),
    "target_auc": (0.8, {"task": "ctr", "model": "dlrm-small"}),
    "eval_every_seconds": (0.1, {}),
    "eval_samples": (100, {}),
    "train_eval_samples": (100, {}),
    "metrics_port": (65535, {}),
    "seed": (7, {}),
    "threads": (1, {}),
    "max_replica_restarts": (1, {}),
    "remote_timeout_s": (1.0, {}),
    "checkpoint_every_seconds": (1.0, {}),
    "checkpoint_every_updates": (10, {}),
    "log_max_mb": (0.5, {}),
    "max_shard_restarts": (1, {}),
    "lbfgs_batch": (1, {}),
    "portion_size": (1, {}),
    "history": (1, {}),
    "push_every_portions": (1, {}),
    "compress_ratio": (1.0, {"compress": "topk"}),
    "compress_bits": (8, {"compress": "qsgd"}),
    "compress_rank": (1, {"compress": "powersgd"}),
}
# Beside a 0 that is allowed: another stop condition where 0 lifts one.
ZERO_CONTEXT = {"max_seconds": {"max_steps": 10}}


def bad_values(name: str) -> list:
    out = [] if name in ZERO_OK else [0]
    out += [] if name in NEGATIVE_OK else [-1]
    if name in INTEGER:
        out.append(1.5)
    else:
        out += [math.nan, math.inf]
    return out


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def test_every_numeric_setting_has_a_rule_a_good_value_and_a_reason_for_each_zero_it_takes():
    assert len(NUMERIC) > 30  # the derivation from the dataclass found them
    assert set(RANGES) == set(NUMERIC), "a numeric setting needs a Range in config.RANGES"
    assert set(GOOD) == set(NUMERIC), "a numeric setting needs a good value in GOOD here"
    assert set(ZERO_OK) <= set(NUMERIC) and set(NEGATIVE_OK) <= set(NUMERIC)


@pytest.mark.parametrize("name", NUMERIC)
def test_a_meaningless_value_is_refused_naming_the_setting_and_a_good_one_passes(name):
    for bad in bad_values(name):
        with pytest.raises(ConfigError) as e:
            RunConfig(**{name: bad}).validate()
        assert e.value.field == name, (bad, str(e.value))
    value, context = GOOD[name]
    assert getattr(RunConfig(**context, **{name: value}).validate(), name) == value
    if name in ZERO_OK:
        RunConfig(**ZERO_CONTEXT.get(name, {}), **{name: 0}).validate()
    if name in NEGATIVE_OK:
        RunConfig(**{name: -1}).validate()


@pytest.mark.parametrize("name", NUMERIC)
def test_the_command_line_refuses_them_naming_the_flag(name, tmp_path):
    for bad in bad_values(name):
        args = build_parser().parse_args(["train", flag(name), str(bad), "--out", str(tmp_path / "run")])
        with pytest.raises(ConfigError) as e:
            config_from_args(args)
        assert as_flags(e.value).startswith(f"{flag(name)}: "), as_flags(e.value)


def test_none_is_the_default_of_the_auto_settings_and_0_is_not():
    auto = [f.name for f in dataclasses.fields(RunConfig) if f.default is None]
    assert set(auto) == {"num_samples", "num_classes", "lr", "batch_size", "threads", "lbfgs_batch",
                         "portion_size"}
    cfg = config_from({name: None for name in auto}).validate()  # the Python API: batch_size=None
    assert cfg.batch_size == 32 and cfg.lr > 0 and cfg.num_samples > 0
    with pytest.raises(ConfigError, match="^batch_size: must be an integer >= 1, got 0; leave it out for the "
                                          "default"):
        config_from({"batch_size": 0}).validate()
    with pytest.raises(ConfigError, match="^replicas: expected int, got None"):  # None is no value of a count
        config_from({"replicas": None})


def test_a_run_written_when_0_meant_the_default_still_resumes():
    old = {"task": "mnist1d", "num_classes": 0, "threads": 0, "batch_size": 32, "lr": 0.05, "seed": 0,
           "max_steps": 0, "max_seconds": 60.0}  # an older run directory's config.toml
    cfg = config_from(saved_run_values(old)).validate()
    assert cfg.threads is None and cfg.num_classes is None and cfg.seed == 0 and cfg.max_steps == 0


def test_train_batch_size_0_exits_naming_the_flag_before_any_worker(tmp_path, capsys, monkeypatch):
    import distbelief.api

    def no_run(*a, **k):
        raise AssertionError("a run started")

    monkeypatch.setattr(distbelief.api, "train_task", no_run)
    out = tmp_path / "run"
    rc = main(["train", "--runtime", "inprocess", "--num-samples", "200", "--max-steps", "1", "--batch-size", "0",
               "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "distbelief: error: --batch-size: must be an integer >= 1, got 0; leave it out for the default" in err
    assert not out.exists()


# ---------------------------------------------------------------- settings the strategy ignores
@pytest.mark.parametrize("strategy,args", [
    ("sandblaster", ["--checkpoint-every-seconds", "5"]),
    ("sandblaster", ["--checkpoint-every-updates", "100"]),
    ("sandblaster", ["--log-max-mb", "64"]),
    ("hogwild", ["--max-replica-restarts", "5"]),
    ("ddp", ["--max-replica-restarts", "0"]),
    ("sgd", ["--max-replica-restarts", "5"]),
])
def test_a_setting_the_strategy_ignores_warns_naming_flag_and_strategy(strategy, args, capsys, tmp_path):
    def parse(*a):
        return build_parser().parse_args(["train", "--strategy", strategy, *a, "--out", str(tmp_path)])

    config_from_args(parse(*args))
    err = capsys.readouterr().err
    assert f"distbelief: warning: {args[0]} has no effect with --strategy {strategy}" in err, err
    config_from_args(parse())  # left at its default: no warning
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("strategy,args", [("downpour", ["--checkpoint-every-seconds", "5", "--log-max-mb", "64"]),
                                           ("sync", ["--checkpoint-every-updates", "100"]),
                                           ("downpour", ["--max-replica-restarts", "5"]),
                                           ("sandblaster", ["--max-replica-restarts", "5"])])
def test_no_warning_where_the_strategy_reads_it(strategy, args, capsys, tmp_path):
    config_from_args(build_parser().parse_args(["train", "--strategy", strategy, *args, "--out", str(tmp_path)]))
    assert capsys.readouterr().err == ""


def test_the_python_api_warns_of_an_ignored_argument_before_anything_starts():
    from distbelief import train

    data = TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,)))
    with (pytest.warns(UserWarning, match="max_replica_restarts has no effect with strategy 'hogwild'"),
          pytest.raises(ConfigError, match="loader_workers")):  # refused next: nothing trains
        train(lambda: torch.nn.Linear(3, 2), data, data, strategy="hogwild", max_replica_restarts=5,
              loader_workers=-1, quiet=True)


# ---------------------------------------------------------------- bench options a command does not read
@pytest.mark.parametrize("figure,args", [
    ("fig4", ["--steps", "3"]), ("fig5", ["--steps", "3"]),
    ("fig3", ["--methods", "sgd-1"]), ("fig3", ["--max-seconds", "5"]),
    ("fig3", ["--models", "paper"]), ("fig5", ["--repeats", "2"]),
    ("throughput", ["--cores", "1"]), ("throughput", ["--steps", "2"]),
])
def test_bench_refuses_an_option_the_command_does_not_read(figure, args, tmp_path, capsys):
    rc = main(["bench", figure, *args, "--quick", "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert rc == 2 and f"distbelief: error: {args[0]}: is not an option of bench {figure}" in err, err
    assert not (tmp_path / "b").exists()


def test_compression_settings_are_refused_where_they_cannot_apply():
    with pytest.raises(ConfigError, match="^compress_bits: must be 2, 4 or 8"):
        RunConfig(compress="qsgd", compress_bits=3).validate()
    with pytest.raises(ConfigError, match="^compress: unknown value 'gzip'"):
        RunConfig(compress="gzip").validate()
    with pytest.raises(ConfigError, match="^compress_fetch: unknown value"):
        RunConfig(compress_fetch="int8").validate()
    with pytest.raises(ConfigError, match="^compress: partitioned replicas"):
        RunConfig(compress="topk", partitions=2, model="lc1d").validate()
    with pytest.raises(ConfigError, match="^compress_fetch: delta fetches"):
        RunConfig(compress_fetch="delta", local_lr=0.01).validate()
    assert ignored_by_strategy(["compress", "compress_fetch"], "hogwild") == ["compress", "compress_fetch"]
    assert ignored_by_strategy(["compress"], "sync") == []
