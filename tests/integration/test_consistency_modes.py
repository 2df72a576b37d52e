"""Downpour's consistency knob end to end: stale-synchronous replicas (ssp) and synchronous steps with backup
replicas (sync), with stragglers, failures, warmstart and partitions. In-process runs (threads) check the rules;
one Ray run checks them across processes."""

import pytest

from distbelief import RunConfig
from distbelief.api import train_task
from distbelief.testing import Faults

SMALL = dict(runtime="inprocess", replicas=3, shards=2, max_steps=40, max_seconds=0, batch_size=16,
             eval_every_seconds=3600, num_samples=2000, durability="off")
STRAGGLER = Faults(straggler_id=1, straggler_slowdown=4)


def run(hooks=STRAGGLER, **kw):
    return train_task(RunConfig(**{**SMALL, **kw}), quiet=True, hooks=hooks).summary


def stragglers_share(dropped: dict[int, int], straggler: int = 1) -> float:
    """The straggler's part of the gradients dropped (``dropped``: by replica)."""
    return dropped.get(straggler, 0) / max(1, sum(dropped.values()))


def test_ssp_holds_fast_replicas_within_the_bound_of_a_straggler():
    s = run(consistency="ssp", staleness_bound=2)
    assert s["consistency"] == "ssp" and s["staleness_bound"] == 2
    assert s["steps_per_replica"] == [40, 40, 40]
    assert s["clock_gap_max"] == 2  # reached, never passed
    assert s["clock_waits"] > 0 and s["clock_wait_s"] > 0  # the fast ones waited for the straggler
    assert s["updates"] == 3 * 40 * 2
    hist = s["staleness_histogram"]  # every applied push, by staleness bucket (0, 1, 2, 3, 4-7, ...)
    assert sum(hist) == s["updates"] and hist[5:] == [0, 0, 0]  # ssp bounds how stale a push can be


def test_async_reports_no_clock_and_never_waits():
    s = run()
    assert s["consistency"] == "async"
    assert "clock_gap_max" not in s and "dropped_gradients" not in s


def test_ssp_a_dead_replica_does_not_block_the_others():
    s = run(consistency="ssp", staleness_bound=1, max_replica_restarts=0, max_steps=60,
            hooks=Faults(kill_replica_at_step=30, kill_replica_id=1))
    assert s["replicas_lost"] == 1
    steps = s["steps_per_replica"]
    assert steps[0] == steps[2] == 60 and steps[1] < 60
    assert s["clock_gap_max"] <= 1


def test_ssp_a_restarted_replica_rejoins_at_the_slowest_clock():
    s = run(consistency="ssp", staleness_bound=1, max_steps=60,
            hooks=Faults(kill_replica_at_step=30, kill_replica_id=2))
    assert s["replica_restarts"] == 1 and s["steps_per_replica"] == [60, 60, 60]
    assert s["clock_gap_max"] <= 1


@pytest.mark.slow
def test_ssp_with_warmstart_and_partitions():
    s = run(consistency="ssp", staleness_bound=1, warmstart_steps=10, hooks=None)
    assert s["steps_per_replica"] == [50, 40, 40] and s["clock_gap_max"] <= 1
    s = run(consistency="ssp", staleness_bound=1, partitions=2, replicas=2, model="lc1d", max_steps=20)
    assert s["steps_per_replica"] == [20, 20] and s["clock_gap_max"] <= 1 and s["partitions"] == 2


def test_sync_with_a_backup_replica_drops_the_stragglers_gradients():
    """Replica 1 is 10x slower than the others: each step takes the first two gradients of that step, the quick
    replicas' (0 and the backup, 2): the gradients dropped are the straggler's, come in after their step (a quick
    replica's only when a hiccup of the machine made it the slowest for a step)."""
    dropped = {}

    def probe(trainer, record):  # the final evaluation: the driver's count of dropped gradients by replica
        dropped.update(trainer.dropped_by_replica)

    s = run(consistency="sync", replicas=2, backup_replicas=1,
            hooks=Faults(straggler_id=1, straggler_slowdown=10, on_evaluation=probe))
    assert s["strategy"] == "sync" and s["consistency"] == "sync" and s["backup_replicas"] == 1
    assert s["updates"] == 40 * 2  # one update per shard per step
    assert s["dropped_gradients"] > 0 and sum(dropped.values()) == s["dropped_gradients"]
    assert stragglers_share(dropped) >= 0.75, dropped
    assert s["staleness_histogram"] == [s["updates"]] + [0] * 7  # a synchronous update is never stale
    # every step applied the mean of 2 gradients: 2 x 16 examples per step
    assert s["examples"] == 40 * 2 * 16
    plain = run(consistency="sync")
    assert plain["dropped_gradients"] == 0 and plain["examples"] == 40 * 3 * 16


def test_sync_with_a_backup_replica_survives_a_dead_replica():
    s = run(consistency="sync", replicas=2, backup_replicas=1, max_replica_restarts=0, max_steps=30,
            hooks=Faults(kill_replica_at_step=10, kill_replica_id=0))
    assert s["replicas_lost"] == 1 and s["updates"] == 30 * 2
    assert s["examples"] == 30 * 2 * 16  # still two gradients a step: the backup stood in


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_ssp_and_sync_backups_on_ray(tmp_path):
    s = run(runtime="ray", consistency="ssp", staleness_bound=1, max_steps=20, out=str(tmp_path / "ssp"))
    assert s["steps_per_replica"] == [20, 20, 20] and s["clock_gap_max"] == 1 and s["clock_waits"] > 0
    dropped = {}
    s = run(runtime="ray", consistency="sync", replicas=2, backup_replicas=1, max_steps=20,
            out=str(tmp_path / "sync"), hooks=Faults(straggler_id=1, straggler_slowdown=10,
                                                      on_evaluation=lambda t, r: dropped.update(t.dropped_by_replica)))
    assert s["updates"] == 20 * 2 and s["dropped_gradients"] > 0 and s["examples"] == 20 * 2 * 16
    assert sum(dropped.values()) == s["dropped_gradients"] and stragglers_share(dropped) >= 0.75, dropped


@pytest.mark.parametrize("mode", [dict(consistency="ssp", staleness_bound=1),
                                  dict(consistency="sync", replicas=2, backup_replicas=1)])
def test_a_resumed_run_keeps_its_mode_and_counters(mode, tmp_path):
    out = str(tmp_path / "run")
    first = run(hooks=None, max_steps=20, durability="snapshot", out=out, **mode)
    again = train_task(RunConfig(**{**SMALL, **mode, "max_steps": 40, "durability": "snapshot", "out": out}),
                       quiet=True, resume=True).summary
    assert first["updates"] == 20 * (3 if mode["consistency"] == "ssp" else 1) * 2  # 2 shards
    assert again["updates"] == 2 * first["updates"]  # the second half added as many updates as the first
    if mode["consistency"] == "ssp":  # (sync's steps_per_replica counts each replica's gradients, dropped or not)
        assert again["steps_per_replica"] == [40, 40, 40]
    assert again["consistency"] == mode["consistency"]
    if mode["consistency"] == "ssp":
        assert again["clock_gap_max"] <= 1
    else:
        # each step drops its third gradient: the count goes on from the first half's, not from 0
        assert 0 < first["dropped_gradients"] < again["dropped_gradients"]
        assert again["dropped_gradients"] >= 2 * first["dropped_gradients"] - 1
