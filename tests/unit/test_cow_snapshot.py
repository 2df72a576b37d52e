"""Copy-on-write snapshots of a shard's tables (ps/cow.py) and the streamed checkpoint they are written with: the
file is the state at the snapshot's version, bit for bit, though pushes changed the rows while it was written;
and the shard does not keep a second copy of its tables."""

import threading

import numpy as np
import pytest
import torch

from distbelief.ps.checkpoint import load_checkpoint, save_checkpoint, save_checkpoint_streamed
from distbelief.ps.cow import TableSnapshot
from distbelief.ps.durability import Durability
from tests.unit.test_table_log_and_backup import SHARD, push_all, table_pushes, table_shard


def test_a_streamed_checkpoint_reads_back_as_the_whole_one(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"params": torch.randn(37, generator=g), "table.0.weight": torch.randn(1000, 3, generator=g),
               "table.0.opt.sum": torch.rand(1000, generator=g), "dedup.seqs": torch.arange(5, dtype=torch.int64)}
    meta = {"version": 7, "shard_id": 1, "lo": 0, "hi": 37}
    whole = save_checkpoint(tmp_path / "a", 1, meta, tensors)

    def pieces(name):  # uneven pieces along dim 0
        t = tensors[name]
        for lo in range(0, t.shape[0], 333):
            yield t[lo:lo + 333]

    streamed = save_checkpoint_streamed(tmp_path / "b", 1, meta, {n: (t.dtype, tuple(t.shape))
                                                                   for n, t in tensors.items()}, pieces)
    (m1, t1), (m2, t2) = load_checkpoint(whole), load_checkpoint(streamed)
    assert m1 == m2 == meta
    assert t1.keys() == t2.keys() == tensors.keys()
    assert all(torch.equal(t1[k], t2[k]) and torch.equal(t2[k], tensors[k]) for k in tensors)


def test_a_damaged_streamed_checkpoint_fails_its_checksum(tmp_path):
    from distbelief.ps.checkpoint import CorruptCheckpoint

    t = {"x": torch.arange(100, dtype=torch.float32)}
    p = save_checkpoint_streamed(tmp_path, 0, {"version": 1}, {"x": (torch.float32, (100,))}, lambda n: [t[n]])
    raw = bytearray(p.read_bytes())
    raw[-4] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpoint):
        load_checkpoint(p)


def test_table_snapshot_gives_each_chunk_as_it_was_and_saves_only_the_rows_pushes_touched(monkeypatch):
    # 80 bytes a chunk: 10 rows of the weight (2 floats each), 20 of the per-row state
    monkeypatch.setattr("distbelief.ps.cow.CHUNK_BYTES", 10 * 4 * 2)
    w = torch.arange(100 * 2, dtype=torch.float32).view(100, 2)
    s = torch.zeros(100)
    before = {"table.0.weight": w.clone(), "table.0.opt.sum": s.clone()}
    snap = TableSnapshot({"table.0.weight": w, "table.0.opt.sum": s}, {"table.0.weight": 0, "table.0.opt.sum": 0})
    assert snap.num_chunks("table.0.weight") == 10 and snap.num_chunks("table.0.opt.sum") == 5
    got = [snap.take("table.0.weight", 0).clone(), snap.take("table.0.weight", 1).clone()]  # (one buffer)
    snap.before_write(0, np.array([5, 25, 26, 99]))  # the weight's rows below 20 are written already
    w[[5, 25, 26, 99]] = -1.0
    s[[5, 25, 26, 99]] = -1.0
    # saved: 3 rows of the weight (8 bytes of id + 8 of values each), 4 of the state (8 + 4 each)
    assert snap.saved_bytes == 3 * 16 + 4 * 12
    snap.before_write(0, np.array([25, 30]))  # 25 is saved already: not again; 30 is new
    w[[25, 30]] = -2.0
    s[[25, 30]] = -2.0
    snap.before_write(1, np.array([40]))  # another row group's rows: nothing of this one's
    w[40] = -3.0  # (as if that group's push wrote here: only to show it is not put back)
    assert snap.saved_bytes == snap.saved_bytes_max == 4 * 16 + 5 * 12
    got += [snap.take("table.0.weight", c).clone() for c in range(2, 10)]
    expect = before["table.0.weight"].clone()
    expect[40] = -3.0
    assert torch.equal(torch.cat(got), expect)
    state = torch.cat([snap.take("table.0.opt.sum", c).clone() for c in range(5)])
    assert torch.equal(state, before["table.0.opt.sum"])
    assert snap.saved_bytes == 0  # every saved row given back with its chunk


@pytest.mark.parametrize("hold", [True, False])
@pytest.mark.parametrize("rule", ["adagrad", "rowwise-adagrad"])
def test_a_background_snapshot_is_the_state_at_its_version_while_pushes_go_on(tmp_path, rule, hold, monkeypatch):
    """The writer is held after the snapshot starts (``hold``; else it writes while the pushes come, chunk by
    chunk between them); 20 more pushes change the rows (and their state); then it writes. The file must be the shard at the snapshot's version: a shard restored from it without the log equals
    a twin shard that stopped there, bit for bit; and the live shard kept no copy of its tables."""
    monkeypatch.setattr("distbelief.ps.cow.CHUNK_BYTES", 256)  # many small chunks
    dur = Durability(str(tmp_path / "a"), every_updates=0, every_seconds=0, wal=False, background=True)
    s, shard = table_shard(rule, dur)
    twin_dur = Durability(str(tmp_path / "b"), every_updates=0, every_seconds=0, wal=False, background=False)
    _, twin = table_shard(rule, twin_dur)
    todo = table_pushes(s, 30)
    push_all(shard, todo[:10])
    push_all(twin, todo[:10])
    go = threading.Event()
    submit = shard._writer.submit
    monkeypatch.setattr(shard._writer, "submit", lambda write: submit(lambda: (go.wait(30), write())))
    shard._snapshot_in_background()
    assert shard._cow is not None
    if not hold:
        go.set()
    push_all(shard, todo[10:])  # held: the writer has not taken a chunk yet, every touched row is saved first
    go.set()
    shard.flush()
    assert shard._cow is None and (shard.cow_bytes_max > 0 or not hold)
    assert not any(k.startswith("table.") for k in shard._snap_bufs)  # no second copy of the tables
    twin.checkpoint()
    from distbelief.ps.checkpoint import latest_good_checkpoint

    mine, theirs = latest_good_checkpoint(dur.root, SHARD), latest_good_checkpoint(twin_dur.root, SHARD)
    assert mine.meta["version"] == theirs.meta["version"] == 10
    assert mine.tensors.keys() == theirs.tensors.keys()
    assert all(torch.equal(mine.tensors[k], theirs.tensors[k]) for k in mine.tensors)
