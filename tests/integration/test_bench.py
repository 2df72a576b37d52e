"""``distbelief bench``: the figure sweeps run end to end on tiny sizes and write well-formed results and PNGs.

These check structure and bookkeeping, never speed: all methods present, a monotone time axis, every number
reported equal to what the runs themselves recorded (or, for Fig. 3's bytes, to what an in-process step of the same
model sends), every method started from the shared warmstart, the targets evaluated from the measured times.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import pytest
import torch
import torch.nn.functional as F

from distbelief.bench.accuracy import fig5_core_counts
from distbelief.bench.fig3 import models as fig3_models
from distbelief.bench.recipes import QUICK
from distbelief.bench.targets import evaluate_targets, smoothed_crossing, time_to_target
from distbelief.partition import PartitionedExecutor

PY = [sys.executable, "-m", "distbelief.cli"]
FIG4_METHODS = {"sgd-1", "sgd-all", "downpour-sgd", "downpour-adagrad"}
assert FIG4_METHODS <= set(QUICK.methods)


def check_png(path, min_px=200):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.shape[0] >= min_px and img.shape[1] >= min_px
    assert img.std() > 0.01  # something was drawn


def check_machine(m):
    assert m["cores"] >= 1 and m["torch"] and m["ray"] and m["python"] and m["date"] and m["cpu_model"]


def run_summary(run_dir) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def run_metrics(run_dir) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def is_count_of(fraction: float, n: int) -> bool:
    """Whether ``fraction`` is k/n for a whole k in [0, n] (an accuracy measured on n examples)."""
    k = round(fraction * n)
    return 0 <= k <= n and k / n == fraction


@pytest.mark.slow
@pytest.mark.ray
def test_fig3_quick(tmp_path):
    out = tmp_path / "fig3"
    r = subprocess.run(PY + ["bench", "fig3", "--quick", "--out", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    check_machine(res["machine"])
    assert res["figure"] == "fig3" and res["partitions"] == [1, 2]
    assert {m["kind"] for m in res["models"]} == {"fully connected", "locally connected"}
    for fm, m in zip(fig3_models(quick=True), res["models"]):
        rows = m["rows"]
        assert m["name"] == fm.name and [row["P"] for row in rows] == [1, 2]
        assert all(row["num_parameters"] == sum(p.numel() for p in fm.make(1).parameters()) for row in rows)
        # speedup is time(P=1) / time(P) of the step times reported beside it
        assert rows[0]["speedup"] == 1.0 and rows[1]["speedup"] == rows[0]["step_s"] / rows[1]["step_s"] > 0
        # what each Ray partition sent per step is what the same model's partitions send in one in-process step
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(fm.batch, *fm.input_shape, generator=g), torch.randint(0, fm.classes, (fm.batch,),
                                                                                     generator=g)
        for row in rows:
            with PartitionedExecutor(fm.make(row["P"])) as ex:
                step = ex.step(x, y, F.cross_entropy)
            assert row["bytes_per_step"] == step.bytes_sent and row["messages_per_step"] == step.messages_sent
        assert sum(rows[0]["bytes_per_step"]) == 0 < sum(rows[1]["bytes_per_step"])  # boundary traffic at P=2
    check_png(out / "fig3.png")


@pytest.mark.slow
@pytest.mark.ray
def test_fig4_quick_every_method_from_the_shared_warmstart(tmp_path):
    out = tmp_path / "fig4"
    # The methods the targets are made of (every other method trains in tests of its own; fewer runs keep the
    # suite under its 10 minutes).
    r = subprocess.run(PY + ["bench", "fig4", "--quick", "--cores", "2", "--out", str(out), "--methods",
                             *sorted(FIG4_METHODS)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[fig4] target" in r.stderr  # the targets are reported as measured
    res = json.loads((out / "results.json").read_text())
    check_machine(res["machine"])
    assert res["figure"] == "fig4" and res["quick"] and res["cores"] == 2
    warm = res["warmstart"]
    assert (out / "runs" / "warmstart" / "params.safetensors").is_file()
    assert warm["test_accuracy"] == run_summary(out / "runs" / "warmstart")["final_test_accuracy"]
    assert {run["method"] for run in res["runs"]} == FIG4_METHODS
    n_test, n_train = QUICK.common["eval_samples"], QUICK.common["train_eval_samples"]
    for run in res["runs"]:
        assert run["config"]["init_params"] == warm["run_dir"], run["method"]
        assert run["cores"] == (1 if run["method"] == "sgd-1" else 2)
        s = run["series"]
        assert len(s["wall_s"]) >= 2, run["method"]
        assert all(b >= a for a, b in zip(s["wall_s"], s["wall_s"][1:])), run["method"]
        # the series, final accuracy, rate and stop are the run's own records, as its run directory holds them
        summary, lines = run_summary(run["run_dir"]), run_metrics(run["run_dir"])
        assert s["wall_s"] == [x.get("wall_s") for x in lines], run["method"]
        assert s["test_accuracy"] == [x.get("test_accuracy") for x in lines], run["method"]
        assert s["train_accuracy"] == [x.get("train_accuracy") for x in lines], run["method"]
        assert run["final_test_accuracy"] == summary["final_test_accuracy"] == s["test_accuracy"][-1]
        assert run["examples_per_s"] == summary["examples_per_s"] > 0
        assert run["wall_s"] == summary["wall_s"] and run["stop_reason"] == "time budget spent"  # fig4: full curves
        # accuracies of eval_samples test examples and train_eval_samples training examples
        assert all(is_count_of(a, n_test) for a in s["test_accuracy"]), run["method"]
        assert any(a is not None for a in s["train_accuracy"]), run["method"]
        assert all(a is None or is_count_of(a, n_train) for a in s["train_accuracy"]), run["method"]
        # the reported time to target is the first evaluation at or above it
        assert run["time_to_target_s"] == time_to_target(s, res["target_accuracy"])
        assert run["time_to_target_mean3_s"] == time_to_target(s, res["target_accuracy"], window=3)
        # fig4's targets compare the smoothed crossing (distbelief/bench/targets.py)
        assert run["time_to_target_smoothed_s"] == smoothed_crossing(s, res["target_accuracy"])
    assert len(res["targets"]) == 3
    tta = {(r["method"], r["cores"]): r["time_to_target_smoothed_s"] for r in res["runs"]}
    for t in res["targets"]:  # each target is the ratio of the two runs' measured times, judged against its bound
        a, b = (side.split("@") for side in t["name"].split(" vs "))
        ta, tb = tta[a[0], int(a[1])], tta[b[0], int(b[1])]
        if ta is None:
            assert t["ratio"] is None and t["met"] is None, t
        elif tb is None:  # b missed within the budget, a reached the target: a is faster whatever b's time
            assert t["ratio"] is None and t["met"] is True, t
        else:
            assert t["ratio"] == pytest.approx(ta / tb) and t["met"] == (ta / tb <= t["threshold"]), t
    check_png(out / "fig4.png")


@pytest.mark.slow
def test_plot_overlays_runs_into_a_png(tmp_path):
    from distbelief import RunConfig
    from distbelief.api import train_task

    runs = []
    for strategy in ("sgd", "downpour"):  # run directories as `distbelief train` writes them
        out = tmp_path / strategy
        train_task(RunConfig(strategy=strategy, runtime="inprocess", replicas=2, max_steps=30, max_seconds=0,
                             num_samples=1000, eval_every_seconds=0.2, out=str(out)), quiet=True)
        runs.append(str(out))
    png = tmp_path / "cmp.png"
    r = subprocess.run(PY + ["plot", *runs, "--out", str(png)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    check_png(png)


@pytest.mark.parametrize("args,field", [(["fig4", "--cores", "999"], "cores"), (["fig5", "--cores", "0"], "cores"),
                                        (["fig4", "--methods", "nope"], "methods"),
                                        (["fig4", "--max-seconds", "-1"], "max_seconds"),
                                        (["fig3", "--steps", "0"], "steps")])
def test_bad_bench_arguments_exit_2_naming_them(tmp_path, capsys, args, field):
    code, err = cli_exit(capsys, ["bench", *args, "--quick", "--out", str(tmp_path / "x")])
    assert code == 2 and f"error: --{field.replace('_', '-')}:" in err, err
    assert not (tmp_path / "x" / "results.json").exists()


def cli_exit(capsys, argv: list[str]) -> tuple[int, str]:
    """``distbelief ARGV`` run in this process (what the console script calls): its exit status and stderr."""
    from distbelief.cli import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    return code, capsys.readouterr().err


def test_targets_are_ratios_of_measured_times():
    def run(method, cores, tta):
        return {"method": method, "cores": cores, "time_to_target_s": tta}

    runs = [run("sgd-1", 1, 100.0), run("sgd-all", 2, 60.0), run("downpour-adagrad", 2, 50.0),
            run("downpour-sgd", 2, None)]
    t = {x["name"]: x for x in evaluate_targets("fig4", runs, 2)}
    assert t["downpour-adagrad@2 vs sgd-1@1"]["ratio"] == pytest.approx(0.5)
    assert t["downpour-adagrad@2 vs sgd-1@1"]["met"] is True
    assert t["downpour-adagrad@2 vs sgd-all@2"]["ratio"] == pytest.approx(50 / 60)
    assert t["downpour-adagrad@2 vs sgd-all@2"]["met"] is True
    # fixed-rate Downpour missed the target: Adagrad, which reached it, is faster whatever the missing time
    assert t["downpour-adagrad@2 vs downpour-sgd@2"]["met"] is True
    assert t["downpour-adagrad@2 vs downpour-sgd@2"]["ratio"] is None
    slow = evaluate_targets("fig4", [run("sgd-1", 1, 100.0), run("downpour-adagrad", 2, 70.0)], 2)
    assert slow[0]["met"] is False and math.isclose(slow[0]["ratio"], 0.7)
    assert slow[1]["met"] is None  # sgd-all was not run: not measured, not met


def test_time_to_target_is_the_first_evaluation_at_or_above_it():
    s = {"wall_s": [1.0, 2.0, 3.0, 4.0], "test_accuracy": [0.1, 0.3, 0.2, 0.5]}
    assert time_to_target(s, 0.3) == 2.0 and time_to_target(s, 0.5) == 4.0 and time_to_target(s, 0.6) is None
    # the mean of the last 3 evaluations: (0.3 + 0.2 + 0.5) / 3 reaches 1/3 only at t = 4; one lucky 0.3 does not
    assert time_to_target(s, 0.3, window=3) == 4.0 and time_to_target(s, 0.34, window=3) is None
    s["test_accuracy"][1] = None  # an evaluation that did not happen is skipped, not averaged as 0
    assert time_to_target(s, 0.25, window=2) == 4.0 and time_to_target(s, 0.3, window=2) == 4.0
    assert fig5_core_counts(2) == [1, 2] and fig5_core_counts(16) == [1, 2, 4, 8, 16]
    assert fig5_core_counts(6) == [1, 2, 4, 6] and fig5_core_counts(1) == [1]


@pytest.mark.slow
@pytest.mark.ray
def test_throughput_quick_writes_medians_ratios_and_targets(tmp_path):
    from distbelief.bench.throughput import QUICK_METHODS

    out = tmp_path / "throughput"
    r = subprocess.run(PY + ["bench", "throughput", "--quick", "--max-seconds", "1", "--out", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[throughput] quick downpour repeat 1/1:" in r.stderr  # one progress line per run
    assert "| model | method | median examples/s |" in r.stdout  # the Markdown table for RESULTS.md
    res = json.loads((out / "results.json").read_text())
    check_machine(res["machine"])
    assert res["benchmark"] == "throughput" and res["quick"] is True and res["repeats"] == 1
    assert res["methods"] == list(QUICK_METHODS) and list(res["models"]) == ["quick"]
    model = res["models"]["quick"]
    for name, m in model["methods"].items():
        assert [run["error"] for run in m["runs"]] == [None], name
        # one repeat: the median is that run's examples/s, its summary's: examples over its training time
        summary = run_summary(m["runs"][0]["run_dir"])
        assert m["median_examples_per_s"] == m["runs"][0]["examples_per_s"] == summary["examples_per_s"], name
        assert summary["examples"] > 0 and summary["examples_per_s"] == pytest.approx(
            summary["examples"] / summary["wall_s"]), name
        assert m["runs"][0]["stop_reason"] == summary["stop_reason"] == "time budget spent", name
        # the exact config ran, with the method's strategy and the defaults for what the benchmark does not name
        assert m["config"]["strategy"] == ("sgd" if name.startswith("sgd") else name)
        assert m["config"]["max_seconds"] == res["max_seconds"]
    assert set(res["pinned_settings"]) >= {"task", "model", "strategy", "max_seconds", "out"}
    assert "lr" not in res["pinned_settings"] and "durability" not in res["pinned_settings"]
    ratio = model["ratios"]["downpour/sgd-1"]
    assert ratio == pytest.approx(model["methods"]["downpour"]["median_examples_per_s"]
                                  / model["methods"]["sgd-1"]["median_examples_per_s"])
    targets = {t["name"]: t for t in model["targets"]}
    assert targets["downpour vs sgd-1"]["ratio"] == pytest.approx(ratio)
    assert targets["downpour vs sgd-1"]["met"] == (ratio >= targets["downpour vs sgd-1"]["threshold"])
    assert targets["downpour vs hogwild"]["met"] is None  # hogwild was not run: not measured, not met
    assert res["table_markdown"] in r.stdout


def test_throughput_targets_are_ratios_of_medians():
    from distbelief.bench.throughput import evaluate_targets, median_or_none, ratios_to_baselines

    medians = {"sgd-1": 100.0, "sgd-2": 150.0, "hogwild": None, "downpour": 190.0}
    ratios = ratios_to_baselines(medians)
    assert ratios == {"downpour/sgd-1": pytest.approx(1.9), "downpour/sgd-2": pytest.approx(190 / 150),
                      "downpour/hogwild": None}
    t = {x["name"]: x for x in evaluate_targets("paper", ratios)}
    assert t["downpour vs sgd-1"]["met"] is True and t["downpour vs sgd-2"]["met"] is True
    assert t["downpour vs hogwild"]["met"] is None  # failed or not run: not measured
    assert [x["met"] for x in evaluate_targets("fig4", {"downpour/sgd-1": 1.6, "downpour/hogwild": 0.95})] == \
        [False, True]
    assert median_or_none([3.0, None, 1.0, 2.0]) == 2.0 and median_or_none([None]) is None


@pytest.mark.parametrize("args,field", [(["--methods", "nope"], "methods"), (["--models", "fig9"], "models"),
                                        (["--repeats", "0"], "repeats"), (["--max-seconds", "0"], "max_seconds"),
                                        (["--cores", "1"], "cores")])
def test_bad_throughput_arguments_exit_2_naming_them(tmp_path, capsys, args, field):
    code, err = cli_exit(capsys, ["bench", "throughput", *args, "--out", str(tmp_path / "x")])
    assert code == 2 and f"error: --{field.replace('_', '-')}:" in err, err
    assert not (tmp_path / "x" / "results.json").exists()
