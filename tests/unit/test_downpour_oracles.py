"""Oracles for the Downpour loop on the in-process runtime (deterministic with one replica): bit for bit
(``torch.equal``) where the reference does the server's arithmetic in the same order; to float32 rounding where
it cannot (each such test says why)."""

import pytest
import torch
import torch.nn.functional as F

from distbelief import train
from distbelief.data.batches import BatchSource, replica_indices
from distbelief.ps.sharding import flatten
from tests.conftest import make_odd_model

SEED = 3
BATCH = 16


def run_downpour(data, **kw):
    settings = dict(strategy="downpour", runtime="inprocess", replicas=1, shards=1, fetch_every=1, push_every=1,
                    local_lr=0.0, overlap=False, batch_size=BATCH, max_seconds=0, eval_every_seconds=3600,
                    seed=SEED)
    settings.update(kw)
    train_ds, test_ds = data
    return train(make_odd_model, train_ds, test_ds, quiet=True, **settings)


def reference_batches(train_ds, num_replicas=1, replica_id=0):
    idx = replica_indices(len(train_ds), num_replicas, replica_id, SEED)
    return BatchSource(train_ds, idx, BATCH, seed=SEED * 7919 + replica_id)


def reference_run(train_ds, make_opt, steps, delay=0):
    """Single-process torch.optim; ``delay=1`` applies each step's gradient computed on the previous parameters."""
    torch.manual_seed(SEED)
    model = make_odd_model()
    opt = make_opt(model.parameters())
    batches = reference_batches(train_ds)
    prev = [p.detach().clone() for p in model.parameters()]
    for _ in range(steps):
        x, y = batches.next_batch()
        if delay:
            cur = [p.detach().clone() for p in model.parameters()]
            with torch.no_grad():
                for p, q in zip(model.parameters(), prev):
                    p.copy_(q)
            prev = cur
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if delay:
            with torch.no_grad():
                for p, q in zip(model.parameters(), prev):
                    p.copy_(q)
        opt.step()
    return flatten(model)


@pytest.mark.parametrize("shards", [1, 3])
def test_one_replica_server_sgd_equals_torch_sgd(toy_data, shards):
    res = run_downpour(toy_data, optimizer="sgd", lr=0.1, max_steps=20, shards=shards)
    ref = reference_run(toy_data[0], lambda p: torch.optim.SGD(p, lr=0.1), 20)
    assert res.summary["updates_per_shard"] == [20] * shards
    assert torch.equal(res.flat_params, ref)  # the server's SGD step is torch's, op for op


def test_one_replica_server_adagrad_equals_torch_adagrad(toy_data):
    res = run_downpour(toy_data, optimizer="adagrad", lr=0.05, adagrad_eps=1e-10, max_steps=20)
    ref = reference_run(toy_data[0], lambda p: torch.optim.Adagrad(p, lr=0.05, eps=1e-10), 20)
    # Not bit for bit: the server's Adagrad rule orders its float32 operations differently from
    # torch.optim.Adagrad (see test_server_rules), so the two agree to rounding only.
    torch.testing.assert_close(res.flat_params, ref, atol=1e-6, rtol=0)


def test_overlapped_fetch_is_exactly_one_step_stale(toy_data):
    """With prefetch, step t's gradient is computed on the parameters after t-1 updates (for t >= 1)."""
    res = run_downpour(toy_data, optimizer="sgd", lr=0.1, max_steps=20, overlap=True)
    ref = reference_run(toy_data[0], lambda p: torch.optim.SGD(p, lr=0.1), 20, delay=1)
    assert torch.equal(res.flat_params, ref)
    assert res.summary["staleness_max"] == 1


def test_push_every_accumulates_gradients(toy_data):
    """n_push = n_fetch = 4 and alpha = 0: one server step with the sum of 4 gradients on the same parameters."""
    res = run_downpour(toy_data, optimizer="sgd", lr=0.05, max_steps=8, fetch_every=4, push_every=4)
    torch.manual_seed(SEED)
    model = make_odd_model()
    batches = reference_batches(toy_data[0])
    for _ in range(2):
        model.zero_grad()
        for _ in range(4):
            x, y = batches.next_batch()
            F.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.05)
    assert res.summary["updates_per_shard"] == [2]
    assert torch.equal(res.flat_params, flatten(model))


def test_local_step_alpha_moves_replica_between_fetches(toy_data):
    """alpha > 0 with n_fetch = 2: the second gradient is taken at w - alpha * g1 (server SGD, push every 2)."""
    res = run_downpour(toy_data, optimizer="sgd", lr=0.1, local_lr=0.3, max_steps=2, fetch_every=2,
                       push_every=2)
    torch.manual_seed(SEED)
    model = make_odd_model()
    w0 = flatten(model)
    batches = reference_batches(toy_data[0])
    x, y = batches.next_batch()
    F.cross_entropy(model(x), y).backward()
    g1 = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.3)
    model.zero_grad()
    x, y = batches.next_batch()
    F.cross_entropy(model(x), y).backward()
    g2 = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.equal(res.flat_params, w0.add(g1 + g2, alpha=-0.1))  # the server's step: w.add_(g, alpha=-lr)


@pytest.mark.parametrize("replicas,steps,push_every", [(1, 12, 1), (2, 12, 3), (3, 8, 4), (4, 6, 2)])
def test_each_shard_applies_exactly_R_S_over_n_updates(toy_data, replicas, steps, push_every):
    res = run_downpour(toy_data, optimizer="adagrad", lr=0.01, replicas=replicas, shards=3,
                       max_steps=steps, push_every=push_every, overlap=True)
    assert res.summary["updates_per_shard"] == [replicas * steps // push_every] * 3
    assert res.summary["examples"] == replicas * steps * BATCH
    assert res.summary["steps_per_replica"] == [steps] * replicas


def test_sync_equals_sgd_on_the_concatenated_batch(toy_data):
    """Synchronous data parallel: averaging R gradients of batch B == one gradient of the R*B batch."""
    train_ds, test_ds = toy_data
    res = train(make_odd_model, train_ds, test_ds, quiet=True, strategy="sync", runtime="inprocess", replicas=2,
                shards=2, optimizer="sgd", lr=0.2, batch_size=BATCH, max_steps=10, max_seconds=0,
                eval_every_seconds=3600, seed=SEED)
    torch.manual_seed(SEED)
    model = make_odd_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    srcs = [reference_batches(train_ds, 2, r) for r in range(2)]
    for _ in range(10):
        xs, ys = zip(*(s.next_batch() for s in srcs))
        opt.zero_grad()
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    # Equal in exact arithmetic, not bit for bit: the mean of two 16-example mean gradients rounds differently
    # from one 32-example mean gradient.
    torch.testing.assert_close(res.flat_params, flatten(model), atol=1e-6, rtol=0)
    assert res.summary["updates_per_shard"] == [10, 10] and res.summary["staleness_max"] == 0
