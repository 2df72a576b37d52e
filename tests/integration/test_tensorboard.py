"""``tensorboard``: every metrics record's scalars in RUN_DIR/tensorboard/, read back with TensorBoard's reader.

The event files are checked against metrics.jsonl of the same run (same points, same values), and the bytes the
shards report against the exact oracle: every applied push delivers each shard its whole range, 4 bytes each.
"""

import json
import math
import subprocess
import sys

import pytest

from distbelief import train
from distbelief.cli import build_parser, config_from_args
from distbelief.metrics import TENSORBOARD_DIR, RunRecorder, tensorboard_scalars
from distbelief.ps.sharding import ShardLayout
from distbelief.testing import Faults
from tests.conftest import make_odd_model

PLAIN_TAGS = {"train_loss": "train/loss", "test_accuracy": "test/accuracy", "test_loss": "test/loss",
              "examples_per_s": "throughput/examples_per_s", "staleness_mean": "staleness/mean",
              "staleness_max": "staleness/max", "bytes_pushed": "bytes/pushed",
              "bytes_fetched": "bytes/fetched", "rejected_pushes": "server/rejected_pushes"}
N_PARAMS = sum(p.numel() for p in make_odd_model().parameters())


def read_scalars(log_dir) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0 = keep every point
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


def check_event_files_match_metrics(run_dir, shards: int) -> list[dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scalars = read_scalars(run_dir / TENSORBOARD_DIR)
    assert len(recs) >= 2
    steps = [r["updates"] for r in recs]
    for key, tag in PLAIN_TAGS.items():
        want = [(r["updates"], r[key]) for r in recs if r.get(key) is not None]
        got = [(e.step, e.value) for e in scalars[tag]]
        assert [s for s, _ in got] == [s for s, _ in want], tag
        for (_, g), (_, w) in zip(got, want):
            assert g == pytest.approx(w, rel=1e-6), tag  # TensorBoard stores float32
    sizes = ShardLayout.balanced(N_PARAMS, shards).sizes()
    rate_tags = ["bytes/pushed_per_s", "bytes/fetched_per_s"]
    rate_tags += [f"shard/{k}/updates_per_s" for k in range(shards)]
    for tag in rate_tags:  # one rate per record, the first against the start (values checked below)
        assert [e.step for e in scalars[tag]] == steps, tag
    assert steps == sorted(steps)
    assert all(0 <= e.value <= 1 for e in scalars["test/accuracy"])
    prev = {"wall_s": 0.0, "bytes_pushed": 0, "updates_per_shard": [0] * shards}
    for r, e_push, e_rate0 in zip(recs, scalars["bytes/pushed_per_s"], scalars["shard/0/updates_per_s"]):
        dt = r["wall_s"] - prev["wall_s"]
        assert e_push.value == pytest.approx((r["bytes_pushed"] - prev["bytes_pushed"]) / dt, rel=1e-5)
        assert e_rate0.value == pytest.approx((r["updates_per_shard"][0] - prev["updates_per_shard"][0]) / dt,
                                              rel=1e-5)
        prev = r
    for r in recs:
        # Exact oracle: no push was rejected or duplicated, so shard k read 4 * size_k bytes per update.
        assert r["rejected_pushes"] == 0
        assert r["bytes_pushed"] == sum(4 * u * m for u, m in zip(r["updates_per_shard"], sizes))
        # Every fetch serves a whole slice from every shard, and the driver read once per evaluation so far.
        # The shards are read one after another while replicas keep fetching, so a record can count a fetch on
        # one shard and not yet on the next: whole slices, not necessarily whole vectors.
        assert r["bytes_fetched"] % (4 * math.gcd(*sizes)) == 0 and r["bytes_fetched"] >= 4 * N_PARAMS
    assert recs[-1]["bytes_pushed"] > 0
    return recs


def test_downpour_inprocess_writes_every_record_to_tensorboard(tmp_path, toy_data):
    evaluations = []

    def stop_after_three(driver, record):  # the run's length in evaluations, however fast this machine is
        evaluations.append(record)
        if len(evaluations) == 3:
            driver.request_stop("three evaluations")

    res = train(make_odd_model, toy_data[0], toy_data[1], runtime="inprocess", replicas=2, shards=2,
                max_steps=10**6, max_seconds=0, eval_every_seconds=0.25, batch_size=8, tensorboard=True,
                hooks=Faults(on_evaluation=stop_after_three), out=str(tmp_path / "run"), quiet=True)
    recs = check_event_files_match_metrics(tmp_path / "run", shards=2)
    assert len(evaluations) >= 3 and len(recs) == len(res.metrics) >= 3
    assert recs[-1]["bytes_fetched"] >= len(recs) * 4 * N_PARAMS


def test_rates_between_records_and_what_is_left_out():
    prev = {"wall_s": 2.0, "updates_per_shard": [10, 20], "bytes_pushed": 1000, "bytes_fetched": 500}
    rec = {"wall_s": 4.0, "updates": 50, "updates_per_shard": [20, 30], "bytes_pushed": 3000,
           "bytes_fetched": 300, "train_loss": None, "test_accuracy": 0.5, "staleness_mean": 1.5}
    s = tensorboard_scalars(rec, prev)
    assert s == {"test/accuracy": 0.5, "staleness/mean": 1.5, "bytes/pushed": 3000.0, "bytes/fetched": 300.0,
                 "bytes/pushed_per_s": 1000.0, "shard/0/updates_per_s": 5.0, "shard/1/updates_per_s": 5.0}
    # bytes_fetched went down above (a restarted shard counts again): no rate rather than a negative one.
    # The first record of a fresh run: rates since the start, every counter zero then.
    first = tensorboard_scalars({"wall_s": 4.0, "updates_per_shard": [8], "bytes_pushed": 40},
                                {"wall_s": 0.0})
    assert first == {"bytes/pushed": 40.0, "bytes/pushed_per_s": 10.0, "shard/0/updates_per_s": 2.0}
    # an sgd-style record: no shard counters, nothing invented
    assert tensorboard_scalars({"wall_s": 1.0, "updates": 3, "test_loss": 0.25}, {"wall_s": 0.0}) == {
        "test/loss": 0.25}


def test_without_a_run_directory_it_warns_and_records_in_memory():
    with pytest.warns(UserWarning, match="tensorboard has no effect without a run directory"):
        rec = RunRecorder(None, {"tensorboard": True}, quiet=True)
    rec.record({"wall_s": 1.0, "updates": 1, "test_accuracy": 0.5})
    rec.finish({"wall_s": 1.0})
    assert len(rec.records) == 1


@pytest.mark.slow
def test_cli_flag_and_lazy_import(tmp_path):
    args = build_parser().parse_args(["train", "--tensorboard", "--out", str(tmp_path / "r")])
    assert config_from_args(args).tensorboard is True
    args = build_parser().parse_args(["train", "--out", str(tmp_path / "r")])
    assert config_from_args(args).tensorboard is False
    # A run without --tensorboard never imports it (start-up time); the in-process run above shows it writes.
    code = ("import sys; from distbelief.metrics import RunRecorder; import distbelief.api, distbelief.cli\n"
            "r = RunRecorder(sys.argv[1], {'tensorboard': False}, quiet=True)\n"
            "r.record({'wall_s': 1.0, 'updates': 1}); r.finish({})\n"
            "print(sorted(m for m in sys.modules\n"
            "             if m.startswith(('tensorboard', 'torch.utils.tensorboard'))))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    run_dir = tmp_path / "run"
    assert (run_dir / "metrics.jsonl").is_file() and not (run_dir / TENSORBOARD_DIR).exists()


@pytest.mark.slow
@pytest.mark.ray
def test_downpour_on_ray_bytes_match_the_push_oracle(tmp_path, toy_data, ray_local):
    replicas, steps, push_every = 2, 12, 3
    res = train(make_odd_model, toy_data[0], toy_data[1], runtime="ray", replicas=replicas, shards=3,
                max_steps=steps, push_every=push_every, max_seconds=0, eval_every_seconds=0.5, batch_size=8,
                tensorboard=True, out=str(tmp_path / "run"), quiet=True)
    pushes = replicas * steps // push_every
    assert res.summary["updates_per_shard"] == [pushes] * 3
    last = res.metrics[-1]
    assert last["bytes_pushed"] == pushes * 4 * N_PARAMS  # each shard read only its range of the one put
    scalars = read_scalars(tmp_path / "run" / TENSORBOARD_DIR)
    assert scalars["bytes/pushed"][-1].value == pytest.approx(last["bytes_pushed"], rel=1e-6)
    assert math.isclose(scalars["test/accuracy"][-1].value, last["test_accuracy"], rel_tol=1e-6)
    assert {f"shard/{k}/updates_per_s" for k in range(3)} <= scalars.keys()
