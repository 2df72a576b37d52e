"""Run hooks (distbelief/hooks.py) and the fault injection built on them (distbelief/testing/faults.py)."""

import pytest

from distbelief import RunConfig
from distbelief.exceptions import ConfigError
from distbelief.hooks import RunHooks, StepWake
from distbelief.testing import Faults
from distbelief.testing.faults import FaultInjector, Straggle


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_step_wake_predicts_the_time_to_the_step_from_the_measured_rate():
    clock = FakeClock()
    wake = StepWake(first_s=0.05, min_s=0.002, max_s=0.5, clock=clock)
    assert wake.seconds_until(None) == 0.5  # nothing to catch: the driver's own cadence
    assert wake.seconds_until(100) == 0.05  # never looked: soon
    wake.observe(0)
    assert wake.seconds_until(100) == 0.05  # one look: no rate yet
    clock.t += 0.1
    wake.observe(20)  # 200 steps/s
    assert wake.rate() == pytest.approx(200.0)
    assert wake.seconds_until(60) == pytest.approx(0.2)  # 40 steps to go
    clock.t += 0.05  # time passed since the last look counts
    assert wake.seconds_until(60) == pytest.approx(0.15)
    assert wake.seconds_until(10_000) == 0.5  # far away: at most max_s
    assert wake.seconds_until(21) == 0.002  # the floor, not a busy loop
    assert wake.seconds_until(20) == 0.0  # already there


def test_step_wake_starts_over_when_the_count_goes_back():
    clock = FakeClock()
    wake = StepWake(clock=clock)
    wake.observe(50)
    clock.t += 1
    wake.observe(150)
    assert wake.rate() == pytest.approx(100.0)
    wake.observe(10)  # a resumed or restarted count: the old rate says nothing
    assert wake.rate() is None


class Driver:
    """What a driver offers hooks: its config and the kill operations (here they record what was asked)."""

    def __init__(self, shards=3, replica_running=True):
        self.cfg = RunConfig(shards=shards, replicas=2)
        self.killed = []
        self.replica_running = replica_running

    def kill_shard(self, k, steps=None):
        self.killed.append(("shard", k, steps))

    def kill_replica(self, rid, partition_id=-1, steps=None):
        if not self.replica_running:
            return False
        self.killed.append(("replica", rid, partition_id, steps))
        return True


def test_faults_fire_once_each_at_their_steps_through_the_drivers_kill_operations():
    d = Driver(shards=3)
    hooks = Faults(kill_shard_at_step=10, kill_shard_id=2, kill_shard_times=3, kill_shard_every_steps=5,
                   kill_replica_at_step=12, kill_replica_id=1).start(d, resumed=False)
    assert hooks.next_step() == 10
    hooks.on_step(d, 11)
    assert d.killed == [("shard", 2, 11)] and hooks.next_step() == 12
    hooks.on_step(d, 13)  # the replica's step, and not yet the second shard kill (15)
    assert d.killed[1:] == [("replica", 1, -1, 13)] and hooks.next_step() == 15
    hooks.on_step(d, 15)
    hooks.on_step(d, 30)
    assert [k for k in d.killed if k[0] == "shard"] == [("shard", 2, 11), ("shard", 0, 15), ("shard", 1, 30)]
    assert hooks.next_step() is None and not hooks.pending


def test_a_replica_that_cannot_be_killed_now_keeps_its_fault_pending():
    d = Driver(replica_running=False)
    hooks = Faults(kill_replica_at_step=5, kill_replica_id=0).start(d, resumed=False)
    hooks.on_step(d, 6)
    assert d.killed == [] and hooks.next_step() == 5
    d.replica_running = True
    hooks.on_step(d, 9)
    assert d.killed == [("replica", 0, -1, 9)] and hooks.next_step() is None


def test_faults_do_not_fire_again_in_a_resumed_run():
    d = Driver()
    hooks = Faults(kill_shard_at_step=1, kill_replica_at_step=1).start(d, resumed=True)
    assert hooks.next_step() is None
    hooks.on_step(d, 100)
    assert d.killed == []


def test_each_run_gets_its_own_injector():
    faults = Faults(kill_shard_at_step=1)
    a, b = faults.start(Driver(), False), faults.start(Driver(), False)
    a.on_step(Driver(), 5)
    assert isinstance(b, FaultInjector) and b.next_step() == 1 and a.next_step() is None


def test_the_straggler_gets_a_replica_hook_and_the_others_none():
    faults = Faults(straggler_id=1, straggler_slowdown=3.0)
    assert faults.replica_hook(0) is None
    assert faults.replica_hook(1) == Straggle(0.0, 3.0)
    assert Faults(portion_delay_s=0.01).replica_hook(0) == Straggle(0.01, 1.0)
    assert Faults().replica_hook(0) is None


def test_straggle_sleeps_the_step_to_its_factor(monkeypatch):
    slept = []
    monkeypatch.setattr("distbelief.testing.faults.time.sleep", slept.append)
    Straggle(0.0, 3.0)(1, 0.02)  # a 20 ms step made 3x as long: 40 ms more
    Straggle(0.01, 2.0)(1, 0.02)  # 10 ms of emulated compute, then the whole 30 ms twice
    Straggle(0.0, 1.0)(1, 0.02)  # neither: no sleep at all
    assert slept == [pytest.approx(0.04), pytest.approx(0.04)]


def test_the_evaluation_probe_is_called_with_the_driver_and_the_record():
    seen = []
    d = Driver()
    hooks = Faults(on_evaluation=lambda drv, rec: seen.append((drv, rec))).start(d, False)
    hooks.on_evaluation(d, {"test_accuracy": 0.5})
    assert seen == [(d, {"test_accuracy": 0.5})]


def test_train_refuses_hooks_that_are_not_run_hooks_and_checks_faults_before_starting():
    from distbelief.api import train
    from tests.conftest import make_odd_model, toy_classification

    data = toy_classification()
    with pytest.raises(ConfigError, match="^hooks: must be a distbelief.hooks.RunHooks"):
        train(make_odd_model, data, data, RunConfig(runtime="inprocess"), hooks=lambda d, r: None)
    with pytest.raises(ConfigError, match="^kill_shard_id"):
        train(make_odd_model, data, data, RunConfig(runtime="inprocess", shards=2),
              hooks=Faults(kill_shard_at_step=3, kill_shard_id=5))


def test_default_hooks_do_nothing():
    h = RunHooks()
    assert h.start(object(), False) is h and h.next_step() is None and h.replica_hook(0) is None


def test_step_wake_follows_a_rate_that_changes():
    clock = FakeClock()
    wake = StepWake(window_s=2.0, clock=clock)
    wake.observe(0)
    clock.t += 1.0
    wake.observe(10)  # 10 steps/s (one replica, warming up)
    clock.t += 2.0
    wake.observe(210)  # then 100 steps/s
    clock.t += 1.0
    wake.observe(310)
    assert wake.rate() == pytest.approx(100.0)  # the last window's, not the run's average
