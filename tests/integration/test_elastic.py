"""Elastic Downpour (--replicas MIN:MAX): replicas added as CPUs appear and removed as their node goes, on a fake
multi-node Ray cluster, with nothing else restarted; and the settings."""

import pytest
import ray

from distbelief import RunConfig
from distbelief.api import train_task
from distbelief.config import config_from
from distbelief.downpour.elastic import ElasticPlan
from distbelief.exceptions import ConfigError
from distbelief.runtime.local_cluster import fake_cluster
from distbelief.runtime.ray_runtime import SYSTEM_CONFIG, RayRuntime
from distbelief.testing import Faults


def test_min_max_parses_and_is_checked():
    cfg = config_from({"replicas": "2:5"}).validate()
    assert (cfg.replicas, cfg.max_replicas) == (2, 5)
    assert config_from({"replicas": "3"}).max_replicas == 0
    with pytest.raises(ConfigError, match="MIN <= MAX"):
        config_from({"replicas": "4:2"}).validate()
    with pytest.raises(ConfigError, match="elastic"):
        config_from({"replicas": "1:3", "strategy": "sync"}).validate()
    with pytest.raises(ConfigError, match="replicas"):
        config_from({"replicas": "1:x"})


def test_plan_fills_free_cpus_between_min_and_max():
    plan = ElasticPlan(2, 4)
    assert plan.initial(0) == 2 and plan.initial(3) == 3 and plan.initial(9) == 4 and plan.initial(None) == 4
    assert plan.to_add(active=2, free_slots=1, ceiling=4) == 1
    assert plan.to_add(active=2, free_slots=5, ceiling=4) == 2
    assert plan.to_add(active=3, free_slots=5, ceiling=3) == 0  # a replica used up its restarts
    assert plan.to_add(active=4, free_slots=None, ceiling=4) == 0
    assert plan.can_restart(1) and not plan.can_restart(0) and plan.can_restart(None)


@pytest.mark.ray
@pytest.mark.slow
def test_replicas_join_as_a_node_arrives_and_leave_with_it_while_the_run_goes_on(tmp_path):
    """One 1-CPU node: the run starts with 1 replica of 1:3. At the first evaluation a 2-CPU node joins: two
    replicas are added there and push. Once both have pushed, that node is removed: its replicas fail, find no
    free CPU and are removed; replica 0 and the shards go on untouched (no restart, no checkpoint read)."""
    c = fake_cluster(num_cpus=0, _system_config=SYSTEM_CONFIG)
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="ERROR")
    seen = {}

    def probe(trainer, record):
        if "joined" not in seen:
            seen["joined"] = c.add_node(num_cpus=2)
            c.wait_for_nodes()
            return
        if "removed" not in seen and len(trainer.first_push_s) == 2:
            seen["removed"] = True
            seen["steps_before"] = trainer.replicas[0].steps
            c.remove_node(seen["joined"])
            return
        removed = sum(e["event"] == "replica removed" for e in trainer.events)
        if removed == 2 and trainer.replicas[0].steps > seen["steps_before"]:
            trainer.request_stop("the node came and went")  # what the test waits for happened: no time budget

    runtime = RayRuntime(remote_timeout_s=60)
    cfg = RunConfig(runtime="ray", replicas=1, max_replicas=3, shards=2, batch_size=32, max_seconds=120,
                    eval_every_seconds=1.0, durability="off", out=str(tmp_path / "run"))
    try:
        s = train_task(cfg, quiet=True, runtime=runtime, hooks=Faults(on_evaluation=probe)).summary
    finally:
        runtime.shutdown()
        ray.shutdown()
        c.shutdown()
    assert s["stop_reason"] == "the node came and went"
    kinds = [e["event"] for e in s["events"]]
    assert kinds.count("replica added") == 2 and kinds.count("replica first push") == 2
    assert seen.get("removed"), "the joined node was never removed"
    assert kinds.count("replica removed") == 2 and s["replicas_removed"] == 2
    assert s["max_replicas"] == 3 and len(s["replica_first_push_s"]) == 2
    assert s["shard_restarts"] == 0 and s["replica_restarts"] == 0  # nothing else restarted
    assert len(s["steps_per_replica"]) == 3
    assert s["steps_per_replica"][0] > seen["steps_before"]  # replica 0 went on after the node left
    added = [e for e in s["events"] if e["event"] == "replica added"]
    assert {e["id"] for e in added} == {1, 2}
