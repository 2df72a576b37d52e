"""Bytes accounting on a ParameterShard: exact oracles for what pushes deliver and fetches serve."""

import numpy as np
import pytest

from distbelief.ps.optimizers import SGD
from distbelief.ps.shard import Durability, ParameterShard

LO, HI, TOTAL = 10, 20, 30  # the shard owns 10 of 30 parameters
M = HI - LO


def make_shard(durability=None):
    return ParameterShard(0, LO, HI, np.zeros(M, np.float32), SGD(lr=0.1), TOTAL, durability)


@pytest.mark.parametrize("n", [1, 7])
def test_n_pushes_of_our_slice_count_4_n_m_bytes(n):
    s = make_shard()
    for _ in range(n):
        s.push(0, np.ones(M, np.float32), LO, s.version)
    assert s.stats()["bytes_pushed"] == 4 * n * M
    assert s.stats()["bytes_fetched"] == 0


def test_a_whole_vector_push_counts_only_the_range_read():
    # On one Ray node every shard maps the same whole-vector buffer and reads its own range.
    s = make_shard()
    for _ in range(3):
        s.push(0, np.ones(TOTAL, np.float32), 0, s.version)
    s.push(0, np.ones(5, np.float32), 17, s.version)  # [17, 22): we own 17, 18, 19
    assert s.bytes_pushed == 4 * (3 * M + 3)


def test_pushes_never_read_are_not_counted_non_finite_ones_are():
    s = make_shard()
    s.push(0, np.ones(TOTAL + 1, np.float32), 0, 0)  # past the model's end: rejected before reading
    s.push(0, np.ones(TOTAL, np.float64), 0, 0)  # wrong dtype: rejected before reading
    s.push(0, np.ones(5, np.float32), 0, 0)  # [0, 5): no intersection with our range
    assert s.bytes_pushed == 0
    bad = np.ones(M, np.float32)
    bad[3] = np.nan
    s.push(0, bad, LO, 0)  # read, then rejected
    assert s.bytes_pushed == 4 * M and s.rejected_pushes == 3
    s.push(0, np.ones(M, np.float32), LO, 0, session=5, seq=1)
    s.push(0, np.ones(M, np.float32), LO, 0, session=5, seq=1)  # a re-sent duplicate is skipped unread
    assert s.bytes_pushed == 2 * 4 * M and s.duplicate_pushes == 1


def test_sync_apply_mean_counts_each_gradient_slice():
    s = make_shard()
    s.apply_mean(*[np.ones(TOTAL, np.float32) for _ in range(4)])
    s.apply_mean(np.ones(TOTAL, np.float32), np.ones(TOTAL, np.float32))
    assert s.bytes_pushed == 4 * (4 + 2) * M


def test_sync_apply_mean_of_ranges_at_their_offset_is_the_mean_of_the_whole_vectors():
    """The runtime sends each shard only its range of every gradient (``offset``): the same update, the same bytes,
    as the full-length vectors; a range that does not cover the shard's is refused."""
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(TOTAL).astype(np.float32) for _ in range(3)]
    whole, ranged = make_shard(), make_shard()
    whole.apply_mean(*grads)
    ranged.apply_mean(*[g[LO:HI] for g in grads], offset=LO)
    assert np.array_equal(whole.fetch(0)[0], ranged.fetch(0)[0]) and whole.bytes_pushed == ranged.bytes_pushed
    ranged.apply_mean(grads[0][LO + 1:HI], offset=LO + 1)  # starts inside our range
    ranged.apply_mean(grads[0][LO - 1:HI - 1], offset=LO - 1)  # ends before ours does
    assert ranged.rejected_pushes == 2 and ranged.version == 1


def test_fetches_count_the_bytes_served():
    s = make_shard()
    for _ in range(5):
        s.fetch(0)
    assert s.bytes_fetched == 4 * 5 * M
    s.fetch_range(0, 15, 1)  # overlap [10, 15): 5 values
    s.fetch_range(0, 10, 1)  # no overlap: nothing served
    s.fetch_range(12, 40, 1)  # overlap [12, 20): 8 values
    assert s.bytes_fetched == 4 * (5 * M + 5 + 8)
    assert s.bytes_pushed == 0


def test_byte_counters_survive_a_checkpoint_restore(tmp_path):
    d = Durability(str(tmp_path), every_seconds=0, wal=False)
    s = make_shard(d)
    for _ in range(4):
        s.push(0, np.ones(M, np.float32), LO, s.version)
        s.fetch(0)
    s.checkpoint()
    r = ParameterShard.restore(0, LO, HI, SGD(lr=0.1), TOTAL, d)
    assert (r.bytes_pushed, r.bytes_fetched) == (4 * 4 * M, 4 * 4 * M)
