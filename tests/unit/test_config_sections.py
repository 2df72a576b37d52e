"""TOML configs: settings at the top level or in their own section; anything else is an error that names the
file, the section and the key."""

import pytest

from distbelief import ConfigError
from distbelief.config import SECTIONS, config_from, load_toml


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_settings_in_their_sections_and_at_the_top_level(tmp_path):
    p = write(tmp_path, 'replicas = 3\n[downpour]\nfetch_every = 2\noverlap = true\n[sandblaster]\nhistory = 7\n'
                        '[stop]\nmax_seconds = 30\n[durability]\ndurability = "log"\n')
    cfg = config_from(load_toml(p))
    assert (cfg.replicas, cfg.fetch_every, cfg.overlap, cfg.history, cfg.max_seconds, cfg.durability) == (
        3, 2, True, 7, 30.0, "log")


def test_a_setting_in_another_strategys_section_is_refused(tmp_path):
    # the example: a Sandblaster section's lr used to set the rate of a Downpour run
    p = write(tmp_path, "[sandblaster]\nlr = 7.5\n")
    with pytest.raises(ConfigError, match=r"c\.toml: \[sandblaster\] lr: it belongs in \[run\]"):
        load_toml(p)


def test_unknown_sections_keys_and_duplicates_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown section \[sandblster\]"):
        load_toml(write(tmp_path, "[sandblster]\nhistory = 3\n"))
    with pytest.raises(ConfigError, match=r"\[eval\] evry: it is not a setting"):
        load_toml(write(tmp_path, "[eval]\nevry = 3\n"))
    with pytest.raises(ConfigError, match="max_steps is set twice"):
        load_toml(write(tmp_path, "max_steps = 3\n[stop]\nmax_steps = 4\n"))


def test_every_section_names_real_settings():
    import dataclasses

    from distbelief import RunConfig

    names = [n for sec in SECTIONS.values() for n in sec]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(RunConfig))  # each exactly once


@pytest.mark.parametrize("strategy", ["sgd", "hogwild", "ddp"])
def test_single_machine_baselines_refuse_an_address(strategy):
    from distbelief import RunConfig

    with pytest.raises(ConfigError, match="^address: "):
        RunConfig(strategy=strategy, address="10.0.0.5:6379").validate()
    if strategy == "sgd":  # one replica over P partitions is placed on the cluster
        RunConfig(strategy="sgd", model="lc1d", partitions=2, address="10.0.0.5:6379").validate()


def test_settings_the_strategy_does_not_read_are_named():
    from distbelief.config import ignored_by_strategy

    typed = ["replicas", "portion_size", "fetch_every", "durability", "lr"]
    assert ignored_by_strategy(typed, "downpour") == ["portion_size"]
    assert ignored_by_strategy(typed, "sandblaster") == ["fetch_every", "lr"]
    assert ignored_by_strategy(typed, "hogwild") == ["portion_size", "fetch_every", "durability"]
    assert ignored_by_strategy(["optimizer", "history"], "sandblaster") == ["optimizer"]
