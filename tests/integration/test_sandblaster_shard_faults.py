"""Sandblaster survives the death of a parameter shard (in-process runtime; the Ray version is in
test_sandblaster_ray.py): every shard checkpoints all its vectors at the start of each L-BFGS iteration; a dead
shard is restarted from there, every shard rolls back, the iteration is redone, and the run ends exactly where an
undisturbed run ends."""

import pytest
import torch

from distbelief import train
from distbelief.exceptions import RoleFailedError
from distbelief.ps.checkpoint import CorruptCheckpoint, shard_dir
from distbelief.ps.shard import ParameterShard
from distbelief.runtime.inprocess import InProcessRuntime
from distbelief.sandblaster.lbfgs import LBFGSSettings
from distbelief.testing import Faults
from tests.integration.sandblaster_support import build, logreg_data, logreg_model, reference_lbfgs

ITERATIONS, HISTORY, SHARDS, REPLICAS = 12, 5, 3, 2


@pytest.fixture(scope="module")
def logreg():
    ds = logreg_data()
    return ds, reference_lbfgs(logreg_model, ds, ITERATIONS, LBFGSSettings(history=HISTORY))


@pytest.fixture(scope="module")
def undisturbed(logreg, tmp_path_factory):
    """The same run (checkpointing on) with no failure: the parameters a disturbed run must end with."""
    rt = InProcessRuntime()
    try:
        coord, read = build(rt, logreg_model, logreg[0], SHARDS, REPLICAS, history=HISTORY,
                            checkpoint_dir=str(tmp_path_factory.mktemp("ckpt")))
        for _ in range(ITERATIONS):
            assert coord.step().accepted
        assert coord.counters.shard_restarts == 0
        return read()
    finally:
        rt.shutdown()


@pytest.fixture
def runtime():
    rt = InProcessRuntime()
    yield rt
    rt.shutdown()


@pytest.mark.slow
def test_shard_killed_mid_gradient_evaluation_is_restarted_and_the_result_is_unchanged(
        runtime, logreg, undisturbed, tmp_path):
    """At iteration 4, once part of the batch gradient has reached the shards, shard 1 dies: it is restarted
    from the iteration-4 checkpoint of all its vectors, the partial iteration is discarded and redone, and the
    run ends with the undisturbed run's parameters (1e-5) and the single-process oracle's (1e-4)."""
    ds, expected = logreg
    killed = []

    def kill_shard_mid_evaluation(coord):
        q = coord.queue
        if not killed and coord.iterations == 4 and q is not None and coord.counters.portions_done > 0 \
                and not q.all_committed() and any(p.state.name == "COMMITTED" for p in q.portions):
            killed.append(coord.shards[1])
            runtime.kill(coord.shards[1])  # its calls now raise RoleFailedError, like a dead process

    coord, read = build(runtime, logreg_model, ds, SHARDS, REPLICAS, history=HISTORY, push_every_portions=2,
                        checkpoint_dir=str(tmp_path), on_poll=kill_shard_mid_evaluation)
    for _ in range(ITERATIONS):
        assert coord.step().accepted
    assert killed and coord.counters.shard_restarts == 1 and coord.counters.iterations_redone == 1
    assert coord.shards[1] is not killed[0]
    assert coord.iterations == ITERATIONS and coord.stats()["shard_restarts"] == 1
    torch.testing.assert_close(read(), undisturbed, atol=1e-5, rtol=0)
    torch.testing.assert_close(read(), expected, atol=1e-4, rtol=0)


def test_shard_dead_at_the_iteration_checkpoint_rolls_back_one_iteration(runtime, logreg, undisturbed, tmp_path):
    """A shard that dies between iterations fails the next checkpoint: everything rolls back to the previous
    (complete) checkpoint and that iteration is redone; the end result is unchanged."""
    ds, _ = logreg
    coord, read = build(runtime, logreg_model, ds, SHARDS, REPLICAS, history=HISTORY,
                        checkpoint_dir=str(tmp_path))
    for i in range(ITERATIONS):
        if i == 6:
            runtime.kill(coord.shards[0])
        assert coord.step().accepted
    c = coord.counters
    assert c.shard_restarts == 1 and c.iterations_redone == 1 and coord.iterations == ITERATIONS
    torch.testing.assert_close(read(), undisturbed, atol=1e-5, rtol=0)


def test_without_checkpoints_a_dead_shard_still_ends_the_run_with_a_clear_error(runtime, logreg):
    coord, _ = build(runtime, logreg_model, logreg[0], 2, 1, history=HISTORY)
    coord.step()
    runtime.kill(coord.shards[0])
    with pytest.raises(RoleFailedError, match="checkpoint_dir"):
        coord.step()


def test_vector_checkpoint_round_trip_and_checksum(tmp_path):
    shard = ParameterShard(2, 10, 14, [1.0, 2.0, 3.0, 4.0], None, 20)
    shard.execute([("lincomb", "x", [(2.0, "params")]), ("zero", "g0"), ("copy", "params", "s0")])
    shard.checkpoint_vectors(str(tmp_path), 7)
    fetched, _ = shard.fetch()
    shard.execute([("lincomb", "params", [(-1.0, "params")]), ("zero", "x"), ("copy", "x", "tmp")])
    shard.load_vectors(str(tmp_path), 7)
    assert fetched.tolist() == [1.0, 2.0, 3.0, 4.0]  # params restored in place: fetch() sees them
    assert set(shard.vectors) == {"params", "x", "g0", "s0"}  # vectors made after the checkpoint are gone
    assert shard.vectors["x"].tolist() == [2.0, 4.0, 6.0, 8.0]
    again = ParameterShard.from_vectors(str(tmp_path), 2, 7)
    assert (again.lo, again.hi, again.total) == (10, 14, 20)
    assert {k: v.tolist() for k, v in again.vectors.items()} == {k: v.tolist() for k, v in shard.vectors.items()}
    path = shard_dir(tmp_path / "sandblaster", 2) / f"ckpt-{7:012d}.safetensors"
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 0xFF  # flip a bit in the tensor data
    path.write_bytes(bytes(blob))
    with pytest.raises(CorruptCheckpoint):
        ParameterShard.from_vectors(str(tmp_path), 2, 7)


def test_trainer_fault_injection_restarts_a_killed_shard(toy_data, tmp_path):
    """kill_shard_at_step on a Sandblaster run: the shard is restarted, the summary says so, nothing is lost."""
    from tests.conftest import make_odd_model

    res = train(make_odd_model, toy_data[0], toy_data[1], quiet=True, runtime="inprocess", strategy="sandblaster",
                replicas=2, shards=2, lbfgs_batch=256, portion_size=8, max_steps=6, max_seconds=0,
                eval_every_seconds=1, hooks=Faults(kill_shard_at_step=2, kill_shard_id=1, portion_delay_s=0.002),
                out=str(tmp_path / "run"))
    s = res.summary
    # killed during iteration 3 (after 2 finished), always before the run can end at iteration 6
    assert s["shard_restarts"] == 1 and s["updates_lost"] == 0 and s["iterations_redone"] == 1
    assert s["stop_reason"] == "step limit reached" and s["iterations"] == 6
    assert any((tmp_path / "run" / "checkpoints" / "sandblaster").glob("shard-001/ckpt-*.safetensors"))
