"""Fig. 4's time to target: the smoothed crossing on synthetic curves, and the medians over --repeats runs that
the targets compare (distbelief/bench/targets.py)."""

import json
import math
import random

import pytest

from distbelief.bench.targets import (
    SMOOTH_WINDOW,
    evaluate_targets,
    method_summaries,
    smoothed_crossing,
    spread,
    spread_text,
    time_to_target,
)

TARGET = 0.13


def curve(accs, dt=5.0):
    return {"wall_s": [dt * (i + 1) for i in range(len(accs))], "test_accuracy": list(accs)}


def test_a_plateau_that_touches_the_target_once_is_not_a_crossing():
    accs = [0.10, 0.11, 0.12, 0.124, 0.122, 0.131, 0.121, 0.125, 0.123, 0.126, 0.122, 0.124, 0.125]
    s = curve(accs)
    assert time_to_target(s, TARGET) == 30.0  # the first crossing takes the lucky evaluation
    assert smoothed_crossing(s, TARGET) is None


def test_two_touches_in_five_evaluations_are_not_a_crossing_either():
    s = curve([0.12, 0.121, 0.132, 0.12, 0.131, 0.122, 0.121, 0.12, 0.123, 0.12])
    assert time_to_target(s, TARGET) == 15.0 and smoothed_crossing(s, TARGET) is None


def test_a_genuine_rise_crosses_where_it_reaches_the_target_with_no_lag():
    accs = [0.09, 0.10, 0.11, 0.12, 0.13, 0.14, 0.145, 0.15, 0.15, 0.15]
    s = curve(accs)
    # a noise-free rise: the centred median crosses at the same evaluation as the first crossing (25 s)
    assert smoothed_crossing(s, TARGET) == time_to_target(s, TARGET) == 25.0


def test_a_lone_dip_moves_a_rise_by_at_most_one_evaluation():
    rise = [0.10, 0.11, 0.12, 0.13, 0.135, 0.14, 0.14, 0.15, 0.15]
    assert smoothed_crossing(curve(rise), TARGET) == 20.0
    for i in range(4, 7):  # one evaluation after the rise drops far below the target
        dipped = rise[:i] + [0.09] + rise[i + 1:]
        assert smoothed_crossing(curve(dipped), TARGET) in (20.0, 25.0), i


def test_a_noisy_rise_crosses_near_its_trend_and_a_noisy_plateau_at_the_target_scatters_less():
    rng = random.Random(0)
    for _ in range(50):  # a rise through 0.13 at 100 s, evaluations ±0.01 around it
        s = curve([0.08 + 0.0005 * t + rng.uniform(-0.01, 0.01) for t in range(5, 305, 5)])
        assert 80.0 <= smoothed_crossing(s, TARGET) <= 125.0
    # a plateau 0.005 under the target with ±0.01 noise: the first crossing is one lucky evaluation early on; the
    # smoothed crossing is much rarer (three of five evaluations must be lucky)
    first = smoothed = 0
    for _ in range(200):
        s = curve([0.125 + rng.uniform(-0.01, 0.01) for _ in range(10)])
        first += time_to_target(s, TARGET) is not None
        smoothed += smoothed_crossing(s, TARGET) is not None
    assert first > 150 and smoothed < 0.5 * first


def test_window_edges_skipped_evaluations_and_bad_windows():
    # a rise in the last two evaluations has no full window: a miss (Fig. 4's runs go on past the target)
    assert smoothed_crossing(curve([0.1] * 8 + [0.14, 0.15]), TARGET) is None
    assert smoothed_crossing(curve([0.1] * 7 + [0.14, 0.15, 0.15]), TARGET) == 40.0
    s = curve([0.10, None, 0.12, 0.14, None, 0.14, 0.15, 0.15, 0.15])  # an evaluation that did not happen is skipped
    assert smoothed_crossing(s, TARGET) == 20.0
    assert smoothed_crossing(curve([0.1, 0.14, 0.1]), TARGET, window=1) == 10.0  # window 1 = the first crossing
    assert SMOOTH_WINDOW % 2 == 1
    with pytest.raises(ValueError):
        smoothed_crossing(curve([0.1] * 5), TARGET, window=4)


def test_spread_counts_a_miss_as_later_than_any_time():
    assert spread([60.0, 50.0, 70.0]) == {"median": 60.0, "min": 50.0, "max": 70.0, "n": 3, "missed": 0}
    assert spread([60.0, None, 50.0]) == {"median": 60.0, "min": 50.0, "max": None, "n": 3, "missed": 1}
    assert spread([60.0, None, None])["median"] is None  # the median run missed
    assert spread([])["n"] == 0 and spread([])["median"] is None
    assert spread_text(spread([60.0, 50.0, 70.0])) == "60.0 (50.0–70.0)"
    assert spread_text(spread([55.24])) == "55.2" and spread_text(spread([None])) == "missed"
    assert spread_text(spread([60.0, None, None]), unit=" s") == "missed (60.0–missed)"


def runs_of(method, cores, times):
    return [{"method": method, "cores": cores, "label": method, "repeat": k + 1, "time_to_target_s": t,
             "time_to_target_smoothed_s": t, "examples_per_s": 1000.0, "best_test_accuracy": 0.14,
             "series": curve([])} for k, t in enumerate(times)]


def test_the_targets_compare_medians_over_the_repeats():
    runs = (runs_of("sgd-1", 1, [100.0, 80.0, 120.0]) + runs_of("sgd-all", 2, [60.0, 70.0, 65.0])
            + runs_of("downpour-adagrad", 2, [50.0, 90.0, 66.0]) + runs_of("downpour-sgd", 2, [None, None, 70.0]))
    t = {x["name"]: x for x in evaluate_targets("fig4", runs, 2)}
    assert t["downpour-adagrad@2 vs sgd-1@1"]["ratio"] == pytest.approx(66.0 / 100.0)
    assert t["downpour-adagrad@2 vs sgd-all@2"]["ratio"] == pytest.approx(66.0 / 65.0)
    assert t["downpour-adagrad@2 vs sgd-all@2"]["met"] is False
    # the fixed rate's median run missed: Adagrad, whose median reached the target, is faster
    assert t["downpour-adagrad@2 vs downpour-sgd@2"]["met"] is True
    # the smoothed crossing, not the first, where the runs record it
    runs[6]["time_to_target_s"] = runs[7]["time_to_target_s"] = runs[8]["time_to_target_s"] = 1.0
    assert evaluate_targets("fig4", runs, 2)[0]["ratio"] == pytest.approx(0.66)


def test_failed_runs_are_neither_times_nor_misses():
    runs = runs_of("sgd-1", 1, [100.0]) + runs_of("downpour-adagrad", 2, [70.0])
    runs += [dict(runs_of("sgd-all", 2, [None])[0], error="boom")]
    t = evaluate_targets("fig4", runs, 2)
    assert t[1]["ratio"] is None and t[1]["met"] is None  # not measured, not "sgd-all missed"


def test_summaries_of_an_old_record_get_the_smoothed_crossing_from_their_series():
    rise = curve([0.09, 0.10, 0.11, 0.12, 0.13, 0.14, 0.145, 0.15, 0.15, 0.15])
    old = [{"method": "sgd-1", "cores": 1, "label": "SGD", "time_to_target_s": 25.0, "examples_per_s": 10.0,
            "best_test_accuracy": 0.15, "series": rise}]
    (m,) = method_summaries(old, TARGET)
    assert m["smoothed"]["median"] == 25.0 and m["first"]["median"] == 25.0 and m["runs"] == 1
    new = runs_of("sgd-1", 1, [10.0, 30.0, 20.0])
    (m,) = method_summaries(new, TARGET)
    assert (m["smoothed"]["median"], m["smoothed"]["min"], m["smoothed"]["max"]) == (20.0, 10.0, 30.0)
    assert not math.isnan(m["examples_per_s"])


def test_bench_fig4_repeats_runs_interleaved_rounds_and_reports_medians(tmp_path, monkeypatch):
    """run_fig4's bookkeeping with the training replaced by fixed curves (no run, no Ray): every method once per
    round, a run directory per repeat, a per-method summary, targets on the medians, the figure drawn."""
    from distbelief.bench import accuracy, sweep

    crossing = {"sgd-1": [100.0, 80.0, 90.0], "sgd-all": [60.0, 70.0, 65.0], "downpour-adagrad": [50.0, 75.0, 55.0]}
    calls = []

    def fake_run_one(self, name, settings):
        calls.append(name)
        if name == "warmstart":
            return {"config": {}, "summary": {"final_test_accuracy": 0.08}, "metrics": [], "elapsed_s": 1.0,
                    "run_dir": str(tmp_path / "warm")}
        method, repeat = name.rsplit("-c", 1)[0], int(name.rsplit("-r", 1)[1])
        t_cross = crossing[method][repeat - 1]
        metrics = [{"wall_s": t, "test_accuracy": 0.14 if t >= t_cross else 0.12, "examples": int(100 * t)}
                   for t in range(5, 200, 5)]
        summary = {"final_test_accuracy": 0.14, "best_test_accuracy": 0.14, "examples_per_s": 100.0,
                   "wall_s": 195.0, "stop_reason": "time budget spent", "staleness_mean": 0.0}
        return {"config": dict(settings), "summary": summary, "metrics": metrics, "elapsed_s": 1.0,
                "run_dir": str(tmp_path / "runs" / name)}

    monkeypatch.setattr(sweep.Sweep, "run_one", fake_run_one)
    monkeypatch.setattr(accuracy, "connect_ray", lambda *a, **k: None)
    logged = []
    res = accuracy.run_fig4(tmp_path / "out", 2, quick=False, methods=list(crossing), log=logged.append, repeats=3)
    assert calls == ["warmstart"] + [f"{m}-c{1 if m == 'sgd-1' else 2}-r{k}" for k in (1, 2, 3) for m in crossing]
    assert res["repeats"] == 3 and [r["repeat"] for r in res["runs"]] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    summary = {m["method"]: m for m in res["summary"]}
    assert summary["downpour-adagrad"]["smoothed"] == {"median": 55.0, "min": 50.0, "max": 75.0, "n": 3,
                                                       "missed": 0}
    t = {x["name"]: x for x in res["targets"]}
    assert t["downpour-adagrad@2 vs sgd-1@1"]["ratio"] == pytest.approx(55.0 / 90.0)
    assert t["downpour-adagrad@2 vs sgd-all@2"]["ratio"] == pytest.approx(55.0 / 65.0)
    assert (tmp_path / "out" / "fig4.png").stat().st_size > 0
    assert any("smoothed crossing 55.0 s (50.0–75.0) over 3 run(s)" in x for x in logged)
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["summary"] == res["summary"] and saved["time_to_target_rule"].startswith("smoothed crossing")


def test_bench_fig4_refuses_zero_repeats(tmp_path):
    from distbelief.bench import accuracy
    from distbelief.exceptions import ConfigError

    with pytest.raises(ConfigError, match="repeats"):
        accuracy.run_fig4(tmp_path, 2, quick=True, repeats=0)
