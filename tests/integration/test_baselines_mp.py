"""The hogwild and ddp baselines on real worker processes: accuracy and run directories, shared parameters,
DDP's exactness, failures, Ctrl-C, and bad input refused before any process starts."""

import hashlib
import json
import math
import multiprocessing
import os
import signal
import time
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from distbelief import ConfigError, RoleFailedError, RunConfig, train
from distbelief.baselines.progress import SharedProgress
from distbelief.cli import main
from distbelief.testing import Faults
from tests.conftest import make_odd_model, toy_classification
from tests.integration.test_downpour_inprocess import RUN_FIELDS, check_run_dir

FAST = dict(quiet=True, batch_size=16, optimizer="adagrad", lr=0.05, threads=1)


def toy_split(part: str) -> TensorDataset:
    """Train and test examples labelled by the same teacher (conftest's two sets use different teachers)."""
    x, y = toy_classification(1280, seed=0).tensors
    return TensorDataset(x[:1024], y[:1024]) if part == "train" else TensorDataset(x[1024:], y[1024:])


def make_scalar_model() -> nn.Module:
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    return model


def minus_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -out.mean()  # with every input 1, d loss / d w = -1 exactly, whatever the batch


def digest(flat: torch.Tensor) -> str:
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


# ---------------------------------------------------------------------------------------------- no processes
def test_shared_progress_counts_and_summarizes_in_one_process():
    p = SharedProgress(2)
    p.count_step(0, 16, 2.0, 0)
    p.count_step(0, 16, 1.0, 3)
    p.count_step(1, 8, 4.0, 1)
    snap = p.snapshot([0, 1])
    assert snap["steps"] == [2, 1] and snap["examples"] == 40
    assert snap["staleness_mean"] == pytest.approx(4 / 3) and snap["staleness_max"] == 3
    assert snap["train_loss"] == pytest.approx(((0.9 * 2.0 + 0.1 * 1.0) + 4.0) / 2)
    assert p.snapshot([1])["train_loss"] == 4.0 and SharedProgress(1).snapshot([0])["train_loss"] is None
    assert not p.stop_requested()
    p.stop()
    assert p.stop_requested() and p.wait_go(0, timeout_s=1) is False  # a stopped run never says go


def test_shared_progress_pause_generations_in_one_process():
    """A pause is requested until resumed; a worker holding it reports the generation; a stop releases it."""
    p = SharedProgress(2)
    assert not p.pause_requested()
    gen = p.request_pause()
    assert p.pause_requested() and not p.paused(0, gen) and p.pause_generation() == gen
    p.resume()
    assert not p.pause_requested()
    p.hold_pause(0, timeout_s=1)  # already resumed: returns at once, holding nothing
    assert not p.paused(0, gen)
    gen2 = p.request_pause()
    assert gen2 == gen + 1 and p.pause_requested()
    p.stop()
    p.hold_pause(1, timeout_s=1)  # a stopped run releases a paused worker
    assert not p.paused(1, gen2)


@pytest.mark.parametrize("settings,field", [
    (dict(strategy="hogwild", partitions=2, model="mlp"), "partitions"),
    (dict(strategy="ddp", partitions=2, model="lc1d"), "partitions"),
    (dict(strategy="ddp", address="10.0.0.1:6379"), "address"),
])
def test_config_refuses_settings_the_baselines_cannot_honour(settings, field):
    with pytest.raises(ConfigError) as e:
        RunConfig(**settings).validate()
    assert e.value.field == field


def test_bad_input_is_refused_before_any_worker_starts(tmp_path, capsys):
    data = toy_split("train"), toy_split("test")
    for strategy in ("hogwild", "ddp"):
        with pytest.raises(ConfigError, match=f"resume: {strategy} runs keep no checkpoints"):
            train(make_odd_model, *data, strategy=strategy, resume=True, out=str(tmp_path), max_steps=1,
                  **FAST)
        with pytest.raises(ConfigError, match="model: .*picklable"):
            train(lambda: nn.Linear(7, 3), *data, strategy=strategy, max_steps=1, **FAST)
    assert multiprocessing.active_children() == []
    assert main(["train", "--strategy", "hogwild", "--partitions", "2", "--out", str(tmp_path / "cli")]) == 2
    assert "partitions" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- evaluation
class WatchEvaluation:
    """A callback, so it runs where the driver evaluates. It records whether every worker holds this very pause
    (each worker reports the pause generation it is holding: asked directly, not inferred from a quiet interval),
    the step counters around the check, and whether the training clock stands still (the same reading before and
    after a sleep, equal to the evaluation's recorded time). After ``evaluations`` evaluations with training in
    between it ends the run (no time budget)."""

    def __init__(self, evaluations: int = 3):
        self.evaluations, self.seen, self.clock_still = evaluations, [], []

    def __call__(self, run, rec):
        before = run.progress.steps()
        generation = run.progress.pause_generation()
        held = [run.progress.paused(r, generation) for r in sorted(run.worker_pids)]
        t = run.clock.elapsed()
        time.sleep(0.001)  # any time at all: a running clock would move
        self.clock_still.append(run.clock.elapsed() == t and rec["wall_s"] == round(t, 3))
        self.seen.append((rec["updates"], before, run.progress.steps(), held))
        if len(self.seen) >= self.evaluations and rec["updates"] > self.seen[0][0] > 0:
            run.request_stop("evaluations watched")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["hogwild", "ddp"])
def test_workers_are_paused_while_the_driver_evaluates(strategy):
    watch = WatchEvaluation()
    # max_seconds only guards against a run that never gets there: the watch ends it
    res = train(make_odd_model, toy_split("train"), toy_split("test"), strategy=strategy, replicas=2,
                max_seconds=100, eval_every_seconds=0.15, hooks=Faults(on_evaluation=watch), **FAST)
    assert res.summary["stop_reason"] == "evaluations watched" and len(watch.seen) >= 3
    for updates, before, after, held in watch.seen[:-1]:  # the last one is the final evaluation
        assert held == [True, True], watch.seen  # every worker holds this evaluation's pause
        assert before == after, watch.seen  # and no worker took a step meanwhile
        # the record counts the paused workers' steps (hogwild: their sum; ddp: one per synchronous step)
        assert updates == (sum(before) if strategy == "hogwild" else before[0])
        if strategy == "ddp":
            assert before[0] == before[1]  # every rank paused after the same step
    assert watch.seen[-1][0] == res.summary["updates"] > watch.seen[0][0] > 0
    # the training clock excludes evaluation: it stood still through every evaluation
    assert all(watch.clock_still), watch.clock_still


# ---------------------------------------------------------------------------------------------- hogwild
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hogwild_two_workers_reach_target_and_write_a_run_dir(tmp_path):
    # ~80 steps reach 0.85 here; 2000 steps a worker only guard against a run that never gets there
    res = train(make_odd_model, partial(toy_split, "train"), toy_split("test"), strategy="hogwild",
                replicas=2, target_accuracy=0.85, max_steps=2000, max_seconds=0, eval_every_seconds=0.5,
                out=str(tmp_path / "run"), **FAST)
    summary, lines = check_run_dir(tmp_path / "run", "hogwild")
    assert summary["stop_reason"] == "target accuracy reached" and summary["final_test_accuracy"] >= 0.85
    assert summary["time_to_target_s"] is not None and summary["time_to_target_s"] < summary["wall_s"] + 1e-9
    assert summary["replicas"] == 2 and summary["shards"] == 1 and summary["replicas_lost"] == 0
    assert not {"rejected_pushes", "replica_restarts"} & summary.keys()  # no push is refused, none restarted
    steps = summary["steps_per_replica"]
    assert len(steps) == 2 and min(steps) > 0 and summary["updates"] == sum(steps)
    assert summary["examples"] == 16 * sum(steps)
    assert {"replicas_alive", "staleness_mean", "test_loss", "updates_per_shard"} <= lines[-1].keys()
    assert lines[-1]["replicas_alive"] == 2 and lines[-1]["updates"] == summary["updates"]
    assert res.summary == summary


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
def test_hogwild_workers_update_one_shared_parameter(rule):
    """w starts at 0 and every step's gradient is exactly -1: with shared parameters (and, for adagrad, shared
    accumulators) the driver's w reflects every step of both workers, as if one process had taken them all."""
    lr = 2.0 ** -10  # sums of powers of two are exact in float32
    data = TensorDataset(torch.ones(64, 1), torch.zeros(64, dtype=torch.long))
    res = train(make_scalar_model, data, data, loss_fn=minus_mean, strategy="hogwild", replicas=2,
                optimizer=rule, lr=lr, max_steps=300, max_seconds=0, eval_every_seconds=3600,
                quiet=True, batch_size=8, threads=1)
    assert res.summary["steps_per_replica"] == [300, 300]
    assert res.summary["stop_reason"] == "step limit reached"
    w = float(res.flat_params[0])
    if rule == "sgd":  # all 600 steps on one w; one worker alone (or private parameters) gives 300 lr at most
        one_worker, bound = 300 * lr, 600 * lr  # a lost update only lowers w: every step once is the most
    else:  # sum g^2 after the k-th update is k: w = lr * sum_k 1/sqrt(k) = 47.5 lr if every update lands
        # once; one worker alone gives 33.6 lr, private accumulators 2 * 33.6 = 67.2 lr
        one_worker = lr * sum(1 / math.sqrt(k) for k in range(1, 301))
        # Hogwild takes no lock, so an accumulator increment can be lost while the step that used it lands:
        # later steps then divide by a smaller sum, and w can exceed 47.5 lr (47.57 lr was seen). Losing a
        # fraction f of the increments scales w by at most 1 / sqrt(1 - f); 1.1x allows f up to 17% and
        # stays below what private accumulators give (1.41x) unless over a fifth of all steps were lost too.
        bound = 1.1 * lr * sum(1 / math.sqrt(k) for k in range(1, 601))
    # Updates landing at the same instant are lost. In this tight loop (a step is tens of microseconds) two
    # workers on a busy 2-core machine lost up to 16% of them, so the test pins down sharing itself: more
    # than one worker alone could give, never more than every step applied once (Adagrad: the bound above).
    assert one_worker < w <= bound + 1e-6, (w / lr, one_worker / lr, bound / lr)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_killed_hogwild_worker_does_not_stop_the_run(tmp_path):
    # worker 1 is killed (SIGKILL) once the workers took 40 steps together; worker 0 goes on to its 400
    res = train(make_odd_model, toy_split("train"), toy_split("test"), strategy="hogwild", replicas=2,
                max_steps=400, max_seconds=0, eval_every_seconds=0.4,
                hooks=Faults(kill_replica_at_step=40, kill_replica_id=1), out=str(tmp_path / "run"), **FAST)
    summary, lines = check_run_dir(tmp_path / "run", "hogwild", RUN_FIELDS)
    assert summary["replicas_lost"] == 1 and summary["stop_reason"] == "step limit reached"
    killed = [e for e in summary["events"] if e["event"] == "replica killed"]
    assert [e["id"] for e in killed] == [1] and killed[0]["step"] >= 40
    lost = [e for e in summary["events"] if e["event"] == "replica lost"]
    assert [e["id"] for e in lost] == [1] and "SIGKILL" in lost[0]["error"]
    assert lines[-1]["replicas_alive"] == 1
    steps = summary["steps_per_replica"]
    assert steps[0] == 400 and steps[1] < 400  # worker 0 went on alone to its step limit
    assert summary["updates"] == sum(steps) > killed[0]["step"]
    assert res.summary["final_test_accuracy"] > 0.6


class HangInWorker:
    """Cross-entropy, except that worker ``rank`` hangs forever at its ``after``-th call (stuck data)."""

    def __init__(self, rank: int, after: int):
        self.rank, self.after, self.calls = rank, after, 0

    def __call__(self, out, y):
        if multiprocessing.current_process().name.endswith(f"-{self.rank}"):  # counted in that worker only
            self.calls += 1
            if self.calls >= self.after:
                time.sleep(3600)
        return F.cross_entropy(out, y)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hung_hogwild_worker_is_terminated_and_the_others_go_on():
    # worker 1 hangs in its 20th step; worker 0 runs its 300 steps, and the run ends once worker 1 was found
    # making no progress (remote_timeout_s) and terminated
    res = train(make_odd_model, toy_split("train"), toy_split("test"), loss_fn=HangInWorker(1, after=20),
                strategy="hogwild", replicas=2, max_steps=300, max_seconds=0, eval_every_seconds=0.5,
                remote_timeout_s=1.5, **FAST)
    s = res.summary
    assert s["replicas_lost"] == 1 and s["stop_reason"] == "step limit reached"
    assert [(e["id"], "made no progress" in e["error"]) for e in s["events"]] == [(1, True)]
    assert s["steps_per_replica"] == [300, 19]  # 19 steps done, the 20th hung
    assert multiprocessing.active_children() == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_stops_workers_and_writes_the_summary(tmp_path):
    pressed = []

    def ctrl_c(run, rec):
        if not pressed and rec["updates"] > 0:
            pressed.append(rec["updates"])
            # a terminal's Ctrl-C reaches the whole process group: workers ignore it, the driver stops them
            for pid in run.worker_pids.values():
                os.kill(pid, signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    # a step budget far beyond what the run reaches before Ctrl-C: only the interrupt ends it
    res = train(make_odd_model, toy_split("train"), toy_split("test"), strategy="hogwild", replicas=2,
                max_steps=10**6, max_seconds=0, eval_every_seconds=0.5, hooks=Faults(on_evaluation=ctrl_c),
                out=str(tmp_path / "run"), **FAST)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert pressed and summary["stop_reason"] == "interrupted"
    # pressed while the workers held the evaluation's pause: the driver resumes them and stops them at once, so
    # they take a few steps more at most, nowhere near their budget
    assert pressed[0] <= summary["updates"] < pressed[0] + 1000
    assert summary["replicas_lost"] == 0 and min(summary["steps_per_replica"]) > 0
    assert res.summary["final_test_accuracy"] == summary["final_test_accuracy"]


# ---------------------------------------------------------------------------------------------- ddp
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ddp_two_ranks_train_stay_bit_identical_and_write_a_run_dir(tmp_path):
    # ~20 synchronous steps reach 0.85 here; 2000 only guard against a run that never gets there
    res = train(make_odd_model, toy_split("train"), toy_split("test"), strategy="ddp", replicas=2,
                target_accuracy=0.85, max_steps=2000, max_seconds=0, eval_every_seconds=0.5,
                out=str(tmp_path / "run"), **FAST)
    summary, _ = check_run_dir(tmp_path / "run", "ddp", RUN_FIELDS)
    assert summary["stop_reason"] == "target accuracy reached" and summary["final_test_accuracy"] >= 0.85
    steps = summary["steps_per_replica"]
    assert steps[0] == steps[1] > 0 and summary["updates"] == steps[0]  # one synchronous update per step
    assert summary["examples"] == 2 * 16 * steps[0] and summary["global_batch_size"] == 32
    # synchronous, and no owner of the parameters: no staleness and no shards (absent, not zeros)
    assert not {"staleness_mean", "staleness_max", "shards", "updates_per_shard"} & summary.keys()
    # every rank's final parameters are the same bits, and the driver read rank 0's through shared memory
    assert summary["rank_param_digests"] == [digest(res.flat_params)] * 2 and summary["ranks_in_sync"] is True


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
def test_ddp_with_one_rank_equals_single_process_sgd_exactly(rule):
    """Same seed, same initial parameters, same batches (a sole worker's subset is the whole dataset, in
    order): DDP's all-reduce over one rank divides by 1, so every bit matches --strategy sgd."""
    kw = dict(quiet=True, replicas=1, optimizer=rule, lr=0.05, batch_size=8, max_steps=40,
              max_seconds=0, eval_every_seconds=3600, threads=1, seed=3)
    ddp = train(make_odd_model, toy_split("train"), toy_split("test"), strategy="ddp", **kw)
    sgd = train(make_odd_model, toy_split("train"), toy_split("test"), strategy="sgd", **kw)
    assert ddp.summary["steps_per_replica"] == [40] and sgd.summary["updates"] == 40
    assert not torch.equal(ddp.flat_params, make_odd_model_flat(seed=3))  # it did train
    assert torch.equal(ddp.flat_params, sgd.flat_params)


def make_odd_model_flat(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.cat([p.detach().reshape(-1) for p in make_odd_model().parameters()])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dead_ddp_rank_fails_the_run_naming_it_and_keeps_partial_results(tmp_path):
    # Only the kill can end this run: no target, and a step budget far beyond 40 steps.
    with pytest.raises(RoleFailedError, match="ddp rank 1 failed"):
        train(make_odd_model, toy_split("train"), toy_split("test"), strategy="ddp", replicas=2,
              max_steps=10**6, max_seconds=0, eval_every_seconds=0.3,
              hooks=Faults(kill_replica_at_step=40, kill_replica_id=1),
              out=str(tmp_path / "run"), **FAST)
    summary, _ = check_run_dir(tmp_path / "run", "ddp", RUN_FIELDS)
    assert summary["stop_reason"] == "failed" and "ddp rank 1" in summary["error"]
    killed = [e for e in summary["events"] if e["event"] == "replica killed"]
    assert [e["id"] for e in killed] == [1] and killed[0]["step"] >= 40  # steps of both ranks together
    assert [e["id"] for e in summary["events"] if e["event"] == "replica lost"] == [1]
    assert summary["updates"] >= 20
    assert multiprocessing.active_children() == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ddp_rank_killed_while_paused_fails_the_run_instead_of_hanging_it():
    killed = []

    def kill_rank_1(run, rec):  # runs while every rank is paused for this evaluation
        if not killed and rec["updates"] > 0:
            killed.append(run.worker_pids[1])
            os.kill(killed[0], signal.SIGKILL)

    with pytest.raises(RoleFailedError, match="ddp rank 1 failed"):  # only the kill can end this run
        train(make_odd_model, toy_split("train"), toy_split("test"), strategy="ddp", replicas=2,
              max_steps=10**6, max_seconds=0, eval_every_seconds=0.2, hooks=Faults(on_evaluation=kill_rank_1),
              **FAST)
    assert killed and multiprocessing.active_children() == []
