import numpy as np
import pytest
import torch

from distbelief.ps.optimizers import SGD, Adagrad
from distbelief.ps.shard import ParameterShard


def make_shard(lo=10, hi=20, total=30, opt=None):
    return ParameterShard(0, lo, hi, np.zeros(hi - lo, np.float32), opt or SGD(lr=0.5), total)


def test_push_applies_only_the_intersection():
    s = make_shard()
    g = np.arange(30, dtype=np.float32)
    s.push(0, g, 0, based_on_version=0)
    values, version = s.fetch(0)
    assert version == 1
    np.testing.assert_allclose(values, -0.5 * np.arange(10, 20))


def test_partial_range_push_with_offset():
    s = make_shard()
    s.push(0, np.ones(5, np.float32), 17, based_on_version=0)  # covers 17..21, we own up to 19
    values, _ = s.fetch(0)
    np.testing.assert_allclose(values, [0] * 7 + [-0.5] * 3)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_push_is_rejected_and_counted(bad):
    s = make_shard()
    g = np.ones(30, np.float32)
    g[15] = bad
    s.push(0, g, 0, 0)
    values, version = s.fetch(0)
    assert version == 0 and s.rejected_pushes == 1 and np.isfinite(values).all() and not values.any()


def test_huge_but_finite_push_is_applied_although_its_float32_sum_overflows():
    s = make_shard(opt=SGD(lr=1e-30))
    g = np.full(30, 3e38, np.float32)  # every element finite; their float32 sum is +inf
    s.push(0, g, 0, 0)
    values, version = s.fetch(0)
    assert version == 1 and s.rejected_pushes == 0
    np.testing.assert_allclose(values, np.full(10, -3e8, np.float32), rtol=1e-6)


def test_wrongly_sized_or_typed_push_is_rejected():
    s = make_shard()
    s.push(0, np.ones(31, np.float32), 0, 0)  # past the model's end
    s.push(0, np.ones(30, np.float64), 0, 0)  # wrong dtype
    s.push(0, np.ones(3, np.float32), -1, 0)
    assert s.rejected_pushes == 3 and s.version == 0


def test_staleness_is_versions_applied_since_the_pushers_parameters():
    s = make_shard()
    g = np.ones(30, np.float32)
    for _ in range(3):
        s.push(0, g, 0, based_on_version=s.version)  # fresh: staleness 0
    s.push(1, g, 0, based_on_version=0)  # computed on version 0, applied at version 3
    st = s.stats()
    assert st["staleness_max"] == 3 and st["staleness_sum"] == 3 and st["staleness_count"] == 4


def test_adagrad_rule_matches_formula():
    s = make_shard(0, 4, 4, Adagrad(lr=0.1, eps=1e-10))
    g1 = np.array([1, 2, 3, 4], np.float32)
    g2 = np.array([1, -1, 0.5, 2], np.float32)
    s.push(0, g1, 0, 0)
    s.push(0, g2, 0, 1)
    w = -0.1 * g1 / (np.sqrt(g1**2) + 1e-10)
    w = w - 0.1 * g2 / (np.sqrt(g1**2 + g2**2) + 1e-10)
    np.testing.assert_allclose(s.fetch(0)[0], w, rtol=1e-6)


def test_vector_ops():
    s = make_shard(0, 4, 4)
    s.vectors["params"].copy_(torch.tensor([1.0, 2, 3, 4]))
    s.copy("params", "d")
    s.scale("d", 2.0)
    s.axpy(-1.0, "params", "d")  # d = params
    assert s.dot("d", "params") == pytest.approx(30.0)
    s.accumulate("g", np.ones(6, np.float32), offset=-2)
    assert s.vectors["g"].tolist() == [1, 1, 1, 1]
    s.zero("g")
    assert s.dot("g", "g") == 0.0
