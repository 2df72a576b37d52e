"""Resumable Sandblaster runs: the coordinator's scalars are saved with the shards' iteration checkpoints, so a run
stopped (Ctrl-C, SIGTERM) or killed (SIGKILL) continues — with any number of shards — and takes exactly the steps
of an uninterrupted run. In process, one replica: the push order is fixed, so "exactly" is checked to 1e-5."""

import json
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from distbelief import ConfigError, train
from distbelief.ps.checkpoint import load_checkpoint
from distbelief.sandblaster.state import read_state, vectors_root
from tests.integration.sandblaster_support import D_IN, logreg_data, logreg_model

N, K = 10, 4  # iterations of the whole run; iterations before the break
PY = [sys.executable, "-m", "distbelief.cli"]


def split():
    ds = logreg_data(640)
    x, y = ds.tensors
    return TensorDataset(x[:512], y[:512]), TensorDataset(x[512:], y[512:])


TRAIN, TEST = split()
BATCHES = {"full batch": 512, "minibatch": 128}


def settings(out, batch: int = 512, **over) -> dict:
    return {**dict(runtime="inprocess", strategy="sandblaster", replicas=1, shards=2, lbfgs_batch=batch,
                   portion_size=64, history=4, max_seconds=0, eval_every_seconds=3600, quiet=True, out=str(out)),
            **over}


def run(out, batch: int = 512, model_fn=logreg_model, **over):
    return train(model_fn, TRAIN, TEST, **settings(out, batch, **over))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """N iterations in one go, per batch mode: what every resumed run must end with."""
    return {mode: run(tmp_path_factory.mktemp("ref"), batch, max_steps=N) for mode, batch in BATCHES.items()}


def metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def newest_state(out) -> dict:
    return read_state(sorted(vectors_root(out / "checkpoints").glob("state-*.json"))[-1])


def checkpoint_params(out, state: dict) -> torch.Tensor:
    """The ``params`` vector of the iteration checkpoint ``state`` names, from the shards' files."""
    parts = []
    for k in range(len(state["shards"])):
        path = vectors_root(out / "checkpoints") / f"shard-{k:03d}" / f"ckpt-{state['tag']:012d}.safetensors"
        parts.append(load_checkpoint(path)[1]["vec.params"])
    return torch.cat(parts)


def same_run(a, b):
    torch.testing.assert_close(a.flat_params, b.flat_params, atol=1e-5, rtol=0)
    for key in ("iterations", "gradient_evals", "line_search_evals", "portions_done", "examples"):
        assert a.summary[key] == b.summary[key], key


@pytest.mark.parametrize("mode", list(BATCHES))
def test_a_resumed_run_takes_the_same_steps_as_an_uninterrupted_one(tmp_path, uninterrupted, mode):
    out = tmp_path / "run"
    first = run(out, BATCHES[mode], max_steps=K)
    assert first.summary["iterations"] == K
    again = train(logreg_model, TRAIN, TEST, **settings(out, BATCHES[mode], max_steps=N), resume=True)
    same_run(again, uninterrupted[mode])
    assert again.summary["stop_reason"] == "step limit reached"
    lines = metrics(out)  # appended, the counters and the clock continue
    assert [m["iterations"] for m in lines] == [K, N]
    assert lines[1]["wall_s"] >= lines[0]["wall_s"] and lines[1]["examples"] > lines[0]["examples"]
    assert newest_state(out)["coordinator"]["iterations"] == N


def test_resume_reshards_every_named_vector_2_to_3_to_2(tmp_path, uninterrupted, capsys):
    out = tmp_path / "run"
    run(out, max_steps=3)
    mid = train(logreg_model, TRAIN, TEST, **settings(out, max_steps=6, shards=3, quiet=False), resume=True)
    assert "resharded to 3" in capsys.readouterr().err
    assert mid.summary["shards"] == 3 and mid.summary["iterations"] == 6
    assert len(newest_state(out)["shards"]) == 3
    again = train(logreg_model, TRAIN, TEST, **settings(out, max_steps=N, shards=2), resume=True)
    same_run(again, uninterrupted["full batch"])
    assert newest_state(out)["shards"] == [[0, 17], [17, 33]]
    assert not (vectors_root(out / "checkpoints") / "shard-002").exists()  # no kept state needs it any more


class InterruptAt:
    """Cross-entropy that raises KeyboardInterrupt in the replica's n-th portion: in process, it reaches the
    driver through the portion's future, in the middle of an iteration — like a Ctrl-C while portions run."""

    def __init__(self, n: int):
        self.n, self.calls, self.lock = n, 0, threading.Lock()

    def __call__(self, out, y):
        if threading.current_thread() is not threading.main_thread():  # not the driver's evaluation
            with self.lock:
                self.calls += 1
                if self.calls == self.n:
                    raise KeyboardInterrupt
        return F.cross_entropy(out, y)


def test_an_interrupt_mid_iteration_rolls_back_to_the_checkpoint_and_the_resumed_run_matches(
        tmp_path, uninterrupted, capsys):
    out = tmp_path / "run"
    stopped = train(logreg_model, TRAIN, TEST, **settings(out, max_steps=N, quiet=False), loss_fn=InterruptAt(43))
    err = capsys.readouterr().err
    k = stopped.summary["iterations"]
    assert stopped.summary["stop_reason"] == "interrupted" and 0 < k < N
    assert "dropping the iteration in progress" in err and f"stands at iteration {k}" in err
    # The final checkpoint: a state file for iteration k whose vectors are the parameters the run reported.
    state = newest_state(out)
    assert state["coordinator"]["iterations"] == k
    torch.testing.assert_close(checkpoint_params(out, state), stopped.flat_params, rtol=0, atol=0)
    again = train(logreg_model, TRAIN, TEST, **settings(out, max_steps=N), resume=True)
    same_run(again, uninterrupted["full batch"])


def two_layer_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, 4), nn.Linear(4, 3))


def test_resuming_with_another_model_or_history_names_the_setting_and_the_file(tmp_path):
    out = tmp_path / "run"
    run(out, max_steps=2)
    with pytest.raises(ConfigError, match=r"^model: .*state-\d+\.json: the run trains a model with 33 parameters, "
                                          r"this model has 59; resume with the same model"):
        run(out, model_fn=two_layer_model, max_steps=4, resume=True)
    with pytest.raises(ConfigError, match=r"^history: .*keeps 4 L-BFGS pairs .*resume with history = 4"):
        run(out, max_steps=4, history=6, resume=True)
    # a refused resume leaves the run's configuration as it was
    assert "history = 4" in (out / "config.toml").read_text()


def test_a_corrupted_latest_vector_checkpoint_falls_back_to_the_previous_pair(tmp_path, uninterrupted, capsys):
    out = tmp_path / "run"
    run(out, max_steps=K)
    newest = sorted((vectors_root(out / "checkpoints") / "shard-001").glob("ckpt-*.safetensors"))[-1]
    raw = bytearray(newest.read_bytes())
    raw[-5] ^= 0x55  # one flipped byte in the tensor data
    newest.write_bytes(bytes(raw))
    again = train(logreg_model, TRAIN, TEST, **settings(out, max_steps=N, quiet=False), resume=True)
    err = capsys.readouterr().err
    assert "skipped a damaged or incomplete iteration checkpoint" in err and newest.name in err
    assert f"resuming from {out}: iteration {K - 1} " in err  # one iteration back, redone
    same_run(again, uninterrupted["full batch"])


def test_a_damaged_state_file_falls_back_and_with_none_left_resume_is_refused(tmp_path, uninterrupted, capsys):
    out = tmp_path / "run"
    run(out, max_steps=K)
    states = sorted(vectors_root(out / "checkpoints").glob("state-*.json"))
    states[-1].write_text(states[-1].read_text()[:100])  # truncated
    again = train(logreg_model, TRAIN, TEST, **settings(out, max_steps=N, quiet=False), resume=True)
    err = capsys.readouterr().err
    assert f"{states[-1].name}: unreadable" in err and f"iteration {K - 1} " in err
    same_run(again, uninterrupted["full batch"])
    for p in vectors_root(out / "checkpoints").glob("state-*.json"):
        p.write_text("{}")
    with pytest.raises(ConfigError, match=r"^resume: no consistent Sandblaster checkpoint .*state-\d+\.json: not a "
                                          r"Sandblaster state file.*start a new run"):
        run(out, max_steps=N + 2, resume=True)


# ---------------------------------------------------------------------------- real processes
CLI = ["train", "--runtime", "inprocess", "--strategy", "sandblaster", "--task", "mnist1d", "--model", "mlp-small",
       "--num-samples", "2000", "--batch-size", "1600", "--portion-size", "200", "--replicas", "2", "--shards", "2",
       "--history", "5", "--max-steps", "1000", "--max-seconds", "0", "--eval-every-seconds", "0.3"]


def wait_for_evals(out, n: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        p = out / "metrics.jsonl"
        if p.is_file() and len(p.read_text().splitlines()) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"{out} did not record {n} evaluations in {timeout_s}s")


@pytest.mark.slow
def test_killed_then_interrupted_then_finished_run_continues_its_iterations(tmp_path):
    """SIGKILL the driver mid-run, resume; SIGTERM the resumed one (final checkpoint, exit 130), resume again
    until the step limit. Iterations and the clock only go forward; the run ends with sensible accuracy."""
    out = tmp_path / "run"
    proc = subprocess.Popen(PY + CLI + ["--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_evals(out, 3)
    finally:
        proc.send_signal(signal.SIGKILL)  # no clean-up of any kind
        proc.wait(30)
    killed_at = metrics(out)[-1]["iterations"]
    assert newest_state(out)["coordinator"]["iterations"] >= killed_at  # checkpointed before it was reported

    seen = len(metrics(out))
    proc = subprocess.Popen(PY + ["train", "--resume", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    wait_for_evals(out, seen + 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "resuming from" in err and "--resume" in err
    summary = json.loads((out / "summary.json").read_text())
    stopped_at = summary["iterations"]
    assert summary["stop_reason"] == "interrupted" and stopped_at > killed_at
    assert newest_state(out)["coordinator"]["iterations"] == stopped_at  # the final checkpoint

    r = subprocess.run(PY + ["train", "--resume", str(out), "--max-steps", str(stopped_at + 10)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == stopped_at + 10 and summary["stop_reason"] == "step limit reached"
    assert summary["final_test_accuracy"] > 0.4  # 10 classes; an uninterrupted run is at ~0.45 by then
    lines = metrics(out)
    walls = [m["wall_s"] for m in lines]
    assert walls == sorted(walls)
    resumed = [m["iterations"] for m in lines[seen:]]
    assert resumed == sorted(resumed) and resumed[0] >= killed_at
