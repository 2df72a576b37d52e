"""The click-model part of `bench throughput`: what it computes from run summaries (no runs here)."""

import pytest

from distbelief.bench.throughput import make_plan, metric_at_same_examples, run_config, table_traffic


def test_ctr_compares_against_torch_with_adagrad_and_its_own_methods(tmp_path):
    plan = make_plan(False, ["ctr"], None, None, None)
    assert plan.methods == ["sgd-1", "sgd-2", "downpour"]
    cfgs = {m: run_config(plan.settings("ctr", m), tmp_path / m) for m in plan.methods}
    assert [(c.strategy, c.optimizer, c.threads) for c in cfgs.values()][:2] == [("sgd", "adagrad", 1),
                                                                                 ("sgd", "adagrad", 2)]
    assert cfgs["downpour"].optimizer == "adagrad" and cfgs["downpour"].batch_size == 128
    assert make_plan(False, None, None, None, None).models == ["paper", "fig4"]  # ctr only when asked


def test_bytes_per_step_against_the_least_a_sparse_step_moves():
    s = dict(rows_pushed=1000, rows_fetched=1000, steps_per_replica=[5, 5], num_parameters=10_000 + 1600,
             table_parameters=1600, table_rows=100, bytes_pushed_per_shard=[500_000, 500_000],
             bytes_fetched_per_shard=[520_000, 500_000], best_test_auc=0.8, planted_auc=0.81)
    t = table_traffic(s)
    least = 1000 * (16 * 4 + 8) + 10 * 10_000 * 4  # rows with ids, plus the dense part every step
    assert t["push_bytes_over_least"] == pytest.approx(1_000_000 / least)
    assert t["fetch_bytes_over_least"] == pytest.approx(1_020_000 / least)
    assert t["unique_rows_per_step"] == 100 and t["best_test_auc"] == 0.8


def test_best_auc_within_the_baselines_examples():
    base = [{"trace": [[0, 0.5], [1000, 0.70], [2000, 0.75]]}]
    ours = [{"trace": [[0, 0.5], [1500, 0.74], [2500, 0.80]], "best_test_auc": 0.80, "planted_auc": 0.81}]
    out = metric_at_same_examples(base, ours)
    assert out["downpour_minus_sgd1_best_metric_same_examples"] == [pytest.approx(-0.01)]  # 0.80 came too late
    assert out["downpour_planted_minus_best_auc"] == [pytest.approx(0.01)]
