"""A run whose loss becomes non-finite or explodes stops early with a DivergedError naming --lr; its workers are
cleaned up; the rule does not trip on a normal noisy run."""

import json
import math
import threading
import time

import pytest

from distbelief import RunConfig
from distbelief.api import train_task
from distbelief.cli import main
from distbelief.exceptions import DistBeliefError, DivergedError
from distbelief.metrics import DIVERGENCE_CEILING, DivergenceWatch, RunRecorder, divergence_message

# A step budget the run never gets near: only the divergence rule can end it early.
BASE = dict(runtime="inprocess", num_samples=1000, max_steps=10**6, max_seconds=0, eval_every_seconds=0.2,
            optimizer="sgd", lr=1e4)


def _extra_threads(before: set[int], wait_s: float = 5.0) -> list[str]:
    """Threads started since ``before`` that are still alive after up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        extra = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.1)


@pytest.mark.parametrize("strategy", ["sgd", "downpour"])
def test_a_diverging_run_stops_early_naming_the_rate(strategy, tmp_path):
    before = {t.ident for t in threading.enumerate()}
    out = tmp_path / "run"
    with pytest.raises(DivergedError) as err:
        train_task(RunConfig(**BASE, strategy=strategy, out=str(out)), quiet=True)
    msg = str(err.value)
    assert msg.startswith("training diverged at ") and "--lr 1000 (now 10000)" in msg, msg
    assert isinstance(err.value, DistBeliefError)
    # the diverged evaluation is in the run directory; no replica or shard thread outlives the run
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    last = lines[-1]
    assert last["test_loss"] is None or last["test_loss"] > 10 or last["train_loss"] is None
    # it stopped at the first evaluation after training began (a rate of 1e4 explodes the loss in a step or
    # two), not after its step budget
    assert last["updates"] > 0 and all(x["updates"] == 0 for x in lines[:-1]), lines
    assert _extra_threads(before) == []


def test_cli_prints_divergence_as_an_error(tmp_path, capsys):
    rc = main(["train", "--runtime", "inprocess", "--strategy", "sgd", "--optimizer", "sgd", "--lr", "1e4",
               "--num-samples", "1000", "--max-seconds", "30", "--eval-every-seconds", "0.2",
               "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 1 and "distbelief: error: training diverged at" in err and "--lr" in err


@pytest.mark.slow
def test_a_normal_run_at_the_recommended_rate_does_not_trip():
    res = train_task(RunConfig(runtime="inprocess", strategy="sgd", num_samples=2000, max_steps=300,
                               max_seconds=0, eval_every_seconds=0.05), quiet=True)
    assert res.summary["stop_reason"] == "step limit reached" and len(res.metrics) >= 2


# ---------------------------------------------------------------- the rule itself
def _watch(losses, key="train_loss"):
    w = DivergenceWatch()
    return [w.check({key: v}) for v in losses]


def test_noisy_and_improving_losses_never_trip():
    # noise, a bad stretch (3x the first), a small first loss that grows but stays below the floor
    assert _watch([2.3, 2.9, 1.5, 6.9, 1.0, 0.2]) == [None] * 6
    assert _watch([0.05, 0.4, 3.0, 9.9]) == [None] * 4
    assert _watch([None, 2.3, None]) == [None] * 3  # no loss yet (sgd before its first step)
    assert _watch([-1.0, -0.5, 3.0]) == [None] * 3  # a loss that may be negative (a custom loss_fn)


@pytest.mark.parametrize("losses,where,text", [
    ([2.3, 2.1, math.nan], 2, "train loss nan"),
    ([2.3, math.inf], 1, "train loss inf"),
    ([2.3, 1.9, 30.0], 2, "train loss 30 (was 2.3 at the first evaluation)"),
    ([117.0], 0, f"above {DIVERGENCE_CEILING:g}"),  # exploded before the first evaluation
])
def test_non_finite_exploded_and_huge_losses_trip_once(losses, where, text):
    got = _watch(losses + [math.nan, 1e9])
    assert got[where] is not None and text in got[where]
    assert [g for g in got if g is not None] == [got[where]]  # fires once


def test_test_loss_is_watched_too():
    got = _watch([2.3, 2.2, 40.0], key="test_loss")
    assert got[2].startswith("test loss 40")


def test_recorder_writes_the_diverged_record_then_raises(tmp_path):
    rec = RunRecorder(tmp_path, {"strategy": "downpour", "lr": 0.05}, quiet=True)
    rec.record({"wall_s": 1.0, "train_loss": 2.3, "test_loss": 2.3})
    with pytest.raises(DivergedError, match=r"at 2\.0s: test loss nan; lower the learning rate, e\.g\. --lr "
                                            r"0\.005 \(now 0\.05\)"):
        rec.record({"wall_s": 2.0, "train_loss": 2.0, "test_loss": math.nan})
    rec.record({"wall_s": 3.0, "train_loss": math.nan, "test_loss": math.nan})  # the final evaluation: no raise
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and lines[1]["test_loss"] is None


def test_sandblaster_is_told_it_takes_no_rate():
    msg = divergence_message({"strategy": "sandblaster", "lr": 0.05, "lbfgs_batch": 8000, "history": 10}, 3.0,
                             "train loss nan")
    assert "takes no --lr" in msg and "--lbfgs-batch (now 8000)" in msg


def sum_cross_entropy(out, y):
    """A summed loss: its scale grows with the batch (here far above 50 at the start), yet it trains fine."""
    import torch.nn.functional as F

    return F.cross_entropy(out, y, reduction="sum")


def test_a_custom_loss_on_another_scale_is_judged_by_the_relative_rule_only(toy_data):
    from distbelief import train
    from tests.conftest import make_odd_model

    res = train(make_odd_model, toy_data[0], toy_data[1], quiet=True, runtime="inprocess", strategy="sgd",
                loss_fn=sum_cross_entropy, lr=0.001, batch_size=64, max_steps=40, max_seconds=0,
                eval_every_seconds=0.05)
    assert res.metrics[0]["train_loss"] is None or res.metrics[0]["test_loss"] > 50  # above the ceiling
    assert res.summary["stop_reason"] == "step limit reached"
