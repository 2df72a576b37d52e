"""Bad input gets a clear error (before any worker starts) or a counted rejection; nothing is silently corrupted."""

import pickletools
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distbelief import ConfigError, RunConfig, train
from distbelief.api import train_task
from distbelief.testing import Faults
from tests.conftest import make_odd_model, toy_classification


def test_model_and_data_shapes_disagree_names_both_shapes(toy_data):
    def wrong_input():
        return nn.Linear(9, 3)  # the data has 7 features

    with pytest.raises(ConfigError, match=r"model: .*\(2, 7\)"):
        train(wrong_input, toy_data[0], toy_data[1], runtime="inprocess", quiet=True, max_steps=1)

    def wrong_classes():
        return nn.Linear(7, 2)  # the labels go up to 2 (3 classes)

    with pytest.raises(ConfigError, match=r"output of shape \(2, 2\).*labels of shape \(2,\)"):
        train(wrong_classes, toy_classification(8, classes=3, seed=5), toy_data[1], runtime="inprocess",
              quiet=True, max_steps=1)


def test_contradictory_settings_name_the_field(toy_data):
    with pytest.raises(ConfigError, match="shards"):
        train(make_odd_model, toy_data[0], toy_data[1], runtime="inprocess", quiet=True, shards=10**6,
              max_steps=1)
    with pytest.raises(ConfigError, match="kill_shard_id"):
        train(make_odd_model, toy_data[0], toy_data[1], runtime="inprocess", quiet=True, shards=2, max_steps=1,
              hooks=Faults(kill_shard_at_step=1, kill_shard_id=5))
    with pytest.raises(ConfigError, match="resume"):
        train(make_odd_model, toy_data[0], toy_data[1], runtime="inprocess", quiet=True, max_steps=1,
              resume=True, out="/nonexistent/run")
    with pytest.raises(ConfigError, match="^resume: /nonexistent/run has no checkpoints/"):
        train(make_odd_model, toy_data[0], toy_data[1], runtime="inprocess", quiet=True, max_steps=1,
              strategy="sandblaster", resume=True, out="/nonexistent/run")


class NaNEvery:
    """A loss that is NaN for every n-th minibatch (a replica pushing poisoned gradients)."""

    def __init__(self, n: int):
        self.n, self.calls, self.lock = n, 0, threading.Lock()  # replicas are threads in-process

    def __call__(self, out, y):
        with self.lock:
            self.calls += 1
            poisoned = self.calls % self.n == 0
        loss = F.cross_entropy(out, y)
        return loss * float("nan") if poisoned else loss


def test_nan_pushes_are_rejected_counted_and_parameters_stay_finite(toy_data):
    res = train(make_odd_model, toy_data[0], toy_data[1], runtime="inprocess", quiet=True, replicas=2, shards=3,
                max_steps=40, max_seconds=0, eval_every_seconds=3600, loss_fn=NaNEvery(5), batch_size=16)
    s = res.summary
    # 80 gradients in all (plus the driver's start-up check, call 1): calls 5, 10, ..., 80 are NaN — 16 pushes,
    # each refused by all 3 shards.
    assert s["rejected_pushes"] == 2 * 8 * 3
    assert s["updates_per_shard"] == [2 * 32] * 3
    assert torch.isfinite(res.flat_params).all()


def test_run_directory_holds_no_pickles(tmp_path):
    cfg = RunConfig(runtime="inprocess", max_steps=20, max_seconds=0, num_samples=500, out=str(tmp_path / "run"))
    train_task(cfg, quiet=True)
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    for p in files:
        head = p.read_bytes()[:2]
        if head[:1] == b"\x80" and head[1:2] and head[1] <= 5:  # pickle protocol 2-5 opcode PROTO
            with pytest.raises(Exception):
                pickletools.dis(p.read_bytes(), out=open("/dev/null", "w"))


def test_fault_injection_is_not_a_run_setting(tmp_path):
    """Fault injection and straggler emulation are test tooling (distbelief.testing.Faults): no RunConfig field,
    no `distbelief train` flag, and a config file naming one is refused with a message saying where it went."""
    import dataclasses
    import subprocess
    import sys

    fault_fields = {f.name for f in dataclasses.fields(Faults)}
    assert fault_fields and not fault_fields & {f.name for f in dataclasses.fields(RunConfig)}
    bad = subprocess.run([sys.executable, "-m", "distbelief.cli", "train", "--kill-shard-at-step", "3"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unrecognized arguments: --kill-shard-at-step" in bad.stderr
    toml = tmp_path / "faults.toml"
    toml.write_text("straggler_slowdown = 4.0\n")
    with pytest.raises(ConfigError, match="^straggler_slowdown: fault injection is test tooling"):
        from distbelief.config import config_from, load_toml

        config_from(load_toml(toml))
