"""Staleness-aware server rates (Zhang et al., IJCAI 2016): a push ``tau`` updates stale is applied at rate
``lr / tau``. Oracles: hand-computed sequences on one shard, for SGD and Adagrad, and the rule off by default."""

import numpy as np
import pytest

from distbelief.config import RunConfig
from distbelief.exceptions import ConfigError
from distbelief.ps.optimizers import make_server_optimizer
from distbelief.ps.shard import ParameterShard

W0 = np.array([1.0, -2.0, 0.5], np.float32)
GRADS = [np.array(g, np.float32) for g in ([1.0, 0.0, 2.0], [0.5, 1.0, -1.0], [2.0, 2.0, 2.0],
                                           [-1.0, 0.5, 0.0], [1.0, 1.0, 1.0])]
BASED_ON = [0, 0, 0, 1, 4]  # shard versions before each push: 0,1,2,3,4 -> staleness 0,1,2,2,0
SCALES = [1.0, 1.0, 0.5, 0.5, 1.0]  # 1/tau, never above 1


def run(opt) -> tuple[np.ndarray, ParameterShard]:
    shard = ParameterShard(0, 0, 3, W0.copy(), opt, 3)
    for g, v in zip(GRADS, BASED_ON):
        shard.push(0, g, 0, v, num_examples=1)
    return shard.fetch()[0].copy(), shard


def test_sgd_steps_are_divided_by_their_staleness():
    got, shard = run(make_server_optimizer("sgd", 0.1, staleness_aware=True))
    expected = W0.astype(np.float64) - 0.1 * sum(s * g for s, g in zip(SCALES, GRADS))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    assert shard.staleness_max == 2 and shard.staleness_sum == 5


def test_adagrad_rates_are_divided_but_the_accumulator_sees_every_gradient():
    eps = 1e-10
    got, _ = run(make_server_optimizer("adagrad", 0.1, eps=eps, initial_accumulator=0.1, staleness_aware=True))
    w, acc = W0.astype(np.float64).copy(), np.full(3, 0.1)
    for s, g in zip(SCALES, GRADS):
        acc += g.astype(np.float64) ** 2
        w -= 0.1 * s * g / (np.sqrt(acc) + eps)
    np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)


def test_off_by_default_every_push_at_the_full_rate():
    got, _ = run(make_server_optimizer("sgd", 0.1))
    np.testing.assert_allclose(got, W0 - 0.1 * sum(GRADS), rtol=0, atol=1e-6)
    assert not RunConfig().staleness_aware


def test_refused_with_a_write_ahead_log_whose_replay_could_not_repeat_it():
    with pytest.raises(ConfigError, match="^staleness_aware: is not available with durability"):
        RunConfig(staleness_aware=True, durability="log").validate()
    assert RunConfig(staleness_aware=True, durability="snapshot").validate().staleness_aware


def test_a_partial_range_push_uses_the_same_scale():
    opt = make_server_optimizer("sgd", 1.0, staleness_aware=True)
    shard = ParameterShard(0, 0, 3, W0.copy(), opt, 3)
    shard.push(0, np.ones(3, np.float32), 0, 0)
    shard.push(0, np.ones(3, np.float32), 0, 0)
    shard.push(0, np.array([4.0], np.float32), 1, 0)  # staleness 2: only parameter 1, at half the rate
    np.testing.assert_allclose(shard.fetch()[0], W0 - np.array([2.0, 4.0, 2.0]), atol=1e-6)
