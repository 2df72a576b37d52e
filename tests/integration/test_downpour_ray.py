"""Downpour on real Ray actors (one local Ray instance: ``ray_local`` in tests/conftest.py)."""

import json

import numpy as np
import pytest
import torch

from distbelief import RunConfig, train
from distbelief.api import train_task
from distbelief.testing import Faults
from tests.conftest import make_odd_model
from tests.integration.test_downpour_inprocess import check_run_dir

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


def test_ray_mnist1d_two_replicas_two_shards_adagrad_reaches_80_percent(tmp_path):
    cfg = RunConfig(runtime="ray", replicas=2, shards=2, optimizer="adagrad", lr=0.05, batch_size=128,
                    max_seconds=120, target_accuracy=0.80, eval_every_seconds=1, out=str(tmp_path / "run"))
    train_task(cfg, quiet=True)
    summary, _ = check_run_dir(tmp_path / "run", "downpour")
    assert summary["runtime"] == "ray"
    # an evaluation crossed the target and stopped the run; the final evaluation comes after the replicas'
    # last in-flight pushes, so it may sit a few test frames either side of the crossing
    assert summary["stop_reason"] == "target accuracy reached"
    assert summary["best_test_accuracy"] >= 0.80
    assert summary["final_test_accuracy"] >= 0.78
    assert summary["staleness_mean"] > 0 and summary["staleness_max"] >= 1  # two async replicas: some staleness


# One case on Ray actors; tests/unit/test_downpour_oracles.py runs more in-process.
@pytest.mark.parametrize("replicas,steps,push_every", [(3, 8, 2)])
def test_ray_each_shard_applies_exactly_R_S_over_n_updates(toy_data, replicas, steps, push_every):
    res = train(make_odd_model, toy_data[0], toy_data[1], quiet=True, runtime="ray", replicas=replicas, shards=3,
                max_steps=steps, push_every=push_every, max_seconds=0, eval_every_seconds=3600, batch_size=8)
    assert res.summary["updates_per_shard"] == [replicas * steps // push_every] * 3
    assert res.summary["examples"] == replicas * steps * 8


def test_ray_one_replica_matches_inprocess_exactly(toy_data):
    """Per-caller ordering on a shard actor makes the 1-replica run deterministic: Ray == in-process."""
    kw = dict(quiet=True, replicas=1, shards=2, max_steps=15, max_seconds=0, eval_every_seconds=3600,
              batch_size=8, optimizer="adagrad", lr=0.05, overlap=True)
    a = train(make_odd_model, toy_data[0], toy_data[1], runtime="ray", **kw)
    b = train(make_odd_model, toy_data[0], toy_data[1], runtime="inprocess", **kw)
    assert torch.equal(a.flat_params, b.flat_params)  # the same arithmetic in the same order: the same bits


def test_ray_replica_process_killed_mid_run_is_restarted_and_the_run_reaches_its_target(tmp_path):
    cfg = RunConfig(runtime="ray", replicas=2, shards=2, max_seconds=90, target_accuracy=0.72,
                    eval_every_seconds=1, batch_size=64, out=str(tmp_path / "run"))
    res = train_task(cfg, quiet=True, hooks=Faults(kill_replica_at_step=40, kill_replica_id=1))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary == res.summary
    assert summary["replica_restarts"] == 1 and summary["replicas_lost"] == 0
    killed = next(e for e in summary["events"] if e["event"] == "replica killed")
    restarted = next(e for e in summary["events"] if e["event"] == "replica restarted")
    assert killed["id"] == restarted["id"] == 1 and restarted["wall_s"] > killed["wall_s"]
    # the target came after the kill: the run went on through it
    assert summary["stop_reason"] == "target accuracy reached"
    assert summary["best_test_accuracy"] >= 0.72 and summary["time_to_target_s"] > killed["wall_s"]


def _shm_files(prefix):
    import glob

    return glob.glob(f"/dev/shm/{prefix}-*")


def test_ray_shared_memory_plane_equals_the_object_store_path_bit_for_bit(toy_data):
    """Same replica, same data order: pushes the replica applies to the shards' shared memory itself (co-located
    updates, the default on one machine), pushes and fetches through /dev/shm buffers, and through the object
    store all give exactly the same parameters; the runtime removes its files at shutdown."""
    from distbelief.runtime.ray_runtime import RayRuntime

    kw = dict(quiet=True, replicas=1, shards=2, max_steps=20, max_seconds=0, eval_every_seconds=3600,
              batch_size=8, optimizer="adagrad", lr=0.05, overlap=True, push_every=2)
    results, prefixes = [], []
    for use_shm, colocate in ((True, True), (True, False), (False, False)):
        rt = RayRuntime(use_shm=use_shm, colocate=colocate)
        prefixes.append(rt.shm_prefix)
        try:
            results.append(train(make_odd_model, toy_data[0], toy_data[1], runtime=rt, **kw))
            if use_shm:  # the replica really used the plane: its 3 buffers (+ 3 files per shared shard) exist
                assert len(_shm_files(rt.shm_prefix)) == 3 + 3 * 2 * colocate
        finally:
            rt.shutdown()
    assert prefixes[0] and prefixes[1] and prefixes[2] is None
    assert not _shm_files(prefixes[0]) and not _shm_files(prefixes[1])
    assert [r.summary["replicas_colocated"] for r in results] == [1, 0, 0]
    assert [r.summary["replica_transports"] for r in results] == [{"colocated": 1}, {"shared-memory": 1}, {"object-store": 1}]
    assert torch.equal(results[0].flat_params, results[1].flat_params)
    assert torch.equal(results[0].flat_params, results[2].flat_params)
    for r in results:
        assert r.summary["updates_per_shard"] == [10] * 2


def test_a_new_runtime_removes_the_buffers_of_a_killed_driver():
    """A driver killed with SIGKILL cannot remove its /dev/shm files; the next runtime on the machine does (the
    prefix names the dead pid). Files of live processes are left alone."""
    import subprocess
    import sys

    from distbelief.runtime import shm
    from distbelief.runtime.ray_runtime import RayRuntime

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_prefix = f"distbelief-{int(dead.stdout)}-0badc0de"
    live_prefix = shm.new_prefix()  # this process's pid: alive
    for prefix in (dead_prefix, live_prefix):
        shm.create(f"/dev/shm/{prefix}-r0-1-fetch", 4)
    rt = RayRuntime()
    try:
        assert not _shm_files(dead_prefix) and len(_shm_files(live_prefix)) == 1
    finally:
        rt.shutdown()
        shm.remove_all(live_prefix)


def test_fused_push_fetch_loop_equals_separate_calls_bit_for_bit(toy_data):
    """Fetch before every step and push after it (no prefetch): through /dev/shm each step's push and the next
    fetch are one call per shard and the model computes in the shared buffers; the in-process runtime sends them
    as two calls (a push, then a fetch). With one replica both give exactly the same parameters."""
    from distbelief.runtime.ray_runtime import RayRuntime

    kw = dict(quiet=True, replicas=1, shards=3, max_steps=20, max_seconds=0, eval_every_seconds=3600,
              batch_size=8, optimizer="adagrad", lr=0.05, overlap=False, push_every=1, fetch_every=1)
    rt = RayRuntime(use_shm=True, colocate=False)  # the fused call to the shard's process
    try:
        fused = train(make_odd_model, toy_data[0], toy_data[1], runtime=rt, **kw)
        assert rt.shm_prefix and len(_shm_files(rt.shm_prefix)) == 3  # the shared-memory plane carried it
    finally:
        rt.shutdown()
    rt = RayRuntime(use_shm=True)  # the default on one machine: the replica applies the update itself
    try:
        colocated = train(make_odd_model, toy_data[0], toy_data[1], runtime=rt, **kw)
    finally:
        rt.shutdown()
    separate = train(make_odd_model, toy_data[0], toy_data[1], runtime="inprocess", **kw)
    assert torch.equal(fused.flat_params, separate.flat_params)
    assert torch.equal(colocated.flat_params, separate.flat_params)
    assert colocated.summary["replicas_colocated"] == 1 and colocated.summary["push_fetch_calls"] == 19
    assert fused.summary["updates_per_shard"] == separate.summary["updates_per_shard"] == [20] * 3
    # every push but the last went with the next fetch; only the shared-memory replica computed in place
    assert fused.summary["push_fetch_calls"] == separate.summary["push_fetch_calls"] == 19
    assert fused.summary["replicas_zero_copy"] == 1 and separate.summary["replicas_zero_copy"] == 0


def test_ray_shared_memory_plane_survives_a_shard_kill(toy_data, tmp_path):
    """A push waiting on a dead shard is re-sent to its replacement, which maps the same replica buffer — here
    (--durability replicate) the shard's backup, which read every forwarded push from the same buffers. (A shard
    restored from its log on Ray: test_node_loss.py; in process, bit for bit: test_durability.py.)"""
    compared = []

    def primary_equals_backup(trainer, record):
        """While the replicas hold still for an evaluation, each backup is its primary, bit for bit."""
        srv, rt = trainer.server, trainer.runtime
        if all(b is not None for b in srv.backups):
            for p, b in zip(srv.roles, srv.backups):
                (pv, pver), (bv, bver) = (rt.call(r, "fetch").result(30) for r in (p, b))
                compared.append(pver == bver and np.array_equal(pv, bv))

    res = train(make_odd_model, toy_data[0], toy_data[1], quiet=True, runtime="ray", replicas=1, shards=2,
                max_steps=300, max_seconds=0, eval_every_seconds=0.5, batch_size=8,
                hooks=Faults(kill_shard_at_step=80, kill_shard_id=1, on_evaluation=primary_equals_backup),
                durability="replicate", out=str(tmp_path / "run"))
    s = res.summary
    assert s["shard_restarts"] == 1 and s["updates_lost"] == 0
    assert s["replicas_zero_copy"] == 1 and s["replicas_colocated"] == 0  # the shm data plane, via the shards
    assert torch.isfinite(res.flat_params).all()
    # every push reaches both shards exactly once, the killed one included
    assert s["updates_per_shard"] == [300, 300]
    assert s["backups_replaced"] == 1 and not (tmp_path / "run" / "checkpoints").exists()
    assert compared and all(compared), compared
