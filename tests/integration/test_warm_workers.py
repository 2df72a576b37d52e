"""Warm role processes (runtime/warm.py): consecutive runs on the local Ray instance build their roles in the
processes of the last run, and nothing about a run depends on whether its processes were warm."""

import time

import pytest
import ray
import torch

from distbelief import release_workers, train
from distbelief.exceptions import RoleFailedError
from distbelief.runtime.ray_runtime import RayRuntime, role_actor, warm_workers
from tests.integration.warm_support import Other, Waiter, broken, make_dropout_model

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


def role_actors() -> dict[str, str]:
    """Every RoleActor this Ray instance ever started, by actor id: its state (ALIVE, DEAD, ...)."""
    return {k: a["State"] for k, a in ray._private.state.actors().items() if a["ActorClassName"] == "RoleActor"}


RUN = dict(quiet=True, runtime="ray", replicas=1, shards=2, max_steps=12, max_seconds=0, eval_every_seconds=3600,
           batch_size=8, optimizer="adagrad", lr=0.05)


def test_the_next_run_builds_its_roles_in_the_last_runs_processes_and_computes_the_same_bits(toy_data):
    release_workers()
    first = train(make_dropout_model, toy_data[0], toy_data[1], **RUN)  # fresh processes
    assert warm_workers() == 3  # its replica and two shards, idle
    started = role_actors()
    second = train(make_dropout_model, toy_data[0], toy_data[1], **RUN)  # the same processes
    assert role_actors() == started  # no process started, none stopped
    assert warm_workers() == 3
    # Same data order, same dropout masks: a warm replica draws what a fresh one draws.
    assert torch.equal(first.flat_params, second.flat_params)
    # Another shape (two replicas, one shard) takes what fits and starts the rest; the shard left over is stopped.
    train(make_dropout_model, toy_data[0], toy_data[1], **{**RUN, "replicas": 2, "shards": 1})
    now = role_actors()
    assert len(now) == len(started) + 1  # the second replica's
    assert sum(state == "ALIVE" for state in now.values()) == warm_workers() == 3


def test_idle_replicas_give_their_cpus_to_a_run_that_needs_them(toy_data):
    """Two idle replicas hold 2 of the 4 CPUs; two replicas of two partitions each need all 4 (a placement
    group): the idle processes are stopped, not waited for."""
    release_workers()
    train(make_dropout_model, toy_data[0], toy_data[1], **{**RUN, "replicas": 2})
    deadline = time.monotonic() + 10  # (Ray's view of free resources lags a little)
    while abs(ray.available_resources().get("CPU", 0.0) - 2.0) > 0.01 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0.0) == pytest.approx(2.0)
    from distbelief import RunConfig
    from distbelief.api import train_task

    cfg = RunConfig(runtime="ray", model="lc1d", replicas=2, partitions=2, shards=2, max_steps=3, max_seconds=0,
                    eval_every_seconds=3600, remote_timeout_s=60)
    res = train_task(cfg, quiet=True)
    assert res.summary["examples"] > 0
    assert warm_workers() == 2  # the partitioned run's shards (partition processes are never kept)


def test_a_busy_process_is_not_emptied_and_a_role_that_cannot_be_built_fails_its_calls():
    actor = role_actor().options(num_cpus=0, max_concurrency=4, max_restarts=0).remote(1, Waiter)
    try:
        busy = actor.call.remote("wait", 60.0)
        deadline = time.monotonic() + 30
        while not ray.get(actor.call.remote("waiting"), timeout=30) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ray.get(actor.retire.remote(), timeout=30) is False  # a call in flight: stays as it is
        ray.get(actor.call.remote("finish"), timeout=30)
        assert ray.get(busy, timeout=30) == "waited"
        assert ray.get(actor.retire.remote(), timeout=30) is True
        # A call sent to an empty process waits for the next role, and is answered by it.
        waiting = actor.call.remote("name")
        assert ray.wait([waiting], timeout=1.0)[0] == []
        ray.get(actor.become.remote(1, Other), timeout=30)
        assert ray.get(waiting, timeout=30) == "other"
        assert ray.get(actor.retire.remote(), timeout=30) is True
        # A role that cannot be built: its become fails, and so does every call after it.
        with pytest.raises(ray.exceptions.RayTaskError, match="no such role"):
            ray.get(actor.become.remote(1, broken), timeout=30)
        with pytest.raises(ray.exceptions.RayTaskError, match="could not be built"):
            ray.get(actor.call.remote("name"), timeout=30)
        assert ray.get(actor.retire.remote(), timeout=30) is False
    finally:
        ray.kill(actor)


def test_the_runtime_reports_a_role_that_cannot_be_built_in_a_warm_process_as_failed(toy_data):
    release_workers()
    train(make_dropout_model, toy_data[0], toy_data[1], **RUN)
    runtime = RayRuntime()
    try:
        runtime.check_capacity(1)  # (as a run does first: it sizes the shards' stream threads, as the last run's)
        role = runtime.create_shard(0, broken)  # built in a warm shard process
        assert warm_workers() == 2
        with pytest.raises(RoleFailedError, match="no such role"):
            runtime.wait_ready([role])
    finally:
        runtime.shutdown()
    # A failed role's process is not kept (nor are the others of that runtime): the pool still holds the rest
    # of the first run's processes, and nothing else is alive.
    assert warm_workers() == 2
    deadline = time.monotonic() + 10
    while sum(s == "ALIVE" for s in role_actors().values()) > 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sum(s == "ALIVE" for s in role_actors().values()) == 2
