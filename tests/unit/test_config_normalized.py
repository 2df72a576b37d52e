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
    assert cfg.replicas == 4 and cfg.lr == 0 and cfg.batch_size == 0
    assert valid == cfg.normalized()
    assert valid.replicas == 1  # sgd is one process


def test_a_value_normalization_cannot_use_is_refused_not_normalised_away():
    with pytest.raises(ConfigError, match="replicas"):
        RunConfig(strategy="sgd", replicas=0).normalized()
    with pytest.raises(ConfigError, match="model"):
        RunConfig(model="nope").normalized()
    with pytest.raises(ConfigError, match="batch_size"):
        RunConfig(batch_size=-1).normalized()
