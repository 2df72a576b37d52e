"""The stream transport on a (fake, ``ray.cluster_utils.Cluster``) two-node cluster: across nodes, a dense
replica's pushes and fetches go by gloo streams (runtime/streams.py) and give exactly the parameters the object
store gives; a shard killed mid-run is replaced and served through the object store, losing nothing."""

import pytest
import ray
import torch

from distbelief import train
from distbelief.runtime.local_cluster import fake_cluster
from distbelief.runtime.ray_runtime import SYSTEM_CONFIG, RayRuntime
from distbelief.testing import Faults
from tests.conftest import make_odd_model

pytestmark = [pytest.mark.ray]


@pytest.fixture(scope="module")
def two_nodes():
    ray.shutdown()
    c = fake_cluster(num_cpus=2, _system_config=SYSTEM_CONFIG)
    c.add_node(num_cpus=2)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


def _train(cluster, toy_data, use_streams: bool, **kw):
    runtime = RayRuntime(address=cluster.address, remote_timeout_s=60, use_streams=use_streams)
    kw = {"eval_every_seconds": 3600, **kw}
    try:
        return train(make_odd_model, toy_data[0], toy_data[1], runtime=runtime, quiet=True, replicas=1, shards=2,
                     max_seconds=0, batch_size=8, optimizer="adagrad", lr=0.05, **kw)
    finally:
        runtime.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("loop", ["fused", "overlap"])
def test_streams_give_the_object_stores_parameters_bit_for_bit(two_nodes, toy_data, loop):
    """One replica, same data order: the fused loop (one call per shard a step: push, then fetch) and the overlap
    loop (separate pushes every 2 steps and prefetches) by stream equal the object store's run exactly."""
    kw = dict(max_steps=20) if loop == "fused" else dict(max_steps=20, overlap=True, push_every=2)
    streamed, stored = (_train(two_nodes, toy_data, s, **kw) for s in (True, False))
    assert streamed.summary["replica_transports"] == {"stream": 1}
    assert stored.summary["replica_transports"] == {"object-store": 1}
    assert torch.equal(streamed.flat_params, stored.flat_params)
    assert streamed.summary["updates_per_shard"] == stored.summary["updates_per_shard"]
    assert streamed.summary["bytes_pushed_per_shard"] == stored.summary["bytes_pushed_per_shard"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_shard_killed_mid_run_is_served_through_the_object_store_and_nothing_is_lost(two_nodes, toy_data,
                                                                                       tmp_path):
    res = _train(two_nodes, toy_data, True, max_steps=120, durability="replicate", out=str(tmp_path / "run"),
                 hooks=Faults(kill_shard_at_step=40, kill_shard_id=1))
    s = res.summary
    assert s["replica_transports"] == {"stream (1 of 2 shards)": 1}  # the replacement: by the object store
    assert s["shard_restarts"] == 1 and s["updates_lost"] == 0
    assert s["updates_per_shard"] == [120, 120]  # every push reached both shards once, the killed one included
    assert torch.isfinite(res.flat_params).all()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_shard_that_lost_its_streams_is_served_through_the_object_store(two_nodes, toy_data):
    """Shard 1 forgets its streams mid-run: the replica's next stream call to it fails there (no such stream),
    is sent again the object store's way, and that shard stays on the object store; the run ends normally with
    every push applied once."""
    forgot = []

    def forget_streams(actor) -> int:  # (in the shard's actor; defined here so that Ray ships it by value)
        n = len(actor._streams)
        actor._streams.clear()
        return n

    def forget(trainer, _record):
        if not forgot:
            forgot.append(ray.get(trainer.shards[1].handle.__ray_call__.remote(forget_streams), timeout=30))

    res = _train(two_nodes, toy_data, True, max_steps=100, eval_every_seconds=0.2,
                 hooks=Faults(on_evaluation=forget))
    s = res.summary
    assert forgot == [1]  # the replica's one stream to shard 1
    assert s["replica_transports"] == {"stream (1 of 2 shards)": 1}
    assert s["updates_per_shard"] == [100, 100] and s["steps_per_replica"] == [100]
