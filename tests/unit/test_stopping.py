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
