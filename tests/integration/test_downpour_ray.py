"""Downpour on real Ray actors (one local Ray instance for the module)."""

import json

import pytest
import ray
import torch

from distbelief import RunConfig, train
from distbelief.api import train_task
from tests.conftest import make_odd_model
from tests.integration.test_downpour_inprocess import check_run_dir

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


def test_ray_mnist1d_two_replicas_two_shards_adagrad_reaches_80_percent(tmp_path):
    cfg = RunConfig(runtime="ray", replicas=2, shards=2, server_optimizer="adagrad", lr=0.05, batch_size=128,
                    max_seconds=120, target_accuracy=0.80, eval_every_seconds=3, out=str(tmp_path / "run"))
    train_task(cfg, quiet=True)
    summary, _ = check_run_dir(tmp_path / "run", "downpour")
    assert summary["runtime"] == "ray"
    assert summary["final_test_accuracy"] >= 0.80
    assert summary["staleness_mean"] >= 0 and summary["staleness_max"] >= 1  # two async replicas: some staleness


@pytest.mark.parametrize("replicas,steps,push_every", [(2, 12, 3), (3, 8, 2)])
def test_ray_each_shard_applies_exactly_R_S_over_n_updates(toy_data, replicas, steps, push_every):
    res = train(make_odd_model, toy_data[0], toy_data[1], quiet=True, runtime="ray", replicas=replicas, shards=3,
                max_steps=steps, push_every=push_every, max_seconds=0, eval_every_seconds=3600, batch_size=8)
    assert res.summary["updates_per_shard"] == [replicas * steps // push_every] * 3
    assert res.summary["examples"] == replicas * steps * 8


def test_ray_one_replica_matches_inprocess_exactly(toy_data):
    """Per-caller ordering on a shard actor makes the 1-replica run deterministic: Ray == in-process."""
    kw = dict(quiet=True, replicas=1, shards=2, max_steps=15, max_seconds=0, eval_every_seconds=3600,
              batch_size=8, server_optimizer="adagrad", lr=0.05, overlap=True)
    a = train(make_odd_model, toy_data[0], toy_data[1], runtime="ray", **kw)
    b = train(make_odd_model, toy_data[0], toy_data[1], runtime="inprocess", **kw)
    torch.testing.assert_close(a.flat_params, b.flat_params, atol=1e-6, rtol=0)


def test_ray_replica_process_killed_mid_run_is_restarted(tmp_path):
    cfg = RunConfig(runtime="ray", replicas=2, shards=2, max_seconds=15, kill_replica_after_s=4,
                    kill_replica_id=1, eval_every_seconds=2, batch_size=64, out=str(tmp_path / "run"))
    res = train_task(cfg, quiet=True)
    assert res.summary["replica_restarts"] == 1
    assert res.summary["stop_reason"] == "time budget spent"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_test_accuracy"] > 0.5
