"""Shard replication (``--durability replicate``, ps/replication.py) without processes: a primary forwards every
update it applies to its backup through the in-process runtime's link, so the backup is the primary, bit for bit,
at every acknowledgement; a push re-sent to a promoted backup is recognised; a lost backup is dropped and a new
one receives the whole state."""

import numpy as np
import pytest
import torch

from distbelief.ps.optimizers import Adagrad
from distbelief.ps.shard import ParameterShard
from distbelief.runtime.inprocess import InProcessRuntime

LO, HI, TOTAL = 10, 30, 40


def pair(staleness_aware=False):
    """A primary shard over [LO, HI) and its backup, linked as a run links them."""
    rt = InProcessRuntime()
    opt = Adagrad(lr=0.1, staleness_aware=staleness_aware)
    init = np.linspace(-1, 1, HI - LO).astype(np.float32)
    primary = rt.create_shard(0, lambda: ParameterShard(0, LO, HI, init, opt, TOTAL))
    backup = rt.create_backup(0, lambda: ParameterShard.blank(0, LO, HI, opt, TOTAL), away_from=primary)
    primary.handle.obj.attach_backup(rt.backup_link(backup))
    return rt, primary, backup


def state(shard: ParameterShard) -> dict:
    """Everything that must agree between a primary and its backup (fetch traffic aside: backups serve none)."""
    return {"params": shard.vectors["params"].clone(), "sum_sq": shard.opt_state["sum_sq"].clone(),
            "version": shard.version, "examples": shard.examples, "last_seq": dict(shard.last_seq),
            "staleness": (shard.staleness_sum, shard.staleness_max, shard.staleness_count),
            "histogram": shard.stats()["staleness_histogram"], "rejected": shard.rejected_pushes}


def assert_same(a: ParameterShard, b: ParameterShard) -> None:
    sa, sb = state(a), state(b)
    for key in sa:
        if isinstance(sa[key], torch.Tensor):
            assert torch.equal(sa[key], sb[key]), key
        else:
            assert sa[key] == sb[key], key


def pushes(n, seed=0):
    """``n`` pushes from two interleaved client sessions, with varied staleness and ranges (some partial)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        session = 11 if i % 2 else 23
        offset, size = (0, TOTAL) if i % 3 else (LO + 5, 8)
        out.append((rng.standard_normal(size).astype(np.float32), offset, max(0, i - int(rng.integers(0, 4))),
                    32, session, i // 2 + 1))
    return out


@pytest.mark.parametrize("staleness_aware", [False, True])
def test_the_backup_applies_every_update_in_the_primarys_order_bit_for_bit(staleness_aware):
    _, primary, backup = pair(staleness_aware)
    p, b = primary.handle.obj, backup.handle.obj
    for g, offset, based_on, n, session, seq in pushes(40):
        p.push(0, g, offset, based_on, n, session, seq)
        assert_same(p, b)  # at every acknowledgement, not only at the end
    bad = np.ones(TOTAL, np.float32)
    bad[LO] = np.nan
    p.push(0, bad, 0, p.version, 1, 11, 999)  # refused by the primary: nothing reaches the backup
    p.apply_mean(np.ones(TOTAL, np.float32), np.full(TOTAL, 3, np.float32))  # sync's mean, forwarded as one push
    assert b.version == p.version == 41 and b.rejected_pushes == 0
    assert torch.equal(p.vectors["params"], b.vectors["params"])
    assert torch.equal(p.opt_state["sum_sq"], b.opt_state["sum_sq"])
    assert p.stats()["has_backup"] and p.stats()["backups_attached"] == 1


def test_a_push_resent_to_the_promoted_backup_is_recognised_and_not_applied_twice():
    _, primary, backup = pair()
    p, b = primary.handle.obj, backup.handle.obj
    todo = pushes(10)
    for g, offset, based_on, n, session, seq in todo:
        p.push(0, g, offset, based_on, n, session, seq)
    before = state(b)
    primary.handle.dead = True  # the primary died after applying the last push, before its acknowledgement
    g, offset, based_on, n, session, seq = todo[-1]
    assert b.push(0, g, offset, based_on, n, session, seq) == before["version"]  # the client's re-send
    assert b.duplicate_pushes == 1
    assert torch.equal(b.vectors["params"], before["params"]) and b.version == 10
    g2 = np.ones(TOTAL, np.float32)
    assert b.push(0, g2, 0, 10, 1, session, seq + 1) == 11  # the next push is applied as usual


def test_a_failed_backup_is_dropped_and_a_new_one_receives_the_whole_state():
    rt, primary, backup = pair()
    p = primary.handle.obj
    todo = pushes(30)
    for args in todo[:10]:
        p.push(0, *args)
    rt.kill(backup)
    for args in todo[10:20]:  # the primary goes on alone, and says so
        p.push(0, *args)
    st = p.stats()
    assert not st["has_backup"] and st["backups_lost"] == 1 and p.version == 20
    fresh = rt.create_backup(0, lambda: ParameterShard.blank(0, LO, HI, p.optimizer, TOTAL), away_from=primary)
    assert p.attach_backup(rt.backup_link(fresh)) == 20
    assert_same(p, fresh.handle.obj)
    for args in todo[20:]:
        p.push(0, *args)
    assert_same(p, fresh.handle.obj)
    assert p.stats()["has_backup"] and p.stats()["backups_attached"] == 2


def test_a_replicated_shard_is_never_shared_with_colocated_replicas(tmp_path):
    """Co-located replicas would update the primary's memory without the primary, so nothing would be
    forwarded: a replicated shard (primary or backup) refuses to be shared."""
    _, primary, backup = pair()
    assert primary.handle.obj.share(str(tmp_path / "x")) is None
    assert backup.handle.obj.share(str(tmp_path / "y")) is None


def test_every_dead_primary_is_served_again_before_any_new_backup_is_made():
    """Two primaries found dead in one supervision tick both fail over first; only then does each get a new
    backup (a new backup can wait for a process to start; the other shard's replicas must not)."""
    from distbelief import RunConfig
    from distbelief.downpour.shards import ServerShards

    cfg = RunConfig(runtime="inprocess", shards=2, durability="replicate").validate()
    rt, events = InProcessRuntime(), []
    server = ServerShards(cfg, rt, lambda msg: None, Adagrad(lr=0.1), torch.zeros(TOTAL), None, None,
                          hand_over=lambda k, handle: 0, on_event=events.append, prev={})
    server.wait_ready(None)
    first = list(server.backups)
    rt.kill(server.roles[0])
    rt.kill(server.roles[1])
    server.check()
    assert [(e["event"], e["id"]) for e in events] == [("shard failed over", 0), ("shard failed over", 1),
                                                        ("backup replaced", 0), ("backup replaced", 1)]
    assert server.roles == first and all(b is not None and b not in first for b in server.backups)
    assert server.restarts == 2 and server.updates_lost == 0 and server.backups_replaced == 2
