"""Warmstart from a checkpoint (``init_params``): every strategy starts from the saved parameters."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from distbelief import RunConfig
from distbelief.api import train_task
from distbelief.exceptions import ConfigError

BASE = dict(runtime="inprocess", num_samples=2000, batch_size=32, eval_every_seconds=3600, max_seconds=0)


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("warm") / "sgd"
    res = train_task(RunConfig(strategy="sgd", lr=0.1, max_steps=150, out=str(out), **BASE), quiet=True)
    return out, res


def test_downpour_starts_from_the_checkpoint(warm_run, tmp_path):
    out, warm = warm_run
    saved = load_file(str(out / "params.safetensors"))["flat_params"]
    assert torch.equal(saved, warm.flat_params)
    # One push at a vanishing rate: the server's parameters stay the warmstart's to float precision.
    res = train_task(RunConfig(strategy="downpour", replicas=1, shards=2, optimizer="sgd", lr=1e-9,
                               max_steps=1, init_params=str(out), **BASE), quiet=True)
    assert torch.allclose(res.flat_params, saved, atol=1e-6)
    # ... and so its accuracy is the warmstart's, far above a fresh model's.
    assert res.summary["final_test_accuracy"] == pytest.approx(warm.summary["final_test_accuracy"], abs=1e-3)
    fresh = train_task(RunConfig(strategy="downpour", replicas=1, shards=2, optimizer="sgd", lr=1e-9,
                                 max_steps=1, **BASE), quiet=True)
    assert not torch.allclose(fresh.flat_params, saved, atol=1e-3)


def test_single_process_sgd_continues_from_the_file(warm_run):
    out, warm = warm_run
    res = train_task(RunConfig(strategy="sgd", lr=1e-9, max_steps=1, init_params=str(out / "params.safetensors"),
                               **BASE), quiet=True)
    assert torch.allclose(res.flat_params, warm.flat_params, atol=1e-6)


def test_bad_warmstart_files_are_named(warm_run, tmp_path):
    with pytest.raises(ConfigError, match="init_params: no such file"):
        train_task(RunConfig(strategy="sgd", max_steps=1, init_params=str(tmp_path / "nope"), **BASE), quiet=True)
    wrong = tmp_path / "wrong.safetensors"
    save_file({"flat_params": torch.zeros(17)}, str(wrong))
    with pytest.raises(ConfigError, match="init_params: .*17 parameters but the model has"):
        train_task(RunConfig(strategy="sgd", max_steps=1, init_params=str(wrong), **BASE), quiet=True)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00not a safetensors file")
    with pytest.raises(ConfigError, match="init_params: .*not a readable safetensors file"):
        train_task(RunConfig(strategy="sgd", max_steps=1, init_params=str(garbage), **BASE), quiet=True)
