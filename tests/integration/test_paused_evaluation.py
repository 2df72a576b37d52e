"""Evaluation never competes with training: Downpour holds its replicas at a step boundary while the driver
evaluates the server's parameters, and the training clock stops meanwhile (as for every other strategy)."""

import time

import pytest

from distbelief.api import train
from tests.conftest import make_odd_model


def replica_steps(trainer) -> list[int]:
    return [trainer.runtime.call(st.role, "stats").result(10)["steps"] for st in trainer.replicas.values()]


def check_paused_evaluation(toy_data, runtime):
    held = []  # per evaluation: did any replica step while the driver was evaluating?

    def slow_evaluation(trainer, record):
        if trainer.stop_reason:  # the final evaluation, after the replicas finished
            return
        before = replica_steps(trainer)
        time.sleep(0.3)  # an evaluation that takes a while: a replica that kept training would step meanwhile
        held.append(replica_steps(trainer) == before)

    t0 = time.monotonic()
    res = train(make_odd_model, toy_data[0], toy_data[1], quiet=True, runtime=runtime, replicas=2, shards=2,
                max_seconds=3, eval_every_seconds=0.5, batch_size=8, callbacks=[slow_evaluation])
    elapsed = time.monotonic() - t0
    assert len(held) >= 3 and all(held)
    # training time excludes the evaluations: the run took its 3 s of training plus every evaluation's 0.3 s
    assert res.summary["wall_s"] == pytest.approx(3, abs=0.5)
    assert elapsed >= res.summary["wall_s"] + 0.3 * len(held)
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
    held = []

    def slow_evaluation(trainer, record):
        if trainer.stop_reason:
            return
        before = replica_steps(trainer)
        time.sleep(0.3)
        held.append(replica_steps(trainer) == before)

    cfg = RunConfig(runtime=runtime, model="lc1d", replicas=2, partitions=2, shards=2, batch_size=32,
                    num_samples=2000, max_seconds=3, eval_every_seconds=0.5)
    res = train_task(cfg, quiet=True, callbacks=[slow_evaluation])
    assert len(held) >= 3 and all(held)
    assert res.summary["wall_s"] == pytest.approx(3, abs=0.5)
