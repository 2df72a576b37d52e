"""Embedding tables held row-sharded on the shards: the slicer, the shard's rows, and exact oracles for the
in-process Downpour loop against single-process torch with sparse gradients."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from distbelief import train
from distbelief.data.batches import BatchSource, replica_indices
from distbelief.exceptions import ConfigError
from distbelief.ps.rules import make_rule
from distbelief.ps.shard import ParameterShard
from distbelief.ps.sharding import flatten
from distbelief.ps.slicer import Slicer

SEED = 5
BATCH = 16
ROWS = (50, 7, 300)


class TinyCTR(nn.Module):
    """Three categorical fields (an Embedding, two EmbeddingBags) and two dense features; ``x`` carries the ids
    as exact integers in float32 after the dense features."""

    def __init__(self, sparse: bool = True, declare_ids: bool = False):
        super().__init__()
        self.dense = nn.Linear(2, 4)
        self.e0 = nn.Embedding(ROWS[0], 4, sparse=sparse)
        self.bags = nn.ModuleList([nn.EmbeddingBag(n, 4, mode="sum", sparse=sparse) for n in ROWS[1:]])
        self.top = nn.Linear(16, 2)
        self.declare_ids = declare_ids

    def ids(self, x):
        return [x[:, 2 + f].long() for f in range(3)]

    def forward(self, x):
        ids = self.ids(x)
        parts = [self.dense(x[:, :2]), self.e0(ids[0])]
        parts += [bag(i[:, None]) for bag, i in zip(self.bags, ids[1:])]
        return self.top(torch.relu(torch.cat(parts, 1)))


class DeclaredCTR(TinyCTR):
    def embedding_ids(self, x):  # one id tensor per table, in module order: rows fetched in one call per shard
        return self.ids(x)


def ctr_data(n=512, seed=0, rows=ROWS):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, 2, generator=g)
    # Zipf-like ids: small ids frequent
    ids = [torch.clamp((torch.rand(n, generator=g) ** 3 * r).long(), max=r - 1) for r in rows]
    x = torch.cat([dense] + [i[:, None].float() for i in ids], 1)
    y = ((dense[:, 0] + (ids[0] % 3 == 0).float()) > 0.5).long()
    return TensorDataset(x, y)


def run_downpour(model_fn, ds, **kw):
    settings = dict(strategy="downpour", runtime="inprocess", replicas=1, shards=2, fetch_every=1, push_every=1,
                    local_lr=0.0, overlap=False, batch_size=BATCH, max_seconds=0, eval_every_seconds=3600,
                    seed=SEED, optimizer="adagrad", lr=0.05, adagrad_eps=1e-10, max_steps=25,
                    durability="off")
    settings.update(kw)
    settings.setdefault("quiet", True)
    return train(model_fn, ds, ds, **settings)


def torch_reference(model_fn, ds, steps, lr=0.05, opt="adagrad", replica_id=0, num_replicas=1):
    torch.manual_seed(SEED)
    model = model_fn()
    if opt == "adagrad":
        # The shards' dense Adagrad is torch's fused kernel (one ulp from the default path); their row updates are
        # torch's sparse Adagrad step, op for op. With the same arithmetic on each side the runs agree bit for bit.
        tables = [m.weight for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
        dense = [p for p in model.parameters() if all(p is not w for w in tables)]
        fused, rows = (torch.optim.Adagrad(dense, lr=lr, eps=1e-10, fused=True),
                       torch.optim.Adagrad(tables, lr=lr, eps=1e-10))
    else:
        fused, rows = torch.optim.SGD(model.parameters(), lr=lr), None
    idx = replica_indices(len(ds), num_replicas, replica_id, SEED)
    batches = BatchSource(ds, idx, BATCH, seed=SEED * 7919 + replica_id)
    for _ in range(steps):
        x, y = batches.next_batch()
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for o in (fused, rows):
            if o is not None:
                o.step()
    return flatten(model)


# ---------------------------------------------------------------------------------------------- the slicer
def test_slicer_finds_tables_and_deals_rows_modulo():
    model = TinyCTR()
    s = Slicer.for_model(model, 3)
    assert [t.module for t in s.tables] == ["e0", "bags.0", "bags.1"]
    assert [t.num_rows for t in s.tables] == list(ROWS)
    # one width, one row group: keys are the tables' rows one after the other
    assert len(s.groups) == 1 and s.groups[0].num_rows == sum(ROWS) and s.groups[0].bases == (0, 50, 57)
    n_dense = sum(p.numel() for n, p in model.named_parameters() if "e0" not in n and "bags" not in n)
    assert s.total == n_dense and s.full_total == sum(p.numel() for p in model.parameters())
    assert sum(s.sizes()) == n_dense and max(s.sizes()) - min(s.sizes()) <= 1
    assert [s.groups[0].local_rows(k, 3) for k in range(3)] == [119, 119, 119]
    full = flatten(model)
    back = s.assemble(s.to_dense(full), [s.shard_rows(full, k) for k in range(3)])
    assert torch.equal(back, full)
    rows1 = s.shard_rows(full, 1)[0]  # keys 1, 4, 7, ...: e0's rows 1, 4, ..., 49, then bags.0's row 2 (key 52)
    assert np.array_equal(rows1[:17], model.e0.weight.detach().numpy()[1::3])
    assert np.array_equal(rows1[17], model.bags[0].weight.detach().numpy()[2])
    assert s.describe_key(0, 52) == "table 'bags.0' (EmbeddingBag, 7 rows): row id 2"


def test_tables_of_different_widths_are_separate_row_groups():
    m = nn.Module()
    m.a, m.b, m.c, m.d = nn.Embedding(5, 2), nn.Linear(2, 2), nn.EmbeddingBag(6, 3), nn.Embedding(4, 2)
    s = Slicer.for_model(m, 2)
    assert [(g.dim, g.num_rows, g.tables, g.bases) for g in s.groups] == [(2, 9, (0, 2), (0, 5)), (3, 6, (1,), (0,))]


def test_slicer_refuses_tables_it_cannot_serve():
    class MaxNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Embedding(10, 2, max_norm=1.0)
            self.l = nn.Linear(2, 2)

    with pytest.raises(ConfigError, match="max_norm"):
        Slicer.for_model(MaxNorm(), 2)
    bag = nn.Sequential(nn.EmbeddingBag(10, 2, mode="max"), nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="mode='max'"):
        Slicer.for_model(bag, 2)


# ---------------------------------------------------------------------------------------------- the shard
def _table_shard(rule="adagrad", shard_id=1, num_shards=2):
    model = TinyCTR()
    s = Slicer.for_model(model, num_shards)
    full = flatten(model)
    lo, hi = s.range(shard_id)
    dense = s.to_dense(full)
    shard = ParameterShard(shard_id, lo, hi, dense[lo:hi].numpy(), make_rule(rule, lr=0.1), s.total,
                           tables=(s, s.shard_rows(full, shard_id), None))
    return s, shard


def test_untouched_rows_and_their_state_stay_bit_for_bit():
    s, shard = _table_shard()
    lo, hi = s.range(1)
    before = [(t.weight.clone(), {k: v.clone() for k, v in t.state.items()}) for t in shard.tables]
    ids = np.array([0, 3, 7], dtype=np.int64)
    g = np.ones((3, 4), dtype=np.float32)
    shard.push(0, np.zeros(hi - lo, np.float32), lo, 0, 4, rows=[(ids, g)])
    w0, st0 = before[0]
    touched = torch.zeros(w0.shape[0], dtype=torch.bool)
    touched[ids] = True
    assert torch.equal(shard.tables[0].weight[~touched], w0[~touched])
    assert torch.equal(shard.tables[0].state["sum_sq"][~touched], st0["sum_sq"][~touched])
    assert not torch.equal(shard.tables[0].weight[touched], w0[touched])
    assert shard.stats()["rows_pushed"] == 3


def test_out_of_range_row_is_an_error_naming_the_table_and_nothing_is_applied():
    s, shard = _table_shard()
    lo, hi = s.range(1)
    params = shard.vectors["params"].clone()
    w = shard.tables[0].weight.clone()
    bad = np.array([1, shard.tables[0].num_rows], dtype=np.int64)  # the second: one past the shard's last row
    with pytest.raises(ValueError, match=r"table 'bags.1'.*out of range \[0, 300\)"):
        shard.push(0, np.ones(hi - lo, np.float32), lo, 0, 4, rows=[(bad, np.ones((2, 4), np.float32))])
    assert torch.equal(shard.vectors["params"], params) and torch.equal(shard.tables[0].weight, w)
    assert shard.version == 0


def test_non_finite_rows_reject_the_whole_push():
    s, shard = _table_shard()
    lo, hi = s.range(1)
    params = shard.vectors["params"].clone()
    g = np.full((1, 4), np.nan, dtype=np.float32)
    shard.push(0, np.ones(hi - lo, np.float32), lo, 0, 4, rows=[(np.array([2], dtype=np.int64), g)])
    assert shard.rejected_pushes == 1 and shard.version == 0
    assert torch.equal(shard.vectors["params"], params)


def test_fetch_rows_returns_the_shards_rows():
    _, shard = _table_shard()
    vals, version = shard.fetch_rows([np.array([0, 5, 177], dtype=np.int64)])
    assert np.array_equal(vals[0], shard.tables[0].weight_np[[0, 5, 177]]) and version == 0
    assert shard.stats()["rows_fetched"] == 3


# ---------------------------------------------------------------------------------------------- oracles
@pytest.mark.parametrize("model_fn", [TinyCTR, DeclaredCTR], ids=["hooks", "embedding_ids"])
@pytest.mark.parametrize("shards", [1, 2, 3])
def test_one_replica_equals_torch_sparse_adagrad(model_fn, shards):
    ds = ctr_data()
    res = run_downpour(model_fn, ds, shards=shards)
    ref = torch_reference(model_fn, ds, 25)
    # the same arithmetic as torch's sparse Adagrad, row by row: bit for bit
    assert torch.equal(res.flat_params, ref)
    st = res.summary
    assert st["updates_per_shard"] == [25] * shards


def test_dense_embedding_module_trains_as_its_sparse_twin():
    """``sparse=False`` in the user's module: the replica still pushes rows; the result is torch's sparse run
    (dense and sparse Adagrad differ only in rows with a zero gradient, which dense Adagrad leaves unchanged too)."""
    ds = ctr_data()
    res = run_downpour(lambda: TinyCTR(sparse=False), ds, shards=2)
    ref = torch_reference(TinyCTR, ds, 25)
    assert torch.equal(res.flat_params, ref)


def test_fetch_every_refreshes_rows_at_most_every_n_steps():
    """n_fetch = n_push = 4, alpha = 0: one server step with the sum of 4 gradients computed on the same
    parameters — the rows too (fetched once per window, never refreshed inside it)."""
    ds = ctr_data()
    res = run_downpour(TinyCTR, ds, shards=2, optimizer="sgd", lr=0.05, max_steps=8, fetch_every=4, push_every=4)
    torch.manual_seed(SEED)
    model = TinyCTR()
    batches = BatchSource(ds, replica_indices(len(ds), 1, 0, SEED), BATCH, seed=SEED * 7919)
    for _ in range(2):
        acc = [torch.zeros_like(p) for p in model.parameters()]
        for _ in range(4):
            model.zero_grad()
            x, y = batches.next_batch()
            F.cross_entropy(model(x), y).backward()
            for a, p in zip(acc, model.parameters()):
                a.add_(p.grad.to_dense() if p.grad.is_sparse else p.grad)
        with torch.no_grad():
            for a, p in zip(acc, model.parameters()):
                p.add_(a, alpha=-0.05)
    assert torch.equal(res.flat_params, flatten(model))
    assert res.summary["updates_per_shard"] == [2, 2]


def test_two_replicas_on_disjoint_rows_are_exact():
    """Two replicas whose minibatches touch disjoint rows of a table with no dense interaction: each row's final
    value is what its own replica's single-process run gives, whatever the interleaving."""
    class RowsOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Embedding(40, 3, sparse=True)
            self.b = nn.Parameter(torch.zeros(3), requires_grad=False)  # a dense part the shards can hold

        def forward(self, x):
            return self.e(x[:, 0].long()) + self.b

    n = 256
    ids = torch.zeros(n, dtype=torch.long)
    for rid in range(2):  # replica 0's examples use rows 0..19, replica 1's rows 20..39 (both tables' shards)
        idx = torch.as_tensor(list(replica_indices(n, 2, rid, SEED)))
        ids[idx] = 20 * rid + idx % 20
    y = (ids % 3).long()
    ds = TensorDataset(ids[:, None].float(), y)
    res = run_downpour(RowsOnly, ds, replicas=2, shards=2, optimizer="adagrad", max_steps=12, lr=0.1)
    got = res.model.e.weight.detach()
    torch.manual_seed(SEED)
    expect = RowsOnly().e.weight.detach().clone()
    touched = [set(range(20)), set(range(20, 40))]
    for rid in range(2):
        torch.manual_seed(SEED)
        m = RowsOnly()
        opt = torch.optim.Adagrad(m.parameters(), lr=0.1, eps=1e-10)
        batches = BatchSource(ds, replica_indices(n, 2, rid, SEED), BATCH, seed=SEED * 7919 + rid)
        for _ in range(12):
            x, yy = batches.next_batch()
            opt.zero_grad()
            F.cross_entropy(m(x), yy).backward()
            opt.step()
        rows = sorted(touched[rid])
        expect[rows] = m.e.weight.detach()[rows]
    assert torch.equal(got, expect)


# ---------------------------------------------------------------------------------------------- the rest of the system
def test_a_table_shard_comes_back_from_its_checkpoint_bit_for_bit(tmp_path):
    """Rows, their Adagrad state and the dense slice are in every checkpoint; a restored shard is the shard that
    wrote it."""
    from distbelief.ps.durability import Durability

    s, shard = _table_shard()
    shard.durability = Durability(str(tmp_path), every_updates=0, every_seconds=0, wal=False)
    lo, hi = s.range(1)
    rng = np.random.default_rng(0)
    for _ in range(5):
        ids = np.unique(rng.integers(0, shard.tables[0].num_rows, 20)).astype(np.int64)
        g = rng.standard_normal((ids.size, 4)).astype(np.float32)
        shard.push(0, rng.standard_normal(hi - lo).astype(np.float32), lo, shard.version, 8, rows=[(ids, g)])
    shard.checkpoint()
    back = ParameterShard.restore(1, lo, hi, shard.optimizer, s.total, shard.durability, write_base=False,
                                  tables=(s, None, None))
    assert back.version == 5 and torch.equal(back.vectors["params"], shard.vectors["params"])
    for a, b in zip(back.tables, shard.tables):
        assert torch.equal(a.weight, b.weight)
        assert a.state.keys() == b.state.keys() and all(torch.equal(a.state[k], b.state[k]) for k in a.state)


def test_a_killed_table_shard_restarts_from_its_snapshot_and_reports_what_it_lost(tmp_path):
    from distbelief.testing import Faults

    ds = ctr_data(n=1024)
    res = train(TinyCTR, ds, ds, quiet=True, runtime="inprocess", replicas=1, shards=2, batch_size=BATCH,
                max_steps=120, max_seconds=0, eval_every_seconds=3600, seed=SEED, durability="snapshot",
                checkpoint_every_seconds=0, checkpoint_every_updates=25, out=str(tmp_path / "run"),
                hooks=Faults(kill_shard_at_step=40, kill_shard_id=1))
    s = res.summary
    up = s["updates_per_shard"]
    assert s["shard_restarts"] == 1 and up[0] == 120
    assert s["updates_lost"] == up[0] - up[1] and 0 <= s["updates_lost"] < 40
    assert s["rows_pushed"] > 0 and s["table_rows"] == sum(ROWS)


@pytest.mark.parametrize("settings,field", [
    (dict(strategy="sandblaster"), "strategy"), (dict(partitions=2), "partitions"),
])
def test_what_tables_cannot_do_yet_is_refused_before_any_worker_starts(settings, field):
    ds = ctr_data(n=64)
    kw = dict(runtime="inprocess", replicas=1, shards=2, max_steps=2, max_seconds=0, quiet=True)
    kw.update(settings)
    with pytest.raises(ConfigError) as e:
        train(TinyCTR, ds, ds, **kw)
    assert e.value.field == field and "embedding tables" in str(e.value)


def test_an_out_of_range_id_is_an_error_naming_the_table_before_anything_is_sent():
    from distbelief.runtime.inprocess import InProcessRuntime

    s, shard = _table_shard(shard_id=0, num_shards=1)
    rt = InProcessRuntime()
    role = rt.create_shard(0, lambda: shard)
    client = rt.shard_client([role], s)
    with pytest.raises(ValueError, match=r"table 'bags.1' \(EmbeddingBag, 300 rows\): row id 300 is out of range"):
        client.push_async(np.zeros(s.total, np.float32), [0], 1,
                          rows=[(np.array([1, 357], dtype=np.int64), np.ones((2, 4), np.float32))])
    assert shard.version == 0 and shard.rows_pushed == 0
    with pytest.raises(ValueError, match="table 'e0'"):
        client.fetch_rows_async([np.array([-1], dtype=np.int64)])


@pytest.mark.parametrize("model_fn", [TinyCTR, DeclaredCTR], ids=["hooks", "embedding_ids"])
def test_a_replica_refuses_an_id_outside_its_table_naming_it(model_fn, capsys):
    """Id 7 of the 7-row table: a key inside the row group (bags.1's row 0), but no row of bags.0 — refused by
    the replica before anything is fetched or pushed, and the run says which table."""
    ds, test = ctr_data(n=64), ctr_data(n=64)
    ds.tensors[0][5, 3] = 7.0  # field 1 (bags.0) of example 5
    settings = dict(strategy="downpour", runtime="inprocess", replicas=1, shards=2, max_steps=8, batch_size=64,
                    max_seconds=0, eval_every_seconds=3600, durability="off", max_replica_restarts=0)
    res = train(model_fn, ds, test, **settings)
    out = capsys.readouterr()
    assert "table 'bags.0' (EmbeddingBag, 7 rows): row id 7 is out of range [0, 7)" in out.out + out.err
    assert res.summary["replicas_lost"] == 1 and res.summary["updates"] == 0  # nothing of it was applied


def test_the_summary_and_prometheus_count_rows_and_bytes_per_shard():
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    seen = []

    def scrape(evaluation):
        if evaluation.examples and not seen:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            seen.append(text)

    ds = ctr_data()
    res = run_downpour(TinyCTR, ds, max_steps=40, eval_every_seconds=0.01, metrics_port=port, callbacks=[scrape])
    s = res.summary
    # one replica, fetch and push every step: each shard serves and updates the rows its step touched
    assert s["rows_pushed"] > 0 and s["rows_fetched"] >= s["rows_pushed"]
    assert len(s["bytes_pushed_per_shard"]) == 2 and all(b > 0 for b in s["bytes_fetched_per_shard"])
    assert seen and 'distbelief_shard_bytes_pushed_total{shard="1"}' in seen[0]
    assert "distbelief_rows_pushed_total" in seen[0]


def test_ssp_with_tables_holds_replicas_within_the_bound():
    from distbelief.testing import Faults

    ds = ctr_data(n=1024)
    res = run_downpour(TinyCTR, ds, replicas=3, max_steps=30, consistency="ssp", staleness_bound=1,
                       optimizer="adagrad", hooks=Faults(straggler_id=1, straggler_slowdown=4))
    s = res.summary
    assert s["steps_per_replica"] == [30, 30, 30] and s["clock_gap_max"] <= 1
    assert s["updates"] == 3 * 30 * 2 and s["rows_pushed"] > 0


def test_elastic_replicas_with_tables():
    """--replicas 1:2 in one process (room for both from the start): each replica's table rows reach the
    shards like a fixed replica's."""
    ds = ctr_data(n=1024)
    res = run_downpour(TinyCTR, ds, replicas=1, max_replicas=2, max_steps=20)
    s = res.summary
    assert s["max_replicas"] == 2 and s["steps_per_replica"] == [20, 20]
    assert s["updates_per_shard"] == [40, 40] and s["rows_pushed"] > 0


def test_a_table_read_without_its_module_is_refused_unless_the_model_declares_its_ids(capsys):
    """``F.embedding(ids, self.e0.weight)`` bypasses the module's hook, so the replica cannot know which rows to
    fetch: the run says so, naming the table. With ``embedding_ids(x)`` declared, the rows are fetched before the
    forward, the dense gradient becomes its nonzero rows, and the run is torch's."""
    class Functional(TinyCTR):
        def forward(self, x):
            ids = self.ids(x)
            parts = [self.dense(x[:, :2]), F.embedding(ids[0], self.e0.weight)]
            parts += [bag(i[:, None]) for bag, i in zip(self.bags, ids[1:])]
            return self.top(torch.relu(torch.cat(parts, 1)))

    class Declared(Functional):
        def embedding_ids(self, x):
            return self.ids(x)

    ds = ctr_data()
    refused = run_downpour(Functional, ds, shards=2, optimizer="sgd", lr=0.05, max_steps=10, max_replica_restarts=0,
                           quiet=False)
    assert "table 'e0' (Embedding, 50 rows) was read without calling its module" in capsys.readouterr().err
    assert refused.summary["updates"] == 0
    res = run_downpour(Declared, ds, shards=2, optimizer="sgd", lr=0.05, max_steps=10)
    torch.manual_seed(SEED)
    model = Declared()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = BatchSource(ds, replica_indices(len(ds), 1, 0, SEED), BATCH, seed=SEED * 7919)
    for _ in range(10):
        x, y = batches.next_batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    # To float32 rounding, not bit for bit: e0's gradient reaches the server as rows (the nonzero rows of its
    # dense gradient) and is applied there by a row update, whose rounding differs from torch's dense step by up to
    # a few 1e-7.
    torch.testing.assert_close(res.flat_params, flatten(model), atol=1e-6, rtol=0)
