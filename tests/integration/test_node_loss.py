"""Node loss on a fake multi-node Ray cluster: the node hosting a shard and replicas is removed mid-run."""

import pytest
import ray
from ray.cluster_utils import Cluster

from distbelief import RunConfig
from distbelief.api import train_task
from distbelief.runtime.ray_runtime import SHARD_NODE_RESOURCE, SYSTEM_CONFIG, RayRuntime
from distbelief.testing import Faults

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": SYSTEM_CONFIG})
    # Shards go to nodes offering the dedicated-shard resource (spread one per node), so not to the head.
    nodes = [c.add_node(num_cpus=2, resources={SHARD_NODE_RESOURCE: 1}) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="ERROR")
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def test_losing_the_node_of_a_shard_and_replicas_the_run_still_reaches_its_target(cluster, tmp_path):
    c, nodes = cluster
    removed = {}

    def remove_node_of_a_shard_and_a_replica(trainer, record):
        if removed:  # the first evaluation: early in the run, whatever this machine's speed
            return
        rt = trainer.runtime
        shard_nodes = {rt.node_of(s) for s in trainer.shards}
        replica_nodes = [rt.node_of(r.role) for r in trainer.replicas.values()]
        node = next(n for n in nodes if n.node_id in shard_nodes and n.node_id in replica_nodes)
        removed.update(node=node.node_id, wall_s=record["wall_s"], replicas=replica_nodes.count(node.node_id),
                       shards=sum(rt.node_of(s) == node.node_id for s in trainer.shards))
        c.remove_node(node)
        nodes.append(c.add_node(num_cpus=2, resources={SHARD_NODE_RESOURCE: 1}))  # capacity comes back, as an
        # autoscaler would bring it

    # The two shards are spread over the two worker nodes (one each) and the 3 replicas fill their 4 CPUs, so the
    # node removed necessarily hosts a shard and a replica.
    # Target 0.75 (chance is 0.1), reached only after the loss: the node goes at the first evaluation (1 s of
    # training), and 3 replicas reached 0.65 only at 3 s (evaluation paused, 2026-12-04), 0.75 takes several times
    # that, plus the ~10 s the node's loss costs (actors failing, a new node's workers starting, the shard restored
    # from its checkpoint + log).
    runtime = RayRuntime(remote_timeout_s=120)
    cfg = RunConfig(runtime="ray", replicas=3, shards=2, batch_size=128, max_seconds=150, target_accuracy=0.75,
                    eval_every_seconds=1.0, checkpoint_every_seconds=1, durability="log", out=str(tmp_path / "run"))
    try:
        res = train_task(cfg, quiet=True, runtime=runtime,
                         faults=Faults(on_evaluation=remove_node_of_a_shard_and_a_replica))
    finally:
        runtime.shutdown()
    s = res.summary
    assert removed, "the node was never removed"
    assert removed["shards"] >= 1 and removed["replicas"] >= 1
    assert s["shard_restarts"] == removed["shards"] and s["updates_lost"] == 0
    assert s["replica_restarts"] == removed["replicas"] and s["replicas_lost"] == 0
    assert s["stop_reason"] == "target accuracy reached" and s["best_test_accuracy"] >= 0.75
    assert s["time_to_target_s"] > removed["wall_s"]  # the target was reached after the loss, not before
