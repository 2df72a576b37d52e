"""The restart/drop policy every driver shares: decisions, backoff schedule, recovery times (a fake clock)."""

import math

from distbelief.supervisor import Decision, RestartPolicy, Supervisor


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_backoff_doubles_up_to_its_cap():
    p = RestartPolicy(max_restarts=5, backoff_s=0.5, max_backoff_s=3.0)
    assert [p.backoff(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_restart_is_due_after_the_backoff_and_counted():
    clock = FakeClock()
    sup = Supervisor(RestartPolicy(max_restarts=2, backoff_s=1.0), clock)
    assert sup.until_next() == math.inf
    assert sup.failed(3) is Decision.RESTART
    assert sup.waiting(3) and sup.due() == [] and sup.until_next() == 1.0
    clock.t += 0.999
    assert sup.due() == []
    clock.t += 0.001
    assert sup.due() == [3] and sup.until_next() == 0.0
    clock.t += 0.25  # the driver took a while to start it
    assert sup.restarted(3) == 1
    assert not sup.waiting(3) and sup.due() == [] and sup.recovery_s == [1.25] and sup.total_restarts == 1
    # the second failure waits twice as long
    assert sup.failed(3) is Decision.RESTART and sup.restart_at(3) == clock.t + 2.0


def test_out_of_restarts_the_replica_is_dropped():
    clock = FakeClock()
    sup = Supervisor(RestartPolicy(max_restarts=1, backoff_s=0.0), clock)
    assert sup.failed(0) is Decision.RESTART
    sup.restarted(0)
    assert sup.failed(0) is Decision.DROP
    assert sup.lost == {0} and not sup.waiting(0) and sup.due() == []


def test_no_restart_is_scheduled_when_the_run_is_stopping():
    sup = Supervisor(RestartPolicy(max_restarts=3), FakeClock())
    assert sup.failed(1, stopping=True) is Decision.RESTART
    assert not sup.waiting(1) and sup.lost == set()


def test_restarts_carry_over_from_a_resumed_run_and_replicas_are_independent():
    clock = FakeClock()
    sup = Supervisor(RestartPolicy(max_restarts=2, backoff_s=1.0), clock, restarts={0: 2}, earlier=(5, 1))
    assert sup.failed(0) is Decision.DROP  # used both restarts before the resume
    assert sup.failed(1) is Decision.RESTART
    clock.t += 1.0
    assert sup.due() == [1]
    sup.cancel(1)
    assert sup.due() == [] and sup.total_restarts == 2
    assert (sup.replica_restarts, sup.replicas_lost) == (7, 2)  # the resumed run's totals count on
