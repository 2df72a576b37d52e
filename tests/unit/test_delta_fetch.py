"""Delta fetches (--compress-fetch delta; ps/shard.py ``fetch(since=...)``): a replica that applies the values a
shard says changed since its last fetch holds the shard's parameters bit for bit, with fewer bytes when few
changed; a shard it did not fetch from before (or that restarted) answers whole."""

import numpy as np
import pytest
import torch

from distbelief.compression import EncodedPush, make_codec
from distbelief.compression.wire import Fetched
from distbelief.ps.rules import Adagrad, SGD
from distbelief.ps.shard import ParameterShard

N = 1000


class Momentumish:
    """A rule that moves values whose gradient is 0 (it does not say it keeps them): every value a push covers
    must count as changed."""

    zero_gradient_keeps = False
    scratch = ()

    def init_state(self, n):
        return {}

    def rate_scale(self, staleness):
        return 1.0

    def apply(self, w, g, state, scale=1.0):
        w.mul_(0.999).add_(g, alpha=-0.1)


def shard(rule):
    return ParameterShard(0, 0, N, np.linspace(-1, 1, N, dtype=np.float32), rule, N)


def apply(local: np.ndarray, answer: Fetched) -> np.ndarray:
    if answer.idx is None:
        return answer.values.copy()
    local = local.copy()
    local[answer.idx] = answer.values
    return local


def sparse_grad(seed, nonzero=10):
    rng = np.random.default_rng(seed)
    g = np.zeros(N, dtype=np.float32)
    g[rng.choice(N, nonzero, replace=False)] = rng.standard_normal(nonzero).astype(np.float32)
    return g


@pytest.mark.parametrize("rule", [Adagrad(lr=0.1), SGD(lr=0.1)])
def test_a_replica_applying_deltas_holds_the_shards_values_bit_for_bit(rule):
    s = shard(rule)
    first, version = s.fetch(0, since=("", -1))
    assert first.idx is None  # nothing fetched before: whole
    local, since = apply(np.zeros(N, np.float32), first), (first.token, version)
    for step in range(6):
        for _ in range(3):  # other replicas' pushes too
            s.push(1, sparse_grad(step * 10 + _), 0, s.version)
        before = s.bytes_fetched
        answer, version = s.fetch(0, since=since)
        assert answer.idx is not None and answer.idx.size <= 30  # only what changed
        assert s.bytes_fetched - before == 8 * answer.idx.size < 4 * N
        local, since = apply(local, answer), (answer.token, version)
        assert np.array_equal(local, s.fetch()[0]), step


def test_values_a_rule_may_move_without_a_gradient_all_count_as_changed():
    s = shard(Momentumish())
    answer, version = s.fetch(0, since=("", -1))
    s.push(1, sparse_grad(0), 0, s.version)
    answer2, _ = s.fetch(0, since=(answer.token, version))
    assert answer2.idx is None  # all of it changed: whole is smaller than positions + values
    assert np.array_equal(answer2.values, s.fetch()[0])


def test_another_process_answers_whole_and_set_params_changes_everything():
    s, other = shard(Adagrad(lr=0.1)), shard(Adagrad(lr=0.1))
    answer, version = s.fetch(0, since=("", -1))
    assert other.fetch(0, since=(answer.token, version))[0].idx is None  # a restarted shard: another token
    s.set_params(np.ones(N, np.float32))
    assert s.fetch(0, since=(answer.token, version))[0].idx is None
    assert s.fetch(0, since=(answer.token, version + 99))[0].idx is None  # a version it never had


def test_a_compressed_push_marks_only_what_it_carried():
    s = shard(Adagrad(lr=0.1))
    answer, version = s.fetch(0, since=("", -1))
    codec = make_codec("topk", [(0, N)], ratio=0.02)
    g = torch.from_numpy(sparse_grad(3, nonzero=N))  # dense gradient, of which topk sends 2%
    s.push(1, EncodedPush("topk", codec.encode(g), codec.ranges), 0, s.version)
    delta, _ = s.fetch(0, since=(answer.token, version))
    assert delta.idx.size == 20 and s.bytes_pushed == codec.formula_bytes(0)
