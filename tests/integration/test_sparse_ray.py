"""Embedding tables on real Ray actors: every data plane (co-located updates, /dev/shm buffers, the object store)
moves the same rows and gives exactly the in-process run's parameters."""

import pytest
import torch

from distbelief import train
from tests.unit.test_sparse_tables import BATCH, SEED, TinyCTR, ctr_data

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


def test_every_data_plane_serves_table_rows_bit_for_bit_as_in_process():
    from distbelief.runtime.ray_runtime import RayRuntime

    ds = ctr_data()
    kw = dict(quiet=True, replicas=1, shards=2, max_steps=20, max_seconds=0, eval_every_seconds=3600,
              batch_size=BATCH, seed=SEED, optimizer="adagrad", lr=0.05, overlap=True, push_every=2,
              durability="off")
    ref = train(TinyCTR, ds, ds, runtime="inprocess", **kw)
    results = []
    for use_shm, colocate in ((True, True), (True, False), (False, False)):
        rt = RayRuntime(use_shm=use_shm, colocate=colocate)
        try:
            results.append(train(TinyCTR, ds, ds, runtime=rt, **kw))
        finally:
            rt.shutdown()
    assert [r.summary["replicas_colocated"] for r in results] == [1, 0, 0]
    assert [r.summary["replica_transports"] for r in results] == [{"colocated": 1}, {"shared-memory": 1}, {"object-store": 1}]
    assert ref.summary["replica_transports"] == {"in-process": 1}
    for r in results:
        assert torch.equal(r.flat_params, ref.flat_params)
        assert r.summary["updates_per_shard"] == [10, 10]
        assert r.summary["rows_pushed"] == ref.summary["rows_pushed"] > 0


# replicate: the Ray link forwards rows to a backup actor (log is exact in process: test_table_durability.py)
@pytest.mark.parametrize("durability", ["replicate"])
def test_a_killed_table_shard_loses_no_update_on_ray(tmp_path, durability):
    """Shard 1's process killed at step 30: its backup (which received every push's rows, through the replica's
    shared-memory buffer for the dense part) or its snapshot plus log (every push's rows) brings it back with
    every update, and one replica's run ends bit for bit as the in-process run without the kill."""
    from distbelief.testing import Faults

    ds = ctr_data(n=1024)
    kw = dict(quiet=True, replicas=1, shards=2, max_steps=60, max_seconds=0, eval_every_seconds=3600,
              batch_size=BATCH, seed=SEED, optimizer="adagrad", lr=0.05, overlap=False, fetch_every=1,
              push_every=1, checkpoint_every_seconds=0, checkpoint_every_updates=20)
    ref = train(TinyCTR, ds, ds, runtime="inprocess", durability="off", **kw)
    res = train(TinyCTR, ds, ds, runtime="ray", durability=durability, out=str(tmp_path / "run"),
                hooks=Faults(kill_shard_at_step=30, kill_shard_id=1), **kw)
    s = res.summary
    assert s["shard_restarts"] == 1 and s["updates_lost"] == 0 and s["rows_pushed"] > 0
    assert s["updates_per_shard"] == [60, 60]
    assert torch.equal(res.flat_params, ref.flat_params)
