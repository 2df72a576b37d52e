"""Placement on Ray: oversubscribed local runs, the capacity check of a joined cluster, shards spread over the
nodes of a (fake, ``ray.cluster_utils.Cluster``) multi-node cluster, each receiving only its own slice of every
push, and synchronous steps whose gradients go from replica to shard without the driver holding them."""

import pytest
import ray
import torch

from distbelief import RunConfig, train
from distbelief.api import train_task
from distbelief.exceptions import ConfigError
from distbelief.ps.sharding import ShardLayout
from distbelief.runtime.local_cluster import fake_cluster
from distbelief.runtime.ray_runtime import (
    SHARD_NODE_RESOURCE,
    SYSTEM_CONFIG,
    RayRuntime,
    connect,
    started_locally,
)
from distbelief.testing import Faults
from tests.conftest import make_odd_model

pytestmark = [pytest.mark.ray]

OVERSUBSCRIBED = "running oversubscribed"


@pytest.fixture
def two_core_ray():
    """Our own local Ray with 2 logical CPUs (a laptop's), whatever this machine has."""
    ray.shutdown()
    connect(num_cpus=2)
    assert started_locally()
    yield
    ray.shutdown()


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if OVERSUBSCRIBED in line]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_four_replicas_on_two_cores_run_oversubscribed_with_one_warning(two_core_ray, toy_data, capsys):
    res = train(make_odd_model, toy_data[0], toy_data[1], runtime="ray", replicas=4, shards=2, max_steps=3,
                max_seconds=0, eval_every_seconds=3600, batch_size=8)
    assert res.summary["steps_per_replica"] == [3] * 4
    lines = _warnings(capsys.readouterr().err)
    assert len(lines) == 1 and "4 replicas on 2 cores" in lines[0], lines


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_replicas_of_two_partitions_on_two_cores_run_oversubscribed(two_core_ray, capsys):
    cfg = RunConfig(runtime="ray", model="lc1d", replicas=2, partitions=2, shards=2, num_samples=2000,
                    batch_size=32, max_steps=3, max_seconds=0, eval_every_seconds=3600)
    res = train_task(cfg)
    assert res.summary["partitions"] == 2 and res.summary["steps_per_replica"] == [3, 3]
    lines = _warnings(capsys.readouterr().err)
    assert len(lines) == 1 and "2 replicas x 2 partitions on 2 cores" in lines[0], lines


# ---------------------------------------------------------------- a joined cluster keeps its capacity check
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_joined_cluster_refuses_more_replicas_than_it_has_cpus(toy_data):
    ray.shutdown()
    c = fake_cluster(num_cpus=1)
    try:
        runtime = RayRuntime(address=c.address)
        assert not started_locally()
        with pytest.raises(ConfigError) as e:
            train(make_odd_model, toy_data[0], toy_data[1], runtime=runtime, replicas=2, shards=1, max_steps=2,
                  max_seconds=0, eval_every_seconds=3600, batch_size=8)
        assert e.value.field == "replicas"
        assert not runtime._actors  # refused before any worker started
        runtime.shutdown()
    finally:
        ray.shutdown()
        c.shutdown()


# ---------------------------------------------------------------- a 3-node cluster
@pytest.fixture(scope="module")
def three_nodes():
    """Head (1 CPU, the driver's node) + 2 workers (2 CPUs each)."""
    ray.shutdown()
    c = fake_cluster(num_cpus=1, _system_config=SYSTEM_CONFIG)
    for _ in range(2):
        c.add_node(num_cpus=2)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


def _run_on(cluster, strategy: str, toy_data, steps: int):
    """A 2-replica x 3-shard run on ``cluster``. Returns its result and, read from the shards once it ended (they
    live until the runtime shuts down): each shard's node, stats, and bytes of array arguments received."""
    runtime = RayRuntime(address=cluster.address, remote_timeout_s=60)
    seen = {}
    try:
        res = train(make_odd_model, toy_data[0], toy_data[1], runtime=runtime, strategy=strategy, replicas=2,
                    shards=3, max_steps=steps, max_seconds=0, eval_every_seconds=0.01, batch_size=8, lr=0.1,
                    optimizer="sgd", quiet=True,
                    hooks=Faults(on_evaluation=lambda trainer, _: seen.setdefault("trainer", trainer)))
        shards = seen["trainer"].shards
        placed = {"nodes": [runtime.node_of(s) for s in shards],
                  "stats": [runtime.call(s, "stats").result(30) for s in shards],
                  "received": [runtime.bytes_received(s) for s in shards]}
    finally:
        runtime.shutdown()
    return res, placed


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_downpour_shards_spread_over_three_nodes_each_receiving_only_its_slice(three_nodes, toy_data):
    steps = 6
    res, placed = _run_on(three_nodes, "downpour", toy_data, steps)
    assert len(set(placed["nodes"])) == 3, placed  # one shard per node
    total = res.summary["num_parameters"]
    layout = ShardLayout.balanced(total, 3)
    pushes = 2 * steps  # push_every = 1
    assert res.summary["updates_per_shard"] == [pushes] * 3
    for k in range(3):
        lo, hi = layout.range(k)
        assert placed["stats"][k]["bytes_pushed"] == (hi - lo) * 4 * pushes
        # and only that reached its process: its slice of each push, never the whole vector
        assert placed["received"][k] == (hi - lo) * 4 * pushes, (k, placed["received"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sync_on_three_nodes_matches_inprocess_and_shards_receive_slice_x_replicas(three_nodes, toy_data,
                                                                                    monkeypatch):
    steps = 4
    parts, fetched = set(), []  # the gradient parts made by sync_step; those the driver ever fetched
    real_split, real_get = RayRuntime.call_split, ray.get

    def split(self, *args):
        f = real_split(self, *args)
        parts.update(f.refs[:-1])
        return f

    def get(refs, *args, **kwargs):
        fetched.extend(r for r in (refs if isinstance(refs, list) else [refs]) if r in parts)
        return real_get(refs, *args, **kwargs)

    monkeypatch.setattr(RayRuntime, "call_split", split)
    monkeypatch.setattr(ray, "get", get)
    res, placed = _run_on(three_nodes, "sync", toy_data, steps)
    monkeypatch.undo()
    assert len(parts) == 3 * 2 * steps and not fetched  # the driver never held a gradient
    assert len(set(placed["nodes"])) == 3, placed
    layout = ShardLayout.balanced(res.summary["num_parameters"], 3)
    for k in range(3):
        lo, hi = layout.range(k)
        assert placed["stats"][k]["bytes_pushed"] == (hi - lo) * 4 * 2 * steps  # its slice x 2 replicas, per step
        assert placed["received"][k] == (hi - lo) * 4 * 2 * steps, (k, placed["received"])  # and only that arrived
    ref = train(make_odd_model, toy_data[0], toy_data[1], runtime="inprocess", strategy="sync", replicas=2,
                shards=3, max_steps=steps, max_seconds=0, eval_every_seconds=3600, batch_size=8, lr=0.1,
                optimizer="sgd", quiet=True)
    torch.testing.assert_close(res.flat_params, ref.flat_params, atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_shards_land_only_on_nodes_dedicated_to_them(toy_data):
    ray.shutdown()
    c = fake_cluster(num_cpus=2, _system_config=SYSTEM_CONFIG)
    dedicated = c.add_node(num_cpus=0, resources={SHARD_NODE_RESOURCE: 1})
    c.wait_for_nodes()
    try:
        runtime = RayRuntime(address=c.address, remote_timeout_s=60)
        nodes = {}

        def record(trainer, _record):
            nodes["shards"] = {runtime.node_of(s) for s in trainer.shards}

        try:
            train(make_odd_model, toy_data[0], toy_data[1], runtime=runtime, replicas=1, shards=2, max_steps=2,
                  max_seconds=0, eval_every_seconds=0.01, batch_size=8, hooks=Faults(on_evaluation=record), quiet=True)
        finally:
            runtime.shutdown()
        assert nodes["shards"] == {dedicated.node_id}
    finally:
        ray.shutdown()
        c.shutdown()
