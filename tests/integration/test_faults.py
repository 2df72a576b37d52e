"""Fault injection: a parameter shard's process is killed mid-run; the run goes on, losing no update with
``durability = "log"`` and exactly the updates since the last snapshot with the default ``"snapshot"``.

Shard kills on Ray are in test_downpour_ray.py (log mode, every push applied exactly once), test_durability.py
(snapshot mode with co-located updates), test_node_loss.py (a lost node; 20 failovers with replicate),
test_partition_faults.py (partitioned runs) and test_sandblaster_ray.py."""

import pytest

from distbelief.api import train_task
from tests.conftest import config_and_faults


def shard_kill_config(tmp_path, runtime, **kw):
    """``(config, faults)`` of a 2 x 2 run whose shard 1 is killed at step 40."""
    settings = dict(runtime=runtime, replicas=2, shards=2, batch_size=64, max_seconds=90, target_accuracy=0.78,
                    eval_every_seconds=2, kill_shard_at_step=40, kill_shard_id=1, checkpoint_every_seconds=1,
                    durability="log",
                    out=str(tmp_path / "run"))
    settings.update(kw)
    return config_and_faults(**settings)


def assert_recovered(summary, target=0.78):
    assert summary["shard_restarts"] == 1
    assert summary["updates_lost"] == 0
    # The run reached its target after the kill (final accuracy is measured a moment later and may wobble).
    assert summary["stop_reason"] == "target accuracy reached"
    assert summary["best_test_accuracy"] >= target and summary["time_to_target_s"] > 0
    # Every push went to both shards: with nothing lost or applied twice, their update counts agree.
    assert summary["updates_per_shard"][0] == summary["updates_per_shard"][1]
    assert summary["rejected_pushes"] == 0


@pytest.mark.slow
def test_inprocess_shard_killed_is_restored_from_checkpoint_and_log(tmp_path):
    cfg, faults = shard_kill_config(tmp_path, "inprocess", batch_size=32)
    res = train_task(cfg, quiet=True, hooks=faults)
    assert_recovered(res.summary)
    assert (tmp_path / "run" / "checkpoints" / "shard-001").is_dir()
