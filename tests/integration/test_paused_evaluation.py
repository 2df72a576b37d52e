"""Evaluation never competes with training: Downpour holds its replicas at a step boundary while the driver
evaluates the server's parameters, and the training clock stops meanwhile (as for every other strategy)."""

import time

import pytest

from distbelief.api import train
from distbelief.testing import Faults
from tests.conftest import make_odd_model


def replica_steps(trainer) -> list[int]:
    return [trainer.runtime.call(st.role, "stats").result(10)["steps"] for st in trainer.replicas.values()]


class StepWatch:
    """An evaluation callback that sleeps 50 ms and records, per evaluation, whether the replicas stood still
    meanwhile (a replica that kept training would step: a step takes a few ms here)."""

    def __init__(self):
        self.held: list[bool] = []

    def __call__(self, trainer, record):
        if trainer.stop_reason:  # the final evaluation, after the replicas finished
            return
        before = replica_steps(trainer)
        time.sleep(0.05)
        self.held.append(replica_steps(trainer) == before)


def check_paused_evaluation(toy_data, runtime):
    watch = StepWatch()
    held = watch.held
    t0 = time.monotonic()
    res = train(make_odd_model, toy_data[0], toy_data[1], quiet=True, runtime=runtime, replicas=2, shards=2,
                max_seconds=3, eval_every_seconds=0.5, batch_size=8, faults=Faults(on_evaluation=watch))
    elapsed = time.monotonic() - t0
    assert held and all(held)
    # training time excludes the evaluations: the run took its 3 s of training plus every evaluation
    assert res.summary["wall_s"] == pytest.approx(3, abs=0.5)
    assert elapsed >= res.summary["wall_s"] + 0.05 * len(held)
    assert res.summary["stop_reason"] == "time budget spent"
    # and training went on between evaluations
    updates = [m["updates"] for m in res.metrics]
    assert updates == sorted(updates) and updates[-1] > updates[0]


def test_inprocess_replicas_hold_still_while_the_driver_evaluates(toy_data):
    check_paused_evaluation(toy_data, "inprocess")


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_ray_replicas_hold_still_while_the_driver_evaluates(toy_data):
    check_paused_evaluation(toy_data, "ray")


@pytest.mark.parametrize("runtime", ["inprocess", pytest.param("ray", marks=pytest.mark.ray)])
def test_partitioned_replicas_hold_still_while_the_driver_evaluates(runtime, request):
    """A model-parallel replica is held by its head partition: the others wait for its next message."""
    from distbelief import RunConfig
    from distbelief.api import train_task

    if runtime == "ray":
        request.getfixturevalue("ray_local")
    watch = StepWatch()
    cfg = RunConfig(runtime=runtime, model="lc1d", replicas=1, partitions=2, shards=2, batch_size=32,
                    num_samples=2000, max_seconds=3, eval_every_seconds=0.5)
    res = train_task(cfg, quiet=True, faults=Faults(on_evaluation=watch))
    assert watch.held and all(watch.held)
    assert res.summary["wall_s"] == pytest.approx(3, abs=0.5)


def test_concurrent_evaluation_lets_the_replicas_train_meanwhile(toy_data):
    """evaluation = "concurrent" (auto picks it where the driver has a core of its own): no pause."""
    watch = StepWatch()
    res = train(make_odd_model, toy_data[0], toy_data[1], quiet=True, runtime="inprocess", replicas=2, shards=2,
                max_seconds=2, eval_every_seconds=0.5, batch_size=8, evaluation="concurrent",
                faults=Faults(on_evaluation=watch))
    assert watch.held and not any(watch.held)  # the replicas stepped during every evaluation
    assert res.summary["evaluation"] == "concurrent"


@pytest.mark.ray
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


def test_slow_evaluations_are_spaced_out_to_a_tenth_of_the_run(toy_data, capsys):
    """An evaluation that takes 0.4 s with --eval-every-seconds 0.2: the interval grows to ~3.6 s of training
    (evaluation stays under 10 % of the run's time) and the user is told why, naming the flags."""
    times = []

    def slow_evaluation(trainer, record):
        times.append(record["wall_s"])
        time.sleep(0.4)

    train(make_odd_model, toy_data[0], toy_data[1], runtime="inprocess", replicas=1, shards=1, max_seconds=8,
          eval_every_seconds=0.2, batch_size=8, faults=Faults(on_evaluation=slow_evaluation))
    gaps = [b - a for a, b in zip(times, times[1:-1])]  # the last one is the final evaluation
    assert gaps and min(gaps) >= 3.5
    err = capsys.readouterr().err
    assert "--eval-every-seconds" in err and "--eval-samples" in err
