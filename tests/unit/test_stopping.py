"""The one stop rule every driver uses (distbelief/stopping.py): which condition ends a run, in which order, and
that the first reason found is the one kept."""

import math

from distbelief import stopping
from distbelief.stopping import StopRule


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def elapsed(self):
        return self.t


def rule(max_steps=0, max_seconds=0.0):
    clock = FakeClock()
    return StopRule(max_steps, max_seconds, clock.elapsed), clock


def test_nothing_set_never_stops_on_its_own():
    r, clock = rule()
    clock.t = 1e9
    assert not r.check(steps=10**9) and r.reason == "" and r.seconds_left() == math.inf


def test_each_condition_names_itself():
    r, _ = rule(max_steps=10)
    assert not r.check(steps=9) and r.check(steps=10) and r.reason == stopping.STEP_LIMIT
    r, clock = rule(max_seconds=5)
    clock.t = 4.0
    assert not r.check() and r.seconds_left() == 1.0
    clock.t = 5.0
    assert r.check() and r.reason == stopping.TIME_BUDGET and r.seconds_left() == 0.0
    r, _ = rule()
    assert r.check(target_reached=True) and r.reason == stopping.TARGET


def test_order_requested_then_steps_then_target_then_time_and_the_first_reason_is_kept():
    r, clock = rule(max_steps=10, max_seconds=5)
    clock.t = 6.0
    r.request("probe done")
    assert r.check(steps=10, target_reached=True) and r.reason == "probe done"
    r, clock = rule(max_steps=10, max_seconds=5)
    clock.t = 6.0
    assert r.check(steps=10, target_reached=True) and r.reason == stopping.STEP_LIMIT
    r, clock = rule(max_steps=10, max_seconds=5)
    clock.t = 6.0
    assert r.check(steps=3, target_reached=True) and r.reason == stopping.TARGET
    # once stopped, a later condition does not rename it; an interrupt or a failure does (not ended as planned)
    r.request("later")
    assert r.check(steps=10) and r.reason == stopping.TARGET
    assert r.end(stopping.STEP_LIMIT) == stopping.TARGET
    assert r.end(stopping.INTERRUPTED) == stopping.INTERRUPTED and r.check() and r.reason == stopping.INTERRUPTED


def test_a_driver_without_a_step_count_leaves_the_step_limit_to_its_workers():
    r, _ = rule(max_steps=10)
    assert not r.check(steps=None) and r.reason == ""
    assert r.end(stopping.STEP_LIMIT) == stopping.STEP_LIMIT


def test_evaluations_reach_the_target_and_the_rule_stops_on_it():
    clock = FakeClock()
    r = StopRule(0, 0.0, clock.elapsed, target=0.8)
    r.evaluated(0.5, 1.0)
    assert not r.check() and r.best == 0.5 and r.time_to_target is None
    r.evaluated(0.85, 2.5)
    r.evaluated(0.9, 4.0)  # later evaluations move the best, not the time the target was reached
    assert r.time_to_target == 2.5 and r.best == 0.9
    assert r.check() and r.reason == stopping.TARGET


def test_no_target_is_never_reached_and_a_resumed_run_keeps_its_own_record():
    r = StopRule(0, 0.0, FakeClock().elapsed, target=None)
    r.evaluated(1.0, 1.0)
    assert r.time_to_target is None and not r.check()
    r = StopRule(0, 0.0, FakeClock().elapsed, target=0.5, best=0.7, time_to_target=12.0)  # resumed
    r.evaluated(0.6, 20.0)
    assert r.best == 0.7 and r.time_to_target == 12.0


def test_outcome_fields_are_the_summarys_for_every_driver():
    from distbelief.summary import RunSummary

    clock = FakeClock()
    r = StopRule(0, 5.0, clock.elapsed, target=0.9)
    r.evaluated(0.6, 1.0)
    clock.t = 5.0
    assert r.check() and r.reason == stopping.TIME_BUDGET
    out = r.outcome_fields(final_metric=0.65, examples=1000, wall_s=4.0)
    assert out == dict(final_test_accuracy=0.65, best_test_accuracy=0.65, target_accuracy=0.9,
                       time_to_target_s=None, examples=1000, examples_per_s=250.0,
                       stop_reason=stopping.TIME_BUDGET, wall_s=4.0)
    s = RunSummary(strategy="sgd", runtime="x", replicas=1, num_parameters=1, updates=1, steps_per_replica=[1],
                   **out)
    assert s.stop_reason == stopping.TIME_BUDGET
    # a run whose workers stopped themselves at the step limit, with nothing else ending it
    assert StopRule(10, 0.0, clock.elapsed).outcome_fields(0.1, 0, 0.0)["stop_reason"] == stopping.STEP_LIMIT
