"""Embedding-table rows under ``--durability log`` and ``replicate``, without processes: the write-ahead log
records each push's rows with its dense part and replays them in order, bit for bit; a backup receives the
primary's rows and row state when attached and every push's rows after, so it is the primary bit for bit."""

import numpy as np
import pytest
import torch

from distbelief.ps.checkpoint import WriteAheadLog, shard_dir
from distbelief.ps.durability import Durability
from distbelief.ps.rules import make_rule
from distbelief.ps.shard import ParameterShard
from distbelief.ps.sharding import flatten
from distbelief.ps.slicer import Slicer
from distbelief.runtime.inprocess import InProcessRuntime
from tests.unit.test_sparse_tables import TinyCTR

SHARD, K = 1, 2


def table_shard(rule="adagrad", durability=None, staleness_aware=False, backup=False):
    """Shard 1 of 2 of TinyCTR (dense range and rows), as a run builds it; or, with ``backup``, its blank backup."""
    torch.manual_seed(0)
    model = TinyCTR()
    s = Slicer.for_model(model, K)
    full = flatten(model)
    lo, hi = s.range(SHARD)
    opt = make_rule(rule, lr=0.1, staleness_aware=staleness_aware)
    if backup:
        return s, ParameterShard.blank(SHARD, lo, hi, opt, s.total, s)
    return s, ParameterShard(SHARD, lo, hi, s.to_dense(full)[lo:hi].numpy(), opt, s.total, durability,
                             tables=(s, s.shard_rows(full, SHARD), None))


def table_pushes(s, n, seed=0):
    """``n`` pushes of the whole dense vector plus rows of shard 1 (some with none), varied staleness."""
    rng = np.random.default_rng(seed)
    local = s.groups[0].local_rows(SHARD, K)
    out = []
    for i in range(n):
        ids = np.unique(rng.integers(0, local, int(rng.integers(0, 12)))).astype(np.int64)
        rows = [(ids, rng.standard_normal((ids.size, 4)).astype(np.float32))] if ids.size else [None]
        out.append((rng.standard_normal(s.total).astype(np.float32), max(0, i - int(rng.integers(0, 4))), 16,
                    7, i + 1, rows))
    return out


def push_all(shard, todo):
    for g, based_on, n, session, seq, rows in todo:
        shard.push(0, g, 0, based_on, n, session, seq, rows=rows)


def assert_same_shard(a: ParameterShard, b: ParameterShard) -> None:
    assert a.version == b.version and a.examples == b.examples and a.last_seq == b.last_seq
    assert torch.equal(a.vectors["params"], b.vectors["params"])
    assert a.opt_state.keys() == b.opt_state.keys()
    assert all(torch.equal(a.opt_state[k], b.opt_state[k]) for k in a.opt_state if k != "tmp")
    for ta, tb in zip(a.tables, b.tables, strict=True):
        assert torch.equal(ta.weight, tb.weight)
        assert ta.state.keys() == tb.state.keys() and all(torch.equal(ta.state[k], tb.state[k]) for k in ta.state)


# ---------------------------------------------------------------------------------------------- the log
@pytest.mark.parametrize("rule,staleness_aware", [("adagrad", False), ("rowwise-adagrad", False),
                                                  ("adagrad", True), ("sgd", False)])
def test_the_log_replays_rows_bit_for_bit(tmp_path, rule, staleness_aware):
    """A snapshot after 5 pushes, 20 more in the log only: a restored shard is the shard that wrote them (rows,
    their state, the dense slice; with staleness-aware rates, which the log records)."""
    dur = Durability(str(tmp_path), every_updates=0, every_seconds=0, wal=True, background=False)
    s, shard = table_shard(rule, dur, staleness_aware)
    todo = table_pushes(s, 25)
    push_all(shard, todo[:5])
    shard.checkpoint()
    push_all(shard, todo[5:])
    lo, hi = s.range(SHARD)
    back = ParameterShard.restore(SHARD, lo, hi, shard.optimizer, s.total, dur, write_base=False,
                                  tables=(s, None, None))
    assert back.restored_from_version == 5 and back.replayed_updates == 20
    assert_same_shard(back, shard)


def test_log_records_carry_rows_and_a_torn_rows_record_is_ignored(tmp_path):
    dur = Durability(str(tmp_path), every_updates=0, every_seconds=0, wal=True, background=False)
    s, shard = table_shard("adagrad", dur)
    todo = table_pushes(s, 3, seed=3)
    push_all(shard, todo)
    records = list(WriteAheadLog(tmp_path, SHARD).replay(0))
    assert [r.version_after for r in records] == [1, 2, 3]
    for r, (g, _, n, session, seq, rows) in zip(records, todo):
        lo, hi = s.range(SHARD)
        assert np.array_equal(r.grad, g[lo:hi]) and (r.num_examples, r.session, r.seq) == (n, session, seq)
        if rows[0] is None:
            assert r.rows == []
        else:
            (group, ids, values), = r.rows
            assert group == 0 and np.array_equal(ids, rows[0][0]) and np.array_equal(values, rows[0][1])
    log = max(shard_dir(tmp_path, SHARD).glob("wal-*.log"))
    log.write_bytes(log.read_bytes()[:-5])  # the process died while writing the last record (its rows)
    assert [r.version_after for r in WriteAheadLog(tmp_path, SHARD).replay(0)] == [1, 2]


def test_a_log_of_rows_this_model_has_no_table_for_is_refused(tmp_path):
    dur = Durability(str(tmp_path), every_updates=0, every_seconds=0, wal=True, background=False)
    s, shard = table_shard("adagrad", dur)
    shard.checkpoint()
    wal = WriteAheadLog(tmp_path, SHARD)
    wal.start(0)
    lo, hi = s.range(SHARD)
    wal.append(1, 0, hi - lo, 1, np.zeros(hi - lo, np.float32),
               rows=[None, (np.array([0]), np.ones((1, 8), np.float32))])  # a second row group, of width 8
    wal.close()
    with pytest.raises(ValueError, match="row group 1"):
        ParameterShard.restore(SHARD, lo, hi, shard.optimizer, s.total, dur, write_base=False,
                               tables=(s, None, None))


# ---------------------------------------------------------------------------------------------- replication
@pytest.mark.parametrize("rule", ["adagrad", "rowwise-adagrad"])
def test_the_backup_equals_the_primary_bit_for_bit_after_every_push_with_rows(rule):
    rt = InProcessRuntime()
    s, p = table_shard(rule)
    todo = table_pushes(s, 30, seed=1)
    push_all(p, todo[:4])  # the backup is attached to a primary that has state already: it is copied whole
    _, blank = table_shard(rule, backup=True)
    assert not torch.equal(blank.tables[0].weight, p.tables[0].weight)
    primary = rt.create_shard(SHARD, lambda: p)
    backup = rt.create_backup(SHARD, lambda: blank, away_from=primary)
    p.attach_backup(rt.backup_link(backup))
    assert_same_shard(p, blank)
    for push in todo[4:]:
        push_all(p, [push])
        assert_same_shard(p, blank)  # at every acknowledgement, not only at the end
    assert p.stats()["has_backup"] and blank.rows_pushed > 0
