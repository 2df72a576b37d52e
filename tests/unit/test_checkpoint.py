import numpy as np
import pytest
import torch

from distbelief.ps.checkpoint import (CorruptCheckpoint, WriteAheadLog, latest_good_checkpoint, load_checkpoint,
                                      save_checkpoint, shard_dir)
from distbelief.ps.optimizers import Adagrad
from distbelief.ps.shard import Durability, ParameterShard

TOTAL = 50


def new_shard(tmp_path, every_updates=0, wal=True):
    dur = Durability(str(tmp_path), every_updates=every_updates, every_seconds=0, wal=wal, background=False)
    return ParameterShard(1, 10, 30, np.linspace(-1, 1, 20, dtype=np.float32), Adagrad(lr=0.1), TOTAL, dur)


def pushes(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(TOTAL).astype(np.float32) for _ in range(n)]


def state_of(shard):
    return shard.vectors["params"].clone(), shard.opt_state["sum_sq"].clone(), shard.version


def test_roundtrip_and_checksum(tmp_path):
    t = {"params": torch.arange(5.0)}
    p = save_checkpoint(tmp_path, 0, {"version": 7, "lo": 0, "hi": 5}, t)
    meta, loaded = load_checkpoint(p)
    assert meta["version"] == 7 and torch.equal(loaded["params"], t["params"])
    raw = bytearray(p.read_bytes())
    raw[-3] ^= 0xFF  # flip a bit inside the tensor data
    p.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        load_checkpoint(p)
    p.write_bytes(bytes(raw[: len(raw) // 2]))  # truncated
    with pytest.raises(CorruptCheckpoint):
        load_checkpoint(p)


def test_keeps_only_the_newest_files(tmp_path):
    for v in range(6):
        save_checkpoint(tmp_path, 0, {"version": v}, {"params": torch.zeros(2)}, keep=3)
    assert [p.name for p in sorted(shard_dir(tmp_path, 0).glob("ckpt-*"))] == [
        f"ckpt-{v:012d}.safetensors" for v in (3, 4, 5)]


def test_restore_replays_the_log_so_no_acknowledged_update_is_lost(tmp_path):
    shard = new_shard(tmp_path, every_updates=4)
    for k, g in enumerate(pushes(10)):
        shard.push(0, g, 0, based_on_version=k, num_examples=3)
    before = state_of(shard)
    del shard  # the process dies: no final checkpoint (last one at version 8)
    restored = ParameterShard.restore(1, 10, 30, Adagrad(lr=0.1), TOTAL, Durability(str(tmp_path)))
    after = state_of(restored)
    assert restored.restored_from_version == 8 and restored.replayed_updates == 2
    assert after[2] == before[2] == 10 and restored.examples == 30
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    torch.testing.assert_close(after[1], before[1], rtol=0, atol=0)


def test_corrupt_latest_checkpoint_falls_back_and_still_loses_nothing(tmp_path):
    shard = new_shard(tmp_path, every_updates=3)
    for k, g in enumerate(pushes(10, seed=1)):
        shard.push(0, g, 0, k)
    before = state_of(shard)
    newest = sorted(shard_dir(tmp_path, 1).glob("ckpt-*"))[-1]
    newest.write_bytes(newest.read_bytes()[:100])  # truncated on disk
    restored = ParameterShard.restore(1, 10, 30, Adagrad(lr=0.1), TOTAL, Durability(str(tmp_path)))
    assert restored.corrupt_checkpoints and "unreadable" in restored.corrupt_checkpoints[0]
    assert restored.restored_from_version == 6 and restored.version == 10
    torch.testing.assert_close(state_of(restored)[0], before[0], rtol=0, atol=0)


def test_torn_log_tail_is_ignored(tmp_path):
    shard = new_shard(tmp_path, every_updates=100)
    shard.checkpoint()
    for k, g in enumerate(pushes(3, seed=2)):
        shard.push(0, g, 0, k)
    log = sorted(shard_dir(tmp_path, 1).glob("wal-*.log"))[-1]
    log.write_bytes(log.read_bytes()[:-7])  # the process died while writing the third record
    records = list(WriteAheadLog(tmp_path, 1).replay(0))
    assert [r[0] for r in records] == [1, 2]
    assert all(r.rows is None and r.grad.size == 20 for r in records)  # a dense shard's records: no rows


def test_no_checkpoint_uses_fallback_values(tmp_path):
    restored = ParameterShard.restore(2, 0, 5, Adagrad(lr=0.1), TOTAL, Durability(str(tmp_path)),
                                      fallback_values=np.ones(5, np.float32))
    assert restored.version == 0 and restored.vectors["params"].tolist() == [1.0] * 5
    with pytest.raises(FileNotFoundError):
        ParameterShard.restore(3, 0, 5, Adagrad(lr=0.1), TOTAL, Durability(str(tmp_path / "none")))


def test_checkpoint_range_mismatch_is_refused(tmp_path):
    shard = new_shard(tmp_path)
    shard.checkpoint()
    with pytest.raises(ValueError, match="covers"):
        ParameterShard.restore(1, 10, 31, Adagrad(lr=0.1), TOTAL, Durability(str(tmp_path)))
    assert latest_good_checkpoint(tmp_path, 1) is not None


def test_a_resent_push_is_applied_once_even_across_a_restart(tmp_path):
    shard = new_shard(tmp_path, every_updates=100)
    g = pushes(3, seed=4)
    shard.push(0, g[0], 0, 0, session=77, seq=1)
    shard.push(0, g[1], 0, 1, session=77, seq=2)
    shard.push(0, g[1], 0, 1, session=77, seq=2)  # the client re-sent it: ignored
    assert shard.version == 2 and shard.duplicate_pushes == 1
    shard.checkpoint()
    shard.push(0, g[2], 0, 2, session=77, seq=3)
    restored = ParameterShard.restore(1, 10, 30, Adagrad(lr=0.1), TOTAL, Durability(str(tmp_path)))
    assert restored.version == 3 and restored.last_seq == {77: 3}
    restored.push(0, g[2], 0, 2, session=77, seq=3)  # the ack of seq 3 was lost with the old process
    restored.push(0, g[1], 0, 2, session=99, seq=1)  # another client is unaffected
    assert restored.version == 4 and restored.duplicate_pushes == 1


# ---------------------------------------------------------------- durability "snapshot" (background) and "log" caps
def snapshot_shard(tmp_path, every_updates):
    dur = Durability(str(tmp_path), every_updates=every_updates, every_seconds=0, wal=False)  # snapshot mode
    return ParameterShard(1, 10, 30, np.linspace(-1, 1, 20, dtype=np.float32), Adagrad(lr=0.1), TOTAL, dur)


def test_background_snapshot_holds_the_state_as_of_the_push_that_took_it(tmp_path):
    shard = snapshot_shard(tmp_path, every_updates=5)
    gs = pushes(7, seed=5)
    states = []
    for k, g in enumerate(gs):
        shard.push(0, g, 0, k)
        states.append(state_of(shard))
        shard.flush()  # the test waits for each write, so every due snapshot is taken (none skipped as busy)
    assert shard.stats()["snapshot_version"] == 5 and not list(shard_dir(tmp_path, 1).glob("wal-*"))
    restored = ParameterShard.restore(1, 10, 30, Adagrad(lr=0.1), TOTAL, Durability(str(tmp_path), wal=False))
    # pushes 6 and 7 changed the live vectors after the copy: the snapshot must not see them
    assert restored.version == 5 and restored.replayed_updates == 0
    torch.testing.assert_close(state_of(restored)[0], states[4][0], rtol=0, atol=0)
    torch.testing.assert_close(state_of(restored)[1], states[4][1], rtol=0, atol=0)


def test_snapshot_is_skipped_while_the_previous_one_is_still_being_written(tmp_path, monkeypatch):
    import threading

    import distbelief.ps.shard as shard_mod

    gate = threading.Event()
    real = shard_mod.ParameterShard._write

    def slow_write(self, meta, tensors):
        gate.wait(10)
        real(self, meta, tensors)

    monkeypatch.setattr(shard_mod.ParameterShard, "_write", slow_write)
    shard = snapshot_shard(tmp_path, every_updates=2)
    for k, g in enumerate(pushes(6, seed=6)):
        shard.push(0, g, 0, k)  # due at 2 (taken), 4 and 6 (writer busy: skipped, the pushes are not blocked)
    assert shard.stats()["snapshot_version"] == 2
    gate.set()
    assert shard.flush() == 1
    shard.push(0, pushes(1, seed=7)[0], 0, 6)  # 7 - 2 >= 2 and the writer is free: taken now
    shard.flush()
    assert shard.stats()["snapshot_version"] == 7 and shard.checkpoints_written == 2


def test_log_is_capped_by_taking_a_snapshot(tmp_path):
    from distbelief.ps.checkpoint import _HEADER

    record = _HEADER.size + 20 * 4  # one logged push of a 20-float slice
    dur = Durability(str(tmp_path), every_updates=0, every_seconds=0, wal=True, log_max_bytes=3 * record,
                     background=False)
    shard = ParameterShard(1, 10, 30, np.zeros(20, np.float32), Adagrad(lr=0.1), TOTAL, dur)
    shard.checkpoint()
    for k, g in enumerate(pushes(10, seed=8)):
        shard.push(0, g, 0, k)
        logs = list(shard_dir(tmp_path, 1).glob("wal-*.log"))
        assert sum(p.stat().st_size for p in logs) <= 4 * 3 * record  # kept checkpoints' logs, each capped
    assert shard.checkpoints_written >= 4
    before = state_of(shard)
    restored = ParameterShard.restore(1, 10, 30, Adagrad(lr=0.1), TOTAL, Durability(str(tmp_path)))
    assert restored.version == 10
    torch.testing.assert_close(state_of(restored)[0], before[0], rtol=0, atol=0)
