"""RunConfig.normalized() is the one step that fills in derived settings, and neither it nor validate() changes
the config they are called on."""

import dataclasses

import pytest

from distbelief.config import RunConfig
from distbelief.exceptions import ConfigError


def test_normalized_returns_a_copy_with_the_auto_settings_resolved():
    cfg = RunConfig(strategy="sandblaster")
    before = dataclasses.asdict(cfg)
    norm = cfg.normalized()
    assert dataclasses.asdict(cfg) == before  # the config it was called on is untouched
    assert norm is not cfg
    assert norm.lr > 0 and norm.batch_size > 0 and norm.portion_size > 0
    assert norm.normalized() == norm  # normalising twice changes nothing


def test_validate_returns_the_normalized_config_and_changes_nothing():
    cfg = RunConfig(strategy="sgd", replicas=4)
    valid = cfg.validate()
    assert cfg.replicas == 4 and cfg.lr is None and cfg.batch_size is None
    assert valid == cfg.normalized()
    assert valid.replicas == 1  # sgd is one process


def test_a_value_normalization_cannot_use_is_refused_not_normalised_away():
    with pytest.raises(ConfigError, match="replicas"):
        RunConfig(strategy="sgd", replicas=0).normalized()
    with pytest.raises(ConfigError, match="model"):
        RunConfig(model="nope").normalized()
    with pytest.raises(ConfigError, match="batch_size"):
        RunConfig(batch_size=-1).normalized()


@pytest.mark.parametrize("strategy, rule", [("sgd", "sgd"), ("hogwild", "sgd"), ("ddp", "sgd"),
                                            ("downpour", "adagrad"), ("sync", "adagrad")])
def test_the_update_rule_is_sgd_unless_a_parameter_server_applies_it_or_the_user_asks(strategy, rule):
    from distbelief.defaults import recommended_lr

    cfg = RunConfig(strategy=strategy, model="mlp").validate()
    assert cfg.optimizer == rule and cfg.lr == recommended_lr("mlp", strategy, rule)
    assert RunConfig(strategy=strategy, optimizer="adagrad").validate().optimizer == "adagrad"
    assert RunConfig(strategy=strategy, optimizer="sgd").validate().optimizer == "sgd"


def test_the_former_name_of_the_update_rule_still_reads():
    from distbelief.config import config_from

    assert config_from({"server_optimizer": "sgd", "strategy": "downpour"}).validate().optimizer == "sgd"
    assert config_from({"server_optimizer": "adagrad"}).optimizer == "adagrad"  # an old run's config.toml


def test_the_former_flag_still_parses():
    from distbelief.cli import build_parser

    args = build_parser().parse_args(["train", "--server-optimizer", "sgd"])
    assert args.optimizer == "sgd"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--optimizer", "rmsprop"])


def test_sandblaster_has_its_own_batch_and_the_cli_says_so(capsys):
    from distbelief.cli import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(
        ["train", "--strategy", "sandblaster", "--batch-size", "256", "--out", "x"]))
    err = capsys.readouterr().err
    assert "--batch-size has no effect with --strategy sandblaster" in err and "--lbfgs-batch" in err
    assert cfg.lbfgs_batch == 8000 and cfg.portion_size == 500  # the L-BFGS batch is not the minibatch
    cfg = config_from_args(build_parser().parse_args(
        ["train", "--strategy", "sandblaster", "--lbfgs-batch", "640", "--out", "x"]))
    assert cfg.lbfgs_batch == 640 and cfg.portion_size == 40 and capsys.readouterr().err == ""


def test_an_old_sandblaster_run_keeps_its_batch_on_resume():
    from distbelief.config import config_from, saved_run_values

    old = {"strategy": "sandblaster", "batch_size": 512, "portion_size": 64}  # written before lbfgs_batch
    assert config_from(saved_run_values(old)).validate().lbfgs_batch == 512
    assert config_from(saved_run_values({**old, "lbfgs_batch": 256})).lbfgs_batch == 256


def test_bench_address_goes_to_the_ray_strategies_only():
    from distbelief.bench.throughput import make_plan

    plan = make_plan(False, ["fig4"], ["sgd-1", "hogwild", "downpour"], 1, 10.0, address="10.0.0.1:6379")
    assert plan.settings("fig4", "downpour")["address"] == "10.0.0.1:6379"
    assert "address" not in plan.settings("fig4", "sgd-1") and "address" not in plan.settings("fig4", "hogwild")
    assert "address" not in make_plan(False, ["fig4"], ["downpour"], 1, 10.0).settings("fig4", "downpour")


def test_bench_refuses_address_where_it_pins_this_machines_cores(capsys):
    from distbelief.cli import main

    assert main(["bench", "fig5", "--address", "10.0.0.1:6379", "--out", "x"]) == 2
    assert "--address: bench fig5 pins this machine's cores" in capsys.readouterr().err
