"""Downpour end to end on the in-process runtime: accuracy, run directory contents, failure handling."""

import json

import pytest

from distbelief import RunConfig
from distbelief.api import train_task
from distbelief.testing import Faults

# every run's summary.json; the parameter-server strategies' also hold SUMMARY_FIELDS (fields that do not apply
# to a run, such as a single process's shards, or a target's time when it was missed, are left out)
RUN_FIELDS = {"strategy", "replicas", "final_test_accuracy", "best_test_accuracy", "examples_per_s", "wall_s"}
SUMMARY_FIELDS = RUN_FIELDS | {"shards", "time_to_target_s", "updates_per_shard", "staleness_mean", "staleness_max"}
METRIC_FIELDS = {"wall_s", "updates", "examples", "train_loss", "test_accuracy"}


def check_run_dir(run_dir, strategy, fields=SUMMARY_FIELDS):
    summary = json.loads((run_dir / "summary.json").read_text())
    assert fields <= summary.keys()
    assert summary["strategy"] == strategy
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines and all(METRIC_FIELDS <= rec.keys() for rec in lines)
    walls = [rec["wall_s"] for rec in lines]
    assert walls == sorted(walls)
    assert (run_dir / "config.toml").is_file() and (run_dir / "accuracy.png").stat().st_size > 1000
    assert (run_dir / "params.safetensors").is_file()
    assert not list(run_dir.glob("*.pkl"))
    return summary, lines


@pytest.mark.slow
def test_mnist1d_two_replicas_two_shards_adagrad_reaches_80_percent(tmp_path):
    cfg = RunConfig(runtime="inprocess", replicas=2, shards=2, optimizer="adagrad", lr=0.05,
                    batch_size=32, max_seconds=90, target_accuracy=0.82, eval_every_seconds=2,
                    out=str(tmp_path / "run"))
    res = train_task(cfg, quiet=True)
    summary, lines = check_run_dir(tmp_path / "run", "downpour")
    assert summary["final_test_accuracy"] >= 0.80
    assert summary["time_to_target_s"] is not None and summary["stop_reason"] == "target accuracy reached"
    assert summary["updates"] == sum(summary["updates_per_shard"])
    assert len(summary["updates_per_shard"]) == 2
    assert lines[-1]["updates"] == summary["updates"]
    assert res.summary == summary
    # where the replicas' time went is recorded once they have reported stats
    late = [rec for rec in lines if "replica_compute_s" in rec]
    assert late
    compute, wait = late[-1]["replica_compute_s"], late[-1]["replica_wait_s"]
    # each replica loads every fetched slice into its model (timed as waiting), and no replica's time can
    # exceed the run's: both replicas together spent at most twice the training time
    assert compute > 0 and wait > 0 and compute + wait <= 2 * late[-1]["wall_s"]


def test_warmstart_runs_one_replica_first(tmp_path):
    cfg = RunConfig(runtime="inprocess", replicas=3, shards=2, warmstart_steps=40, max_steps=30, max_seconds=0,
                    batch_size=16, eval_every_seconds=3600, num_samples=2000)
    res = train_task(cfg, quiet=True)
    # replica 0 did its 40 warmstart steps, then 30 more with everyone else.
    assert res.summary["steps_per_replica"] == [70, 30, 30]
    assert res.summary["updates_per_shard"] == [130, 130]


@pytest.mark.slow
def test_sgd_and_sync_baselines_write_the_same_run_format(tmp_path):
    for strategy in ("sgd", "sync"):
        cfg = RunConfig(runtime="inprocess", strategy=strategy, replicas=2, max_steps=50, max_seconds=0,
                        eval_every_seconds=3600, num_samples=2000, out=str(tmp_path / strategy))
        train_task(cfg, quiet=True)
        summary, _ = check_run_dir(tmp_path / strategy, strategy, RUN_FIELDS)
        if strategy == "sgd":  # one process, no shards: no per-shard counts and no staleness, rather than zeros
            assert summary["updates"] == 50
            assert not {"shards", "updates_per_shard", "staleness_mean", "rejected_pushes"} & summary.keys()
        else:
            assert summary["updates_per_shard"][0] == 50


def test_killed_replica_is_restarted_and_run_finishes(tmp_path):
    cfg = RunConfig(runtime="inprocess", replicas=2, shards=2, max_steps=400, max_seconds=0, eval_every_seconds=1,
                    num_samples=2000)
    res = train_task(cfg, quiet=True, hooks=Faults(kill_replica_at_step=100, kill_replica_id=1))
    assert res.summary["replica_restarts"] == 1 and res.summary["replicas_lost"] == 0
    # the restarted replica did exactly the steps its first incarnation had left
    assert res.summary["stop_reason"] == "step limit reached" and res.summary["steps_per_replica"] == [400, 400]


def test_replica_beyond_its_restarts_is_dropped_and_the_run_goes_on(capsys):
    cfg = RunConfig(runtime="inprocess", replicas=2, shards=2, max_steps=400, max_seconds=0, max_replica_restarts=0,
                    eval_every_seconds=1, num_samples=2000)
    res = train_task(cfg, quiet=False, hooks=Faults(kill_replica_at_step=60, kill_replica_id=0))
    err = capsys.readouterr().err
    assert res.summary["replica_restarts"] == 0 and res.summary["replicas_lost"] == 1
    assert "continuing with 1 replicas" in err
    # The survivor kept training after the loss, to its own step limit; the lost one stopped short of it.
    steps = res.summary["steps_per_replica"]
    assert res.summary["stop_reason"] == "step limit reached" and steps[1] == 400 and steps[0] < 400


@pytest.mark.parametrize("strategy,threads", [("sgd", 2), ("downpour", 1)])
def test_train_gives_the_caller_its_torch_thread_count_back(toy_data, strategy, threads):
    """A run sets this process's torch threads (the single process's `threads`; 1 for a driver that only
    evaluates); a notebook calling train() keeps its own setting afterwards."""
    import torch

    from distbelief import train
    from tests.conftest import make_odd_model

    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        train(make_odd_model, toy_data[0], toy_data[1], quiet=True, strategy=strategy, threads=threads,
              runtime="inprocess", max_steps=3, max_seconds=0, eval_every_seconds=3600, batch_size=8)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
