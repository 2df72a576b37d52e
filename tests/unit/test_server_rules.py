"""Server update rules (distbelief/ps/rules): the registry, dense steps against torch.optim, and sparse row steps
on an embedding-table slice against torch.optim.Adagrad on a sparse nn.Embedding and a float64 reference."""

import dataclasses
import pickle

import pytest
import torch
from torch import nn

from distbelief.config import OPTIMIZERS, RunConfig
from distbelief.exceptions import ConfigError
from distbelief.ps.rules import RULES, SGD, Adagrad, RowwiseAdagrad, make_rule, register, rule_names

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch.optim.Adagrad's own sparse tensors

NUM_ROWS, DIM, LR, EPS = 12, 5, 0.1, 1e-10
# Ids of 6 steps: repeated within a step (summed by the caller) and across steps (the state accumulates).
STEP_IDS = [[1, 3, 3, 7], [3, 0, 11], [7, 7, 7, 2], [1, 3], [11, 5, 5, 0], [3, 9]]
UNTOUCHED = sorted(set(range(NUM_ROWS)) - {i for ids in STEP_IDS for i in ids})  # rows 4, 6, 8, 10


def sparse_grads(seed=0):
    """Per step: (ids (k,), per-id gradient (k, DIM)) of an embedding lookup."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.tensor(ids), torch.randn(len(ids), DIM, generator=gen)) for ids in STEP_IDS]


def summed(ids, g):
    """What the caller hands ``apply_rows``: unique rows and their summed gradient."""
    s = torch.sparse_coo_tensor(ids[None], g, (NUM_ROWS, DIM), check_invariants=True).coalesce()
    return s.indices()[0], s.values()


def run_rule(rule, weight0, steps):
    weight = weight0.clone()
    state = rule.init_row_state(NUM_ROWS, DIM)
    for ids, g in steps:
        rows, values = summed(ids, g)
        rule.apply_rows(weight, rows, values, state)
    return weight, state


# ---------------------------------------------------------------- registry
def test_the_registry_lists_the_shipped_rules_and_config_and_cli_take_their_choices_from_it():
    assert rule_names() == ("sgd", "adagrad", "rowwise-adagrad")
    assert RULES["rowwise-adagrad"] is RowwiseAdagrad
    assert OPTIMIZERS == ("auto", *rule_names())
    from distbelief.cli import CHOICES

    assert CHOICES["optimizer"] == OPTIMIZERS


def test_make_rule_passes_each_rule_the_settings_it_declares_and_names_the_choices_for_an_unknown_one():
    assert make_rule("sgd", lr=0.5, eps=1.0, staleness_aware=True) == SGD(lr=0.5, staleness_aware=True)
    assert make_rule("adagrad", lr=0.5, eps=1e-3, initial_accumulator=0.1) == Adagrad(0.5, 1e-3, 0.1)
    with pytest.raises(ValueError, match="'adagard'.*sgd, adagrad, rowwise-adagrad"):
        make_rule("adagard", lr=0.1)


def test_a_rule_registered_at_runtime_is_made_and_accepted_by_the_config():
    @dataclasses.dataclass(frozen=True)
    class HalfSGD:  # one file + one registry line: this class and the decorator
        summary = "half the rate"
        scratch = ()
        lr: float

        def init_state(self, n):
            return {}

        def init_row_state(self, num_rows, dim):
            return {}

        def rate_scale(self, staleness):
            return 1.0

        def apply(self, w, g, state, scale=1.0):
            w.add_(g, alpha=-0.5 * self.lr * scale)

        def apply_rows(self, weight, rows, g, state, scale=1.0):
            weight.index_add_(0, rows, g, alpha=-0.5 * self.lr * scale)

    register("half-sgd")(HalfSGD)
    try:
        rule = make_rule("half-sgd", lr=0.4, eps=1.0)
        w = torch.ones(3)
        rule.apply(w, torch.ones(3), rule.init_state(3))
        assert torch.equal(w, torch.full((3,), 0.8))
        assert RunConfig(optimizer="half-sgd", lr=0.1).validate().optimizer == "half-sgd"
        with pytest.raises(ConfigError, match="optimizer"):  # no torch_optimizer: not for torch.optim strategies
            RunConfig(optimizer="half-sgd", lr=0.1, strategy="ddp").validate()
        with pytest.raises(ValueError, match="already registered"):
            register("half-sgd")(HalfSGD)
    finally:
        del RULES["half-sgd"]


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise-adagrad"])
def test_a_rule_round_trips_through_pickle(name):
    rule = make_rule(name, lr=0.05, eps=1e-8, initial_accumulator=0.1, staleness_aware=True)
    assert pickle.loads(pickle.dumps(rule)) == rule
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.lr = 1.0


# ---------------------------------------------------------------- dense steps
def dense_run(rule, make_opt, steps=5):
    """``rule.apply`` and ``make_opt(params)``'s steps from the same start on the same gradients."""
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(257, generator=gen)
    ref = nn.Parameter(w0.clone())
    opt = make_opt([ref])
    w, state = w0.clone(), rule.init_state(257)
    for _ in range(steps):
        g = torch.randn(257, generator=gen)
        rule.apply(w, g, state)
        ref.grad = g.clone()
        opt.step()
    return w, ref.detach()


def test_dense_sgd_equals_torch_optim_sgd_bit_for_bit():
    w, ref = dense_run(SGD(lr=LR), lambda p: torch.optim.SGD(p, lr=LR))
    assert torch.equal(w, ref)


@pytest.mark.parametrize("name", ["adagrad", "rowwise-adagrad"])  # row-wise Adagrad is Adagrad on dense slices
def test_dense_adagrad_equals_torch_optim_adagrad(name):
    """Bit for bit against torch's fused Adagrad (the kernel the shard runs); torch's default (foreach) path
    rounds in another order, so against it 1e-6."""
    rule = make_rule(name, lr=LR, eps=EPS, initial_accumulator=0.1)
    settings = {"lr": LR, "eps": EPS, "initial_accumulator_value": 0.1}
    w, ref = dense_run(rule, lambda p: torch.optim.Adagrad(p, **settings))
    torch.testing.assert_close(w, ref, rtol=1e-6, atol=1e-6)
    if hasattr(torch, "_fused_adagrad_"):
        w, ref = dense_run(rule, lambda p: torch.optim.Adagrad(p, **settings, fused=True))
        assert torch.equal(w, ref)


def test_scratch_names_the_state_that_is_not_persisted():
    assert SGD.scratch == () and Adagrad.scratch == ("tmp",) and RowwiseAdagrad.scratch == ("tmp",)
    for name in rule_names():
        rule = make_rule(name, lr=0.1)
        assert set(rule.init_row_state(3, 2)).isdisjoint(rule.scratch)


# ---------------------------------------------------------------- sparse row steps
def test_sgd_rows_equal_torch_optim_sgd_on_a_sparse_embedding_and_move_only_the_pushed_rows():
    """1e-6, not bit for bit: torch's sparse SGD adds each duplicate id's step on its own, apply_rows gets their
    sum."""
    emb = nn.Embedding(NUM_ROWS, DIM, sparse=True)
    weight0 = emb.weight.detach().clone()
    opt = torch.optim.SGD(emb.parameters(), lr=LR)
    steps = sparse_grads()
    for ids, g in steps:
        opt.zero_grad()
        (emb(ids) * g).sum().backward()
        opt.step()
    weight, state = run_rule(SGD(lr=LR), weight0, steps)
    assert state == {}
    torch.testing.assert_close(weight, emb.weight.detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(weight[UNTOUCHED], weight0[UNTOUCHED])


@pytest.mark.parametrize("initial_accumulator", [0.0, 0.1])
def test_adagrad_rows_equal_torch_optim_adagrad_on_a_sparse_embedding_bit_for_bit(initial_accumulator):
    """Lazy sparse Adagrad: apply_rows follows torch's sparse branch op for op, so the result is exact (not
    allclose): same weights, same accumulators, after 6 steps with ids repeated within and across steps."""
    emb = nn.Embedding(NUM_ROWS, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(NUM_ROWS, DIM, generator=torch.Generator().manual_seed(3)))
    weight0 = emb.weight.detach().clone()
    opt = torch.optim.Adagrad(emb.parameters(), lr=LR, eps=EPS, initial_accumulator_value=initial_accumulator)
    steps = sparse_grads()
    for ids, g in steps:
        opt.zero_grad()
        (emb(ids) * g).sum().backward()  # d/d emb(ids) = g: the sparse gradient holds g at ids, duplicates too
        opt.step()
    rule = Adagrad(lr=LR, eps=EPS, initial_accumulator=initial_accumulator)
    weight, state = run_rule(rule, weight0, steps)
    assert torch.equal(weight, emb.weight.detach())
    assert torch.equal(state["sum_sq"], opt.state[emb.weight]["sum"])
    assert torch.equal(weight[UNTOUCHED], weight0[UNTOUCHED])
    assert (state["sum_sq"][UNTOUCHED] == initial_accumulator).all()


def test_rowwise_adagrad_rows_match_a_float64_reference_and_keep_one_accumulator_per_row():
    weight0 = torch.randn(NUM_ROWS, DIM, generator=torch.Generator().manual_seed(4))
    steps = sparse_grads()
    rule = RowwiseAdagrad(lr=LR, eps=EPS, initial_accumulator=0.1)
    weight, state = run_rule(rule, weight0, steps)
    assert set(state) == {"row_sum_sq"} and state["row_sum_sq"].shape == (NUM_ROWS,)

    w, acc = weight0.double(), torch.full((NUM_ROWS,), 0.1, dtype=torch.float64)  # FBGEMM's EXACT_ROWWISE
    for ids, g in steps:
        rows, values = summed(ids, g)
        for r, v in zip(rows.tolist(), values.double()):
            acc[r] += (v * v).mean()
            w[r] -= LR * v / (acc[r].sqrt() + EPS)
    torch.testing.assert_close(weight.double(), w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state["row_sum_sq"].double(), acc, rtol=1e-6, atol=1e-6)
    assert torch.equal(weight[UNTOUCHED], weight0[UNTOUCHED])
    assert (state["row_sum_sq"][UNTOUCHED] == 0.1).all()


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise-adagrad"])
def test_the_rate_scale_slows_a_row_step_as_it_slows_a_dense_one(name):
    rule = make_rule(name, lr=LR, staleness_aware=True)
    weight0 = torch.zeros(NUM_ROWS, DIM)
    rows, g = torch.tensor([2, 5]), torch.ones(2, DIM)
    full, slow = weight0.clone(), weight0.clone()
    rule.apply_rows(full, rows, g, rule.init_row_state(NUM_ROWS, DIM))
    rule.apply_rows(slow, rows, g, rule.init_row_state(NUM_ROWS, DIM), scale=rule.rate_scale(4))
    torch.testing.assert_close(slow, full / 4)


# ---------------------------------------------------------------- configuration
@pytest.mark.parametrize("strategy", ["sgd", "hogwild", "ddp"])
def test_validate_refuses_rowwise_adagrad_where_torch_optim_trains(strategy):
    with pytest.raises(ConfigError, match="rowwise-adagrad.*torch.optim") as err:
        RunConfig(strategy=strategy, optimizer="rowwise-adagrad").validate()
    assert err.value.field == "optimizer"


def test_rowwise_adagrad_runs_on_the_parameter_server_at_adagrads_rate():
    for strategy in ("downpour", "sync"):
        cfg = RunConfig(strategy=strategy, optimizer="rowwise-adagrad").validate()
        assert cfg.lr == RunConfig(strategy=strategy, optimizer="adagrad").validate().lr
