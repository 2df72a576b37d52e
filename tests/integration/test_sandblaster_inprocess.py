"""Sandblaster L-BFGS on the in-process runtime: oracles, exactly-once, coordinator bytes, failures, the trainer."""

import json

import pytest
import torch

from distbelief import ConfigError, RunConfig, train
from distbelief.api import train_task
from distbelief.cli import main
from distbelief.runtime.inprocess import InProcessRuntime
from distbelief.sandblaster.lbfgs import LBFGSSettings
from distbelief.testing import Faults
from tests.integration.sandblaster_support import (
    CountingRuntime,
    build,
    full_batch_gradient,
    held_only_by,
    logreg_data,
    logreg_model,
    reference_lbfgs,
    wide_model,
)
from tests.integration.test_downpour_inprocess import RUN_FIELDS, check_run_dir

ITERATIONS, HISTORY = 15, 5


@pytest.fixture(scope="module")
def logreg():
    ds = logreg_data()
    return ds, reference_lbfgs(logreg_model, ds, ITERATIONS, LBFGSSettings(history=HISTORY))


@pytest.fixture
def runtime():
    rt = InProcessRuntime()
    yield rt
    rt.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("shards,replicas", [(1, 1), (1, 3), (3, 1), (3, 3)])
def test_convex_oracle_matches_single_process_lbfgs(runtime, logreg, shards, replicas):
    ds, expected = logreg
    coord, read = build(runtime, logreg_model, ds, shards, replicas, history=HISTORY)
    for _ in range(ITERATIONS):
        assert coord.step().accepted
    torch.testing.assert_close(read(), expected, atol=1e-4, rtol=0)
    c = coord.counters
    assert coord.iterations == ITERATIONS and c.portions_done == c.gradient_evals * 16  # 512 / 32


def shard_vector(coord, name: str) -> torch.Tensor:
    """Test-side read of a named vector from the in-process shards (the coordinator has no such operation)."""
    return torch.cat([s.handle.obj.vectors[name] for s in coord.shards])


def test_exactly_once_with_a_backup_of_every_portion(runtime):
    ds = logreg_data(n=509)  # an uneven last portion
    coord, _ = build(runtime, logreg_model, ds, 3, 3, portion_size=8, push_every_portions=3, force_backups=True)
    loss = coord.evaluate_gradient("g")
    expected = full_batch_gradient(logreg_model, ds)
    torch.testing.assert_close(shard_vector(coord, "g"), expected, atol=1e-5, rtol=0)
    q = coord.queue
    assert q.backups_issued >= len(q) // 2 and q.duplicates >= 1  # the dedupe path really ran
    assert coord.counters.portions_done == len(q)  # each portion committed once
    ref = torch.nn.functional.cross_entropy(logreg_model()(ds.tensors[0]), ds.tensors[1]).item()
    assert loss == pytest.approx(ref, rel=1e-5)


def test_coordinator_receives_only_scalars(runtime):
    """Bytes the coordinator receives per iteration stay O(shards x ops) scalars, whatever the model size."""
    ds = torch.utils.data.TensorDataset(torch.randn(256, 500), torch.randint(0, 100, (256,)))
    counting = CountingRuntime(runtime)
    coord, _ = build(runtime, wide_model, ds, 3, 2, history=4, portion_size=32, coordinator_runtime=counting)
    num_params = 500 * 100 + 100
    iterations = 4
    for _ in range(iterations):
        coord.step()
    per_iteration = counting.bytes_received / iterations
    vector_bytes = 4 * num_params
    assert counting.forwarded > 0  # gradients did move, replica -> shards, around the coordinator
    assert counting.largest_value < 2_000, "the coordinator received something vector-sized"
    assert per_iteration < vector_bytes / 20, (per_iteration, vector_bytes)
    # O(shards x ops): a fixed allowance per call, independent of the parameter count.
    assert counting.bytes_received <= 1_000 * counting.values_received


@pytest.mark.parametrize("backup_tasks", [False, True])
def test_replica_killed_mid_batch_run_completes_and_oracle_holds(runtime, logreg, backup_tasks):
    """At iteration 3 a replica dies while the only copy of some computed portions sits in it, unpushed: they
    are computed again (by re-queueing, or by backup tasks) and counted once; the oracle still holds."""
    ds, expected = logreg
    killed = []

    def kill_while_it_holds_unpushed_portions(coord):
        q = coord.queue
        if not killed and coord.iterations == 3 and q is not None and held_only_by(q, 1):
            killed.append((q, held_only_by(q, 1)))
            runtime.kill(coord.slots[1].role)

    coord, read = build(runtime, logreg_model, ds, 3, 3, history=HISTORY, push_every_portions=4,
                        backup_tasks=backup_tasks, on_poll=kill_while_it_holds_unpushed_portions)
    for _ in range(ITERATIONS):
        assert coord.step().accepted
    assert killed and coord.counters.replica_failures == 1
    q, lost = killed[0]
    assert all(q.portions[p].results >= 2 for p in lost)  # computed again (the restarted replica 1 may do it)
    if not backup_tasks:
        assert coord.counters.portions_requeued >= len(lost)
    assert set(coord.slots) == {0, 1, 2}  # replaced
    torch.testing.assert_close(read(), expected, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_trainer_writes_the_run_directory_with_sandblaster_counters(tmp_path, toy_data):
    from tests.conftest import make_odd_model

    res = train(make_odd_model, toy_data[0], toy_data[1], quiet=True, runtime="inprocess", strategy="sandblaster",
                replicas=2, shards=3, lbfgs_batch=256, portion_size=16, history=4, push_every_portions=2,
                max_steps=6, max_seconds=0, eval_every_seconds=0.01, out=str(tmp_path / "run"))
    summary, lines = check_run_dir(tmp_path / "run", "sandblaster", RUN_FIELDS | {"shards", "updates_per_shard"})
    for key in ("iterations", "portions_done", "portions_duplicated", "line_search_evals"):
        assert key in summary and key in lines[-1]
    # no staleness and no rejected pushes, rather than zeros; no target set: null, not a time
    assert not {"staleness_mean", "staleness_max", "rejected_pushes"} & summary.keys()
    assert summary["time_to_target_s"] is None and summary["target_accuracy"] is None
    assert not {"staleness_mean", "rejected_pushes"} & lines[-1].keys()
    assert summary["updates_lost"] == 0 and summary["replica_restarts"] == 0 and summary["replicas_lost"] == 0
    assert summary["iterations"] == 6 and summary["stop_reason"] == "step limit reached"
    assert summary["line_search_evals"] >= 6 and summary["portions_done"] == 16 * summary["gradient_evals"]
    assert summary["updates_per_shard"] == [6, 6, 6]
    assert lines[-1]["train_loss"] < lines[0]["train_loss"]
    assert res.summary == json.loads((tmp_path / "run" / "summary.json").read_text())


@pytest.mark.slow
def test_trainer_restarts_a_killed_replica(toy_data):
    from tests.conftest import make_odd_model

    res = train(make_odd_model, toy_data[0], toy_data[1], quiet=True, runtime="inprocess", strategy="sandblaster",
                replicas=2, shards=2, lbfgs_batch=256, portion_size=8, max_steps=10, max_seconds=0,
                eval_every_seconds=1, hooks=Faults(kill_replica_at_step=2, kill_replica_id=1, portion_delay_s=0.01))
    # Killed during iteration 3 (after 2 finished). The replacement starts after its backoff (0.5 s, while the
    # other replica goes on alone), well before the run ends: 7 more iterations of at least 16 portions x 10 ms.
    assert res.summary["replica_restarts"] == 1 and res.summary["replicas_lost"] == 0
    assert len(res.summary["replica_recovery_s"]) == 1 and res.summary["replica_recovery_s"][0] >= 0.5  # backoff
    assert res.summary["stop_reason"] == "step limit reached" and res.summary["iterations"] == 10


@pytest.mark.parametrize("field,value", [("portion_size", -1), ("history", 0), ("push_every_portions", -1)])
def test_bad_sandblaster_settings_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        RunConfig(strategy="sandblaster", **{field: value}).validate()


@pytest.mark.parametrize("field,value", [("straggler_slowdown", 0.5), ("straggler_id", 7), ("portion_delay_s", -1)])
def test_bad_straggler_emulation_names_the_field(field, value):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        Faults(**{field: value}).validate(replicas=2, shards=2, partitions=1)


def test_cli_sandblaster_without_backup_tasks(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", "--runtime", "inprocess", "--strategy", "sandblaster", "--no-backup-tasks",
               "--num-samples", "600", "--model", "mlp-small", "--replicas", "2", "--shards", "2",
               "--lbfgs-batch", "480", "--portion-size", "40", "--history", "3", "--push-every-portions", "2",
               "--max-steps", "3", "--max-seconds", "0", "--eval-every-seconds", "100", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "sandblaster" and summary["iterations"] == 3
    assert summary["backup_tasks_issued"] == 0 and summary["portions_duplicated"] == 0
    assert summary["history"] == 3 and summary["lbfgs_batch"] == 480


def test_cli_rejects_a_negative_portion_size(tmp_path, capsys):
    rc = main(["train", "--runtime", "inprocess", "--strategy", "sandblaster", "--portion-size", "-1",
               "--out", str(tmp_path / "run")])
    assert rc == 2 and "error: --portion-size:" in capsys.readouterr().err


def test_minibatch_mode_uses_a_new_batch_each_iteration(tmp_path):
    cfg = RunConfig(runtime="inprocess", strategy="sandblaster", model="mlp-small", num_samples=1000, replicas=2,
                    shards=2, lbfgs_batch=200, portion_size=25, max_steps=5, max_seconds=0, eval_every_seconds=100)
    res = train_task(cfg, quiet=True)
    s = res.summary
    assert s["iterations"] == 5 and s["lbfgs_batch"] == 200
    # a fresh gradient on each new batch plus every line-search trial point
    assert s["gradient_evals"] == s["iterations"] + s["line_search_evals"]
