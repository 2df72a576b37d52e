"""The consistency knob: the stale-synchronous clock table (runtime/clocks.py) and its settings."""

import threading
import time

import pytest

from distbelief import RunConfig
from distbelief.exceptions import ConfigError
from distbelief.runtime.clocks import ClockTable, LocalClocks


def test_a_replica_waits_once_it_is_more_than_the_bound_ahead_of_the_slowest():
    t = ClockTable(bound=2)
    assert [t.join(r) for r in range(3)] == [0, 0, 0]
    assert t.enter(0, 1) and t.enter(0, 2)
    assert not t.enter(0, 3)  # 3 steps done, the slowest none: 3 > 2
    assert t.waits == 1
    assert t.enter(1, 1) and not t.allowed(0, 3)  # replica 2 is still at 0
    assert t.enter(2, 1) and t.allowed(0, 3) and t.enter(0, 3, first_try=False)
    assert t.gap_max == 2 and t.waits == 1


def test_a_report_returns_the_slowest_live_clock_which_never_decreases():
    t = ClockTable(bound=1)
    t.join(0), t.join(1)
    lows = [t.report(0, 1), t.report(0, 2), t.report(1, 1), t.report(1, 2), t.report(0, 3)]
    assert lows == [0, 0, 1, 2, 2] and lows == sorted(lows)
    assert t.gap_max == 1  # replica 0 at 2 against 0 was over the bound: not counted as a step it started
    t.retire(1)
    assert t.report(0, 3) == 3 and t.join(1) == 3  # a joiner starts at the slowest: the minimum holds
    assert t.report(7, 99) == 99  # not live: never held, never counted


def test_bound_zero_is_lockstep():
    t = ClockTable(bound=0)
    t.join(0), t.join(1)
    assert not t.enter(0, 1)
    assert t.enter(1, 1) and t.enter(0, 1, first_try=False)
    assert t.gap_max == 0


def test_a_retired_replica_does_not_block_and_a_new_one_joins_at_the_slowest_clock():
    t = ClockTable(bound=1)
    t.join(0), t.join(1), t.join(2)
    t.enter(1, 5), t.enter(2, 4)
    assert not t.enter(1, 6)  # replica 0 (at 0) holds the others back
    t.retire(0)  # it died
    assert t.allowed(1, 5) and t.enter(1, 5)
    assert t.join(0) == 4  # its successor starts at the slowest live clock, blocking no one
    assert t.enter(0, 4) and t.enter(2, 5)
    assert t.allowed(7, 10**6)  # a replica that is not live is never held


def test_negative_bound_is_refused():
    with pytest.raises(ValueError):
        ClockTable(-1)


def test_threads_never_run_more_than_the_bound_ahead_of_the_slowest():
    """Three replica threads, one much slower: at every step start, no thread is more than the bound ahead of
    the slowest live one; the table's gap_max agrees; the fast ones waited."""
    clocks, bound, steps = LocalClocks(bound=2), 2, 30
    seen_gaps, lock = [], threading.Lock()
    progress = {r: 0 for r in range(3)}
    joined = threading.Barrier(3)

    def replica(rid: int, delay: float) -> None:
        base = clocks.join(rid)
        joined.wait(5)
        for step in range(steps):
            clock = base + step
            clocks.report(rid, clock).result(5)
            first = True
            while not clocks.wait(rid, clock, 0.05, first_try=first):
                first = False
            with lock:
                live = [progress[r] for r in progress if r in clocks.table.clocks]
                seen_gaps.append(clock - min(live))
            time.sleep(delay)
            with lock:
                progress[rid] = clock + 1
        clocks.retire(rid)

    threads = [threading.Thread(target=replica, args=(r, 0.02 if r == 1 else 0.001)) for r in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads)
    assert max(seen_gaps) <= bound
    stats = clocks.stats(1)
    assert stats["clock_gap_max"] == bound and stats["clock_waits"] > 0
    assert stats["clocks"] == {}  # every replica retired


def test_consistency_settings():
    cfg = RunConfig(consistency="sync").validate()
    assert cfg.strategy == "sync" and cfg.optimizer == "adagrad"  # Downpour in lockstep is the sync strategy
    assert RunConfig(strategy="sync").validate().consistency == "sync"
    cfg = RunConfig(consistency="sync", replicas=2, backup_replicas=1).validate()
    assert cfg.replicas_started == 3
    assert RunConfig(consistency="ssp", backup_replicas=0).validate().replicas_started == 2
    with pytest.raises(ConfigError, match="backup_replicas"):
        RunConfig(backup_replicas=1).validate()  # async has no steps to back up
    with pytest.raises(ConfigError, match="consistency"):
        RunConfig(strategy="hogwild", consistency="ssp").validate()
    with pytest.raises(ConfigError, match="consistency"):
        RunConfig(strategy="sandblaster", consistency="sync").validate()
    with pytest.raises(ConfigError, match="consistency"):
        RunConfig(strategy="sync", consistency="ssp").validate()
    with pytest.raises(ConfigError, match="staleness_bound"):
        RunConfig(consistency="ssp", staleness_bound=-1).validate()
    with pytest.raises(ConfigError, match="consistency.*unknown value"):
        RunConfig(consistency="bsp").validate()


def test_shards_count_applied_pushes_by_staleness_bucket():
    import numpy as np

    from distbelief.ps.optimizers import make_server_optimizer
    from distbelief.ps.shard import STALENESS_BUCKETS, ParameterShard, staleness_bucket

    assert [staleness_bucket(s) for s in (0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 1000)] == \
        [0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 7, 7]
    assert len(STALENESS_BUCKETS) == 8
    shard = ParameterShard(0, 0, 2, np.zeros(2, np.float32), make_server_optimizer("sgd", 0.1), 2)
    g = np.ones(2, np.float32)
    for based_on in (0, 0, 0, 0, 0, 0, 6, 0):  # staleness 0, 1, 2, 3, 4, 5, 0, 7 (versions 0..7)
        shard.push(0, g, 0, based_on)
    shard.apply_mean(g, g)  # a synchronous update: never stale
    assert shard.stats()["staleness_histogram"] == [3, 1, 1, 1, 3, 0, 0, 0]  # 4, 5 and 7 share "4-7"
    shard.push(0, g, 0, 0, num_examples=1)  # version 9: staleness 9
    assert shard.stats()["staleness_histogram"][5] == 1
