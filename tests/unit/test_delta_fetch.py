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
    """The replica's load of an answer (``Fetched.load_into``), here into a flat vector whose range starts at 3."""
    flat = torch.full((N + 5,), 7.0)
    flat[3:3 + N] = torch.from_numpy(local)
    answer.load_into(flat, 3)
    assert (flat[:3] == 7).all() and (flat[3 + N:] == 7).all()  # nothing written outside the range
    return flat[3:3 + N].numpy().copy()


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


# -- sparse pushes (--compress topk under an elementwise rule: ps/shard.py ``_push_values``) and the change log --

class DenseAdagrad(Adagrad):
    """Adagrad declaring itself not elementwise: its shard decodes every top-k push and applies it densely (the
    reference for the sparse step) and finds what changed by scanning."""

    elementwise = False


def topk_pushes(count, ratio=0.02, seed=0):
    codec = make_codec("topk", [(0, N)], ratio=ratio)
    gen = torch.Generator().manual_seed(seed)
    return [EncodedPush("topk", codec.encode(torch.randn(N, generator=gen)), codec.ranges) for _ in range(count)]


def test_a_sparse_push_steps_only_its_values_as_the_dense_step_would():
    """The gathered step equals the decoded, dense one: values a push does not carry, and their Adagrad sums,
    stay bit for bit; the stepped ones agree to float32 rounding (one kernel on a gathered vector, one on the
    whole range)."""
    sparse, dense = shard(Adagrad(lr=0.1)), shard(DenseAdagrad(lr=0.1))
    for push in topk_pushes(5):
        sparse.push(1, push, 0, sparse.version, 8)
        dense.push(1, push, 0, dense.version, 8)
    touched = torch.zeros(N, dtype=torch.bool)
    for push in topk_pushes(5):
        touched[torch.as_tensor(push.parts[0][0]).long()] = True
    w_s, w_d = sparse.vectors["params"], dense.vectors["params"]
    assert torch.equal(w_s[~touched], w_d[~touched])
    torch.testing.assert_close(w_s[touched], w_d[touched], rtol=1e-6, atol=0)
    torch.testing.assert_close(sparse.opt_state["sum_sq"], dense.opt_state["sum_sq"], rtol=1e-6, atol=0)
    assert torch.equal(sparse.opt_state["sum_sq"][~touched], dense.opt_state["sum_sq"][~touched])
    for name in ("version", "examples", "bytes_pushed", "staleness_count"):
        assert getattr(sparse, name) == getattr(dense, name), name


def test_a_sparse_push_with_a_non_finite_value_is_rejected_whole():
    s = shard(Adagrad(lr=0.1))
    push = topk_pushes(1)[0]
    push.parts[0][1][3] = float("nan")
    before = s.vectors["params"].clone()
    assert s.push(1, push, 0, 0, 8) == 0 and s.rejected_pushes == 1
    assert torch.equal(s.vectors["params"], before) and s.opt_state["sum_sq"].abs().sum() == 0


@pytest.mark.parametrize("idx", [[5, 3, 9], [1, 1, 2], [-1, 2, 3], [0, 1, N]], ids=str)
def test_positions_a_sparse_step_cannot_trust_fall_back_to_decoding(idx):
    """Positions out of order, repeated or outside the range are not what topk makes: the shard decodes the part
    (a position outside the range then fails the push, as decoding it always did)."""
    from distbelief.compression.topk import TopK

    part = (torch.tensor(idx, dtype=torch.int32), torch.ones(3))
    assert TopK.positions(part, 0, N) is None
    assert TopK.positions((torch.tensor(sorted(set(range(3)))), torch.ones(3)), 0, N) is not None


def test_the_change_log_answers_as_the_scan_does_for_every_replica_version():
    """Replicas fetching from many versions back, across sparse pushes, a dense push, set_params and a log long
    enough to drop its oldest entries: every delta fetch names the positions the scan of the same history names."""
    logged, scanned = shard(Adagrad(lr=0.1)), shard(DenseAdagrad(lr=0.1))
    token = {}
    for s in (logged, scanned):
        answer, _ = s.fetch(0, since=("", -1))
        token[id(s)] = answer.token
    pushes = iter(topk_pushes(80, ratio=0.01, seed=2))
    for step in range(60):
        if step == 20:
            for s in (logged, scanned):
                s.push(1, sparse_grad(step, nonzero=50), 0, s.version)  # dense: the log starts again
        elif step == 40:
            for s in (logged, scanned):
                s.set_params(np.linspace(0, 1, N, dtype=np.float32))
        else:
            push = next(pushes)
            for s in (logged, scanned):
                s.push(1, push, 0, s.version)
        for back in (0, 1, 2, 5, 13, 30, 70):
            since = logged.version - back
            a, _ = logged.fetch(0, since=(token[id(logged)], since))
            b, _ = scanned.fetch(0, since=(token[id(scanned)], since))
            assert (a.idx is None) == (b.idx is None), (step, back)
            if a.idx is not None:
                assert np.array_equal(a.idx, b.idx), (step, back)
    assert logged._changes and logged._changes_base > 40  # the log was used, and dropped what it outgrew


def test_a_float16_fetch_answers_the_values_rounded_as_numpy_rounds_them():
    """``fetch(half=True)``: a float16 copy of the range, each value rounded to nearest even as numpy's ``astype``
    rounds it (overflow to infinity, subnormals, NaN kept), and counted as half the bytes."""
    s = shard(SGD(lr=0.1))
    values = np.random.default_rng(5).standard_normal(N).astype(np.float32) * np.float32(300.0)
    values[:6] = [np.nan, np.inf, 65520.0, -1e6, 3e-8, -0.0]
    s.set_params(values)
    before = s.bytes_fetched
    answer, _ = s.fetch(half=True)
    assert answer.dtype == np.float16
    with np.errstate(over="ignore"):  # (65520 and -1e6 overflow to infinity, as they should)
        expected = values.astype(np.float16)
    assert np.array_equal(answer.view(np.uint16), expected.view(np.uint16))
    assert s.bytes_fetched - before == 2 * N
