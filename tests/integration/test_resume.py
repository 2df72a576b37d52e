"""Resumable runs: driver killed, Ctrl-C, resharding on resume."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from distbelief import RunConfig
from distbelief.api import train_task
from distbelief.ps.optimizers import Adagrad
from distbelief.resume import load_server_state

PY = [sys.executable, "-m", "distbelief.cli"]


def metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wait_for_evals(run_dir, n, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        p = run_dir / "metrics.jsonl"
        if p.is_file() and len(p.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"{run_dir} did not record {n} evaluations in {timeout_s}s")


@pytest.mark.slow
def test_resume_with_a_different_shard_count_continues_exactly(tmp_path):
    out = tmp_path / "run"
    base = dict(runtime="inprocess", replicas=2, shards=2, max_steps=60, max_seconds=0, eval_every_seconds=3600,
                num_samples=2000, batch_size=16, out=str(out))
    first = train_task(RunConfig(**base), quiet=True)
    saved = load_file(str(out / "params.safetensors"))["flat_params"]
    state = load_server_state(out / "checkpoints", saved.numel(), Adagrad(lr=0.05))
    torch.testing.assert_close(state.params, saved, rtol=0, atol=0)
    assert [v for _, _, v in state.versions] == first.summary["updates_per_shard"] == [120, 120]
    # Reshard 2 -> 3 and resume: every replica already did its 60 steps, so nothing moves.
    again = train_task(RunConfig(**{**base, "shards": 3}), quiet=True, resume=True)
    torch.testing.assert_close(again.flat_params, saved, rtol=0, atol=0)
    assert again.summary["shards"] == 3 and again.summary["steps_per_replica"] == [60, 60]
    assert not list(tmp_path.glob("run/checkpoints.before-resume-*"))
    # Now ask for more steps: training continues from there on 3 shards.
    more = train_task(RunConfig(**{**base, "shards": 3, "max_steps": 80}), quiet=True, resume=True)
    assert more.summary["steps_per_replica"] == [80, 80]
    assert more.summary["updates_per_shard"] == [160, 160, 160]


@pytest.mark.slow
def test_driver_killed_then_resumed_continues_metrics_and_counters(tmp_path):
    out = tmp_path / "run"
    cmd = PY + ["train", "--runtime", "inprocess", "--replicas", "2", "--shards", "2", "--max-seconds", "60",
                "--eval-every-seconds", "1", "--num-samples", "4000", "--checkpoint-every-seconds", "2",
                "--durability", "log", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_evals(out, 3)
    finally:
        proc.send_signal(signal.SIGKILL)  # no clean-up of any kind
        proc.wait(30)
    before = metrics(out)
    r = subprocess.run(PY + ["train", "--resume", str(out), "--max-seconds", str(before[-1]["wall_s"] + 3)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stderr
    after = metrics(out)[len(before):]
    assert after, "the resumed run recorded no evaluation"
    walls = [m["wall_s"] for m in before + after]
    assert walls == sorted(walls)
    # The shards' logs were replayed: nothing acknowledged before the kill is lost.
    assert after[0]["updates"] >= before[-1]["updates"]
    assert after[0]["examples"] >= before[-1]["examples"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_test_accuracy"] > 0.5


@pytest.mark.slow
def test_ctrl_c_writes_a_final_checkpoint_and_exits_130(tmp_path):
    out = tmp_path / "run"
    cmd = PY + ["train", "--runtime", "inprocess", "--max-seconds", "120", "--eval-every-seconds", "1",
                "--num-samples", "2000", "--checkpoint-every-seconds", "0", "--durability", "log", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_evals(out, 2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "--resume" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted"
    state = load_server_state(out / "checkpoints", summary["num_parameters"], Adagrad(lr=0.05))
    assert [v for _, _, v in state.versions] == summary["updates_per_shard"]


@pytest.mark.slow
def test_sigterm_is_handled_like_ctrl_c(tmp_path):
    out = tmp_path / "run"
    cmd = PY + ["train", "--runtime", "inprocess", "--max-seconds", "120", "--eval-every-seconds", "1",
                "--num-samples", "2000", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ)
    wait_for_evals(out, 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 130
    assert json.loads((out / "summary.json").read_text())["stop_reason"] == "interrupted"


@pytest.mark.slow
def test_resume_over_a_corrupted_checkpoint_uses_the_previous_one_and_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    base = dict(runtime="inprocess", replicas=2, shards=2, max_steps=60, max_seconds=0, eval_every_seconds=3600,
                num_samples=2000, batch_size=16, checkpoint_every_updates=25, durability="log", out=str(out))
    train_task(RunConfig(**base), quiet=True)
    saved = load_file(str(out / "params.safetensors"))["flat_params"]
    newest = sorted((out / "checkpoints" / "shard-000").glob("ckpt-*.safetensors"))[-1]
    raw = bytearray(newest.read_bytes())
    raw[-5] ^= 0x55  # one flipped byte in the tensor data
    newest.write_bytes(bytes(raw))
    again = train_task(RunConfig(**base), quiet=False, resume=True)
    err = capsys.readouterr().err
    assert "skipped a damaged checkpoint" in err and newest.name in err
    # The older checkpoint plus the write-ahead log rebuilt exactly the state that was lost.
    torch.testing.assert_close(again.flat_params, saved, rtol=0, atol=0)
    assert again.summary["updates_per_shard"] == [120, 120]


@pytest.mark.slow
def test_partitioned_run_resumes_and_reshards(tmp_path):
    base = dict(runtime="inprocess", model="lc1d", partitions=2, replicas=2, shards=2, max_steps=30, max_seconds=0,
                eval_every_seconds=3600, num_samples=2000, batch_size=16, out=str(tmp_path / "run"))
    first = train_task(RunConfig(**base), quiet=True)
    assert first.summary["steps_per_replica"] == [30, 30]
    again = train_task(RunConfig(**{**base, "shards": 3, "max_steps": 40}), quiet=True, resume=True)
    assert again.summary["steps_per_replica"] == [40, 40]
    # Each partition pushes its own range; every shard received the 10 extra steps of both replicas.
    assert all(u >= 60 + 2 * 10 for u in again.summary["updates_per_shard"])
    assert torch.isfinite(again.flat_params).all()
