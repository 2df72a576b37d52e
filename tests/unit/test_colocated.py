"""Co-located updates (ps/colocated.py): a replica applies its push to a shared shard's memory itself.

Oracles: the update is exactly the one the shard's own push would apply; the shard's process sees it (parameters,
optimizer state, counters); the lock excludes another process and is released when its holder dies."""

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
import torch

from distbelief.exceptions import RemoteTimeoutError
from distbelief.ps.checkpoint import latest_good_checkpoint
from distbelief.ps.colocated import ColocatedShard
from distbelief.ps.sharedmem import ShardLock
from distbelief.ps.optimizers import Adagrad
from distbelief.ps.shard import Durability, ParameterShard

TOTAL = 50
LO, HI = 10, 30


def shard(durability=None):
    return ParameterShard(1, LO, HI, np.linspace(-1, 1, HI - LO, dtype=np.float32), Adagrad(lr=0.1), TOTAL,
                          durability)


def pushes(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(TOTAL).astype(np.float32) for _ in range(n)]


def test_a_colocated_push_is_the_shards_own_push_bit_for_bit(tmp_path):
    owner, reference = shard(), shard()
    descriptor = owner.share(str(tmp_path / "run"))
    assert owner.share(str(tmp_path / "run")) is descriptor  # idempotent: every replica maps the same state
    col = ColocatedShard(descriptor)
    out = np.zeros(TOTAL, dtype=np.float32)
    for k, g in enumerate(pushes(6)):
        based_on = max(0, k - 1)  # one step stale
        v, fetched, _ = col.push_fetch(g, based_on, 8, out)
        assert v == fetched == reference.push(0, g, 0, based_on, 8) == k + 1
        np.testing.assert_array_equal(out[LO:HI], reference.fetch()[0])
    # the shard's process sees every update and counter the replica made
    np.testing.assert_array_equal(owner.fetch()[0], reference.fetch()[0])
    torch.testing.assert_close(owner.opt_state["sum_sq"], reference.opt_state["sum_sq"], rtol=0, atol=0)
    st, ref = owner.stats(), reference.stats()
    for key in ("updates", "examples", "staleness_sum", "staleness_max", "staleness_count", "bytes_pushed"):
        assert st[key] == ref[key], key
    assert st["updates"] == 6 and st["staleness_sum"] == 5 and col.acked == 6
    assert out[:LO].sum() == 0 and out[HI:].sum() == 0  # only the shard's own range is written


def test_a_non_finite_colocated_push_is_rejected_and_counted(tmp_path):
    owner = shard()
    col = ColocatedShard(owner.share(str(tmp_path / "run")))
    before = owner.fetch()[0]
    g = pushes(1)[0]
    g[LO + 3] = np.nan
    v, _, _ = col.push_fetch(g, 0, 8, None)
    assert v == 0 and owner.stats()["rejected_pushes"] == 1 and col.acked == 0
    np.testing.assert_array_equal(owner.fetch()[0], before)


def test_shards_that_cannot_be_shared_say_so(tmp_path):
    logged = shard(Durability(str(tmp_path / "ck"), every_seconds=0, wal=True))
    assert logged.share(str(tmp_path / "a")) is None  # each push must be logged by the shard's process
    vectors_only = ParameterShard(0, 0, 10, np.zeros(10, dtype=np.float32), None, 10)
    assert vectors_only.share(str(tmp_path / "b")) is None


def test_a_due_snapshot_is_claimed_once_and_written_by_the_shards_process(tmp_path):
    owner = shard(Durability(str(tmp_path / "ck"), every_updates=3, every_seconds=0, wal=False))
    col = ColocatedShard(owner.share(str(tmp_path / "run")))
    claims = [col.push_fetch(g, k, 8, None)[2] for k, g in enumerate(pushes(5))]
    assert claims == [False, False, True, False, False]  # due at 3 updates; claimed once until taken
    assert owner.request_snapshot()
    owner.flush()
    ck = latest_good_checkpoint(str(tmp_path / "ck"), 1)
    assert ck.meta["version"] == 5 and owner.stats()["snapshot_version"] == 5
    np.testing.assert_array_equal(ck.tensors["params"].numpy(), owner.fetch()[0])
    # the cadence restarted at the snapshot: due again 3 updates later
    claims = [col.push_fetch(g, 5 + k, 8, None)[2] for k, g in enumerate(pushes(3, seed=1))]
    assert claims == [False, False, True]


def _hold(path, ready, hold_s):
    lock = ShardLock(path)
    lock.acquire()
    ready.set()
    time.sleep(hold_s)
    os._exit(0)  # dies holding it: the kernel releases it


def test_the_lock_excludes_another_process_and_dies_with_its_holder(tmp_path):
    owner = shard()
    descriptor = owner.share(str(tmp_path / "run"))
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold, args=(descriptor["lock"], ready, 60))
    holder.start()
    try:
        assert ready.wait(30)
        lock = ShardLock(descriptor["lock"])
        with pytest.raises(RemoteTimeoutError, match="held for more than"):
            lock.acquire(timeout_s=0.2)
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(30)
        lock.acquire(timeout_s=10)  # released by the holder's death
        lock.acquire()  # re-entrant within this thread
        lock.release()
        lock.release()
    finally:
        if holder.is_alive():
            holder.kill()
    # the owner can take it again: nobody holds it
    v, _, _ = ColocatedShard(descriptor).push_fetch(pushes(1)[0], 0, 8, None)
    assert v == 1


def test_a_restarted_shard_removes_the_state_its_dead_predecessor_shared(tmp_path):
    base = str(tmp_path / "run")
    old = shard().share(base)
    other = ParameterShard(2, 30, 50, np.zeros(20, dtype=np.float32), Adagrad(lr=0.1), TOTAL).share(base)
    col = ColocatedShard(old)  # a replica still mapping the old state keeps working on it until it switches
    new = shard().share(base)  # the replacement of shard 1
    assert all(not os.path.exists(p) for p, _, _ in old["files"].values())
    assert all(os.path.exists(p) for d in (new, other) for p, _, _ in d["files"].values())
    assert col.push_fetch(pushes(1)[0], 0, 8, None)[0] == 1
