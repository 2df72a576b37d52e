"""Evaluation never competes with training: Downpour holds its replicas at a step boundary while the driver
evaluates the server's parameters, and the training clock stops meanwhile (as for every other strategy)."""

import itertools
import time

import pytest

from distbelief.api import train
from distbelief.testing import Faults
from tests.conftest import make_odd_model


def replica_steps(trainer) -> list[int]:
    return [trainer.runtime.call(st.role, "stats").result(10)["steps"] for st in trainer.replicas.values()]


def replicas_holding(trainer) -> list[bool]:
    """Whether each running replica holds at a step boundary right now. ``pause(0)`` answers at once: True for a
    replica waiting there, False for one that is training (asking a held replica again changes nothing; the
    driver's resume releases it)."""
    return [trainer.runtime.call(st.role, "pause", 0.0).result(10) for st in trainer.replicas.values()
            if st.running]


class PausedProbe:
    """An evaluation probe, run by the driver in the middle of each evaluation. It records whether every replica
    holds at a step boundary (asked directly, not inferred from a quiet interval), whether their step counts
    stayed put across the probe, and whether the training clock stands still: it reads the same before and after
    a sleep, and equals the evaluation's recorded time. Once ``evaluations`` evaluations were probed with training
    in between, it ends the run (no time budget)."""

    def __init__(self, evaluations: int = 3):
        self.evaluations = evaluations
        self.held: list[bool] = []
        self.clock_still: list[bool] = []
        self.updates: list[int] = []

    def __call__(self, trainer, record):
        if trainer.stop_reason:  # the final evaluation, after the replicas finished
            return
        before = replica_steps(trainer)
        t = trainer.clock.elapsed()
        holding = replicas_holding(trainer)
        time.sleep(0.001)  # any time at all: a running clock would move
        self.clock_still.append(trainer.clock.elapsed() == t and record["wall_s"] == round(t, 3))
        self.held.append(bool(holding) and all(holding) and replica_steps(trainer) == before)
        self.updates.append(record["updates"])
        if len(self.updates) >= self.evaluations and self.updates[-1] > self.updates[0]:
            trainer.request_stop("evaluations probed")


def check_paused_evaluation(toy_data, runtime):
    probe = PausedProbe()
    # max_seconds only guards against a run that never gets there: the probe ends it
    res = train(make_odd_model, toy_data[0], toy_data[1], quiet=True, runtime=runtime, replicas=2, shards=2,
                max_seconds=120, eval_every_seconds=0.2, batch_size=8, evaluation="paused",
                hooks=Faults(on_evaluation=probe))
    assert res.summary["stop_reason"] == "evaluations probed" and res.summary["evaluation"] == "paused"
    assert len(probe.held) >= 3 and all(probe.held), probe.held
    # training time excludes the evaluations: the clock stood still through each of them
    assert all(probe.clock_still), probe.clock_still
    # and training went on between evaluations
    updates = [m["updates"] for m in res.metrics]
    assert updates == sorted(updates) and updates[-1] > updates[0]


def test_inprocess_replicas_hold_still_while_the_driver_evaluates(toy_data):
    check_paused_evaluation(toy_data, "inprocess")


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_ray_replicas_hold_still_while_the_driver_evaluates(toy_data):
    check_paused_evaluation(toy_data, "ray")


def check_partitioned_paused_evaluation(runtime):
    """A model-parallel replica is held by its head partition: the others wait for its next message."""
    from distbelief import RunConfig
    from distbelief.api import train_task

    probe = PausedProbe()
    cfg = RunConfig(runtime=runtime, model="lc1d", replicas=1, partitions=2, shards=2, batch_size=32,
                    num_samples=2000, max_seconds=120, eval_every_seconds=0.2, evaluation="paused")
    res = train_task(cfg, quiet=True, hooks=Faults(on_evaluation=probe))
    assert res.summary["stop_reason"] == "evaluations probed"
    assert len(probe.held) >= 3 and all(probe.held), probe.held
    assert all(probe.clock_still), probe.clock_still


@pytest.mark.slow
def test_inprocess_partitioned_replicas_hold_still_while_the_driver_evaluates():
    check_partitioned_paused_evaluation("inprocess")


@pytest.mark.ray
@pytest.mark.slow
def test_ray_partitioned_replicas_hold_still_while_the_driver_evaluates(ray_local):
    # ray_local as a plain argument: conftest's ordering and teardown hooks see it (item.fixturenames)
    check_partitioned_paused_evaluation("ray")


class SteppingProbe:
    """An evaluation probe for concurrent evaluation: waits, inside the evaluation, until every replica has
    taken a step since the probe began (a replica held by the driver never would: the 60 s wait then runs out
    and the evaluation is recorded as not stepped). Ends the run after ``evaluations`` evaluations."""

    def __init__(self, evaluations: int = 3):
        self.evaluations = evaluations
        self.stepped: list[bool] = []

    def __call__(self, trainer, record):
        if trainer.stop_reason:
            return
        before = replica_steps(trainer)
        deadline = time.monotonic() + 60
        moved = False
        while not moved and time.monotonic() < deadline:
            moved = all(a > b for a, b in zip(replica_steps(trainer), before))
            if not moved:
                time.sleep(0.005)
        self.stepped.append(moved)
        if len(self.stepped) >= self.evaluations:
            trainer.request_stop("evaluations probed")


@pytest.mark.slow
def test_concurrent_evaluation_lets_the_replicas_train_meanwhile(toy_data):
    """evaluation = "concurrent" (auto picks it where the driver has a core of its own): no pause."""
    probe = SteppingProbe()
    res = train(make_odd_model, toy_data[0], toy_data[1], quiet=True, runtime="inprocess", replicas=2, shards=2,
                max_seconds=120, eval_every_seconds=0.2, batch_size=8, evaluation="concurrent",
                hooks=Faults(on_evaluation=probe))
    assert res.summary["stop_reason"] == "evaluations probed"
    assert len(probe.stepped) >= 3 and all(probe.stepped)  # the replicas stepped during every evaluation
    assert res.summary["evaluation"] == "concurrent"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_auto_evaluation_is_concurrent_only_when_the_replicas_leave_a_core_free(toy_data):
    import os

    cores = os.cpu_count()
    common = dict(quiet=True, runtime="ray", shards=1, max_steps=5, max_seconds=0, eval_every_seconds=3600,
                  batch_size=8)
    busy = train(make_odd_model, toy_data[0], toy_data[1], replicas=2, threads=cores // 2, **common)
    assert busy.summary["evaluation"] == "paused"
    free = train(make_odd_model, toy_data[0], toy_data[1], replicas=1, threads=cores - 1, **common)
    assert free.summary["evaluation"] == ("concurrent" if cores > 1 else "paused")


def test_the_schedule_stretches_the_interval_to_nine_evaluations_and_says_so_once():
    from distbelief.metrics import EvalSchedule

    told = []
    schedule = EvalSchedule(0.05, told.append)
    assert schedule.interval(0.001) == 0.05  # a fast evaluation: the cadence asked for
    assert schedule.interval(0.1) == pytest.approx(0.9) and schedule.interval(0.4) == pytest.approx(3.6)
    assert len(told) == 1 and "--eval-every-seconds" in told[0] and "--eval-samples" in told[0]


@pytest.mark.slow
def test_slow_evaluations_are_spaced_out_to_a_tenth_of_the_run(toy_data, capsys):
    """An evaluation that takes at least 0.1 s (the probe sleeps) with --eval-every-seconds 0.05: the driver
    schedules the next one 9x its measured duration of training later (evaluation stays under 10 % of the run's
    time), so consecutive evaluations are at least 0.9 s apart on the training clock whatever the machine's
    speed; and the user is told why, naming the flags."""
    times = []

    def slow_evaluation(trainer, record):
        if trainer.stop_reason:  # the final evaluation
            return
        times.append(record["wall_s"])
        time.sleep(0.1)
        if len(times) == 3:
            trainer.request_stop("three slow evaluations")

    res = train(make_odd_model, toy_data[0], toy_data[1], runtime="inprocess", replicas=1, shards=1,
                max_seconds=120, eval_every_seconds=0.05, batch_size=8, hooks=Faults(on_evaluation=slow_evaluation))
    assert res.summary["stop_reason"] == "three slow evaluations"
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(gaps) == 2 and min(gaps) >= 0.9 - 1e-3, gaps  # (wall_s is rounded to the ms)
    err = capsys.readouterr().err
    assert "--eval-every-seconds" in err and "--eval-samples" in err
