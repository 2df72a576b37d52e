"""The ctr task: the synthetic click logs and their planted teacher, the exact AUC, dlrm-small, and a short
single-process run whose summary reports the AUC next to the best reachable."""

import json

import numpy as np
import pytest
import torch

from distbelief import RunConfig
from distbelief.data.ctr import CRITEO_CARDINALITIES, NUM_DENSE, capped_cardinalities, make_ctr
from distbelief.data.tasks import TaskSpec, load_task
from distbelief.exceptions import ConfigError
from distbelief.metrics.ctr import AUCMetric, auc, bce_loss
from distbelief.models import build_model

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTBELIEF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def brute_force_auc(scores, labels) -> float:
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (len(pos) * len(neg))


def test_auc_matches_a_brute_force_pair_count_with_ties():
    rng = np.random.default_rng(0)
    for n, levels in ((50, 5), (300, 1000), (301, 2)):  # many ties, almost none, two score values
        y = rng.integers(0, 2, n)
        s = rng.integers(0, levels, n).astype(np.float32) + 0.3 * y  # informative but tied
        assert auc(s, y) == pytest.approx(brute_force_auc(s, y), abs=1e-12)
        assert auc(torch.from_numpy(s), torch.from_numpy(y).float()) == pytest.approx(brute_force_auc(s, y))
    y = np.array([0, 1, 0, 1])
    assert auc(np.array([0.1, 0.9, 0.2, 0.8]), y) == 1.0
    assert auc(np.array([0.9, 0.1, 0.8, 0.2]), y) == 0.0
    assert auc(np.ones(4), y) == 0.5  # all tied: a coin toss
    with pytest.raises(ValueError, match="undefined"):
        auc(np.arange(3.0), np.ones(3))


def test_generator_is_deterministic_shaped_and_within_the_cap():
    a = make_ctr(20_000, 1000, seed=3, test_fraction=0.2)
    b = make_ctr(20_000, 1000, seed=3, test_fraction=0.2)
    c = make_ctr(20_000, 1000, seed=4, test_fraction=0.2)
    assert all(np.array_equal(a[k], b[k]) for k in ("x", "y", "x_test", "y_test"))
    assert a["meta"] == b["meta"] and not np.array_equal(a["x"], c["x"])
    assert a["x"].shape == (16_000, 13 + 26) and a["x_test"].shape == (4000, 39)
    assert a["x"].dtype == a["y"].dtype == np.float32 and a["y"].shape == (16_000,)
    assert set(np.unique(a["y"])) == {0.0, 1.0}
    rows = capped_cardinalities(1000)
    assert a["meta"]["cardinalities"] == list(rows) and max(rows) == 1000 and rows[8] == 3  # C9 has 3 values
    ids = np.concatenate([a["x"], a["x_test"]])[:, NUM_DENSE:]
    assert np.array_equal(ids, np.round(ids)) and ids.min() >= 0
    assert (ids.max(axis=0) < np.array(rows)).all()
    assert (np.bincount(ids[:, 2].astype(np.int64))[:3] > 0).all()  # id 0 is the most frequent: Zipf ranks
    assert np.bincount(ids[:, 2].astype(np.int64)).argmax() == 0
    dense = a["x"][:, :NUM_DENSE]  # log1p counts, standardised on the training split
    assert np.abs(dense.mean(0)).max() < 1e-3 and np.abs(dense.std(0) - 1).max() < 1e-2


def test_positive_rate_and_planted_auc():
    d = make_ctr(100_000, 1000, seed=0, test_fraction=0.2)
    y = np.concatenate([d["y"], d["y_test"]])
    assert abs(y.mean() - 0.256) < 0.02
    planted = d["meta"]["planted_auc"]
    assert planted > 0.7  # a teacher with a real signal ...
    assert planted == pytest.approx(auc(d["p_test"], d["y_test"]), abs=1e-6)  # ... measured on the true p
    # no model beats the truth by much: a good guess (the dense part alone) ranks worse
    assert auc(d["x_test"][:, 0], d["y_test"]) < planted


def test_the_default_cap_gives_dlrm_small_over_20m_parameters():
    rows = capped_cardinalities(200_000)
    assert sum(rows) * 16 > 20_000_000
    assert max(CRITEO_CARDINALITIES) > 2**23 and max(rows) < 2**24


def test_cache_round_trip_keeps_the_data_and_the_planted_auc(cache):
    spec = TaskSpec("ctr", 5000, ctr_max_rows=500, seed=1)
    first = load_task(spec)
    (entry,) = [p for p in cache.iterdir() if p.name.startswith("ctr-")]
    assert sorted(f.name for f in entry.iterdir()) == ["meta.json", "x.npy", "x_test.npy", "y.npy", "y_test.npy"]
    again = load_task(spec)
    assert torch.equal(first.train.tensors[0], again.train.tensors[0])
    assert torch.equal(first.test.tensors[1], again.test.tensors[1])
    assert first.planted_auc == again.planted_auc == json.loads((entry / "meta.json").read_text())["planted_auc"]
    assert first.cardinalities == again.cardinalities == capped_cardinalities(500)
    assert first.input_shape == (39,)
    # the cap is part of the data: another cap, another cache entry
    other = load_task(TaskSpec("ctr", 5000, ctr_max_rows=400, seed=1))
    assert max(other.cardinalities) == 400 and len(list(cache.iterdir())) == 2


def test_dlrm_small_takes_one_row_per_example_and_has_sparse_tables():
    rows = capped_cardinalities(100)
    model = build_model("dlrm-small", (39,), 2, cardinalities=rows)
    bags = [m for m in model.modules() if isinstance(m, torch.nn.EmbeddingBag)]
    assert [b.num_embeddings for b in bags] == list(rows)
    assert all(b.sparse and b.mode == "sum" and b.embedding_dim == 16 for b in bags)
    d = make_ctr(2000, 100, seed=0, test_fraction=0.5)
    x, y = torch.from_numpy(d["x"][:8]), torch.from_numpy(d["y"][:8])
    out = model(x)
    assert out.shape == (8,) and out.dtype == torch.float32
    bce_loss(out, y).backward()
    assert bags[2].weight.grad.is_sparse  # a step touches only the rows of its batch
    with pytest.raises(ValueError, match="cardinalities"):
        build_model("dlrm-small", (39,), 2)


@pytest.mark.slow  # ~4 s with a fresh data cache
def test_a_short_single_process_run_reports_auc_and_the_planted_optimum(cache, tmp_path):
    from distbelief.api import train_task

    cfg = RunConfig(task="ctr", model="dlrm-small", strategy="sgd", optimizer="adagrad", runtime="inprocess",
                    num_samples=30_000, ctr_max_rows=2000, max_steps=100, max_seconds=0, eval_every_seconds=0.5, threads=1,
                    out=str(tmp_path / "run"))
    res = train_task(cfg, quiet=True)
    s = res.summary
    assert s["best_test_auc"] == s["best_test_accuracy"] > 0.65  # clearly learning (0.5 is chance)
    assert s["final_test_auc"] == s["final_test_accuracy"]
    assert 0.5 < s["planted_auc"] < 1 and s["best_test_auc"] < s["planted_auc"] + 0.02
    assert 0 < s["test_logloss"] < 0.693  # better than a coin
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["planted_auc"] == s["planted_auc"] and "test_logloss" in on_disk
    assert AUCMetric(0.8)(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0])) == 1.0


@pytest.mark.parametrize("settings,field", [
    (dict(task="ctr", model="dlrm-small", ctr_max_rows=0), "ctr_max_rows"),
    (dict(task="ctr", model="dlrm-small", ctr_max_rows=2**24 + 1), "ctr_max_rows"),
    (dict(task="mnist1d", model="dlrm-small"), "model"),
    (dict(task="ctr", model="mlp"), "model"),
    (dict(task="ctr", model="dlrm-small", target_auc=0.5), "target_auc"),
    (dict(task="ctr", model="dlrm-small", target_auc=1.2), "target_auc"),
    (dict(task="ctr", model="dlrm-small", target_auc=0.8, target_accuracy=0.7), "target_auc"),
    (dict(task="mnist1d", target_auc=0.8), "target_auc"),
    (dict(task="ctr", model="dlrm-small", partitions=2), "partitions"),
])
def test_bad_ctr_settings_name_the_field(settings, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        RunConfig(**settings).validate()


def test_ctr_defaults_and_target_auc():
    cfg = RunConfig(task="ctr", model="dlrm-small", strategy="sgd", optimizer="adagrad", target_auc=0.79).validate()
    assert (cfg.num_samples, cfg.batch_size, cfg.ctr_max_rows) == (1_000_000, 256, 200_000)
    assert cfg.target_accuracy == 0.79 and 0.01 <= cfg.lr <= 0.1  # the stop rule reads target_accuracy
    assert cfg.validate() == cfg  # validating again changes nothing
    assert RunConfig().validate().num_samples == 40000
