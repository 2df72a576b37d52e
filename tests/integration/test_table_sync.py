"""Synchronous consistency (``--strategy sync``) for a model with embedding tables: each replica sends each shard
its dense range and its rows of the row-sparse gradient; the shard applies the mean of the step's gradients once.

The oracle is single-process torch doing synchronous data parallelism with sparse gradients: each replica's
minibatch gradient (its table gradients coalesced, as a replica pushes them), summed over the replicas and divided
by their number (torch's sparse ``+`` and ``/``: the union of the rows, a row one replica did not touch counting as
zero there), then one optimizer step. The runs agree with it bit for bit (``torch.equal``)."""

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
from distbelief.ps.sharding import flatten
from distbelief.testing import Faults
from tests.unit.test_sparse_tables import BATCH, ROWS, SEED, DeclaredCTR, TinyCTR, _table_shard, ctr_data

pytestmark = pytest.mark.timeout(240)


def run_sync(model_fn, ds, **kw):
    settings = {"strategy": "sync", "runtime": "inprocess", "replicas": 2, "shards": 2, "batch_size": BATCH,
                "max_seconds": 0, "eval_every_seconds": 3600, "seed": SEED, "optimizer": "adagrad", "lr": 0.05,
                "adagrad_eps": 1e-10, "max_steps": 15, "durability": "off", "quiet": True}
    settings.update(kw)
    return train(model_fn, ds, ds, **settings)


def sync_reference(model_fn, ds, steps, replicas=(0, 1), num_replicas=2, opt="adagrad", lr=0.05):
    """Single-process synchronous data parallelism: per step, replica r's minibatch gradient for each r in
    ``replicas`` (its data share of ``num_replicas``, drawn as the run's replica r draws it), averaged, one
    optimizer step. Dense Adagrad is torch's fused kernel (the shards' own), rows torch's sparse Adagrad."""
    torch.manual_seed(SEED)
    model = model_fn()
    tables = [m.weight for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    dense = [p for p in model.parameters() if all(p is not w for w in tables)]
    if opt == "adagrad":
        opts = [torch.optim.Adagrad(dense, lr=lr, eps=1e-10, fused=True), torch.optim.Adagrad(tables, lr=lr, eps=1e-10)]
    else:
        opts = [torch.optim.SGD(model.parameters(), lr=lr)]
    sources = [BatchSource(ds, replica_indices(len(ds), num_replicas, r, SEED), BATCH, seed=SEED * 7919 + r)
               for r in replicas]
    params = list(model.parameters())
    for _ in range(steps):
        grads = []
        for src in sources:
            x, y = src.next_batch()
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            grads.append([p.grad.coalesce() if p.grad.is_sparse else p.grad.clone() for p in params])
        for i, p in enumerate(params):
            total = grads[0][i]
            for g in grads[1:]:
                total = total + g[i]
            p.grad = total / len(grads)
        for o in opts:
            o.step()
    return flatten(model)


# ---------------------------------------------------------------------------------------------- the oracle
@pytest.mark.parametrize("model_fn", [TinyCTR, DeclaredCTR], ids=["hooks", "embedding_ids"])
@pytest.mark.parametrize("opt,shards", [("adagrad", 2), ("adagrad", 3), ("sgd", 2)])
def test_sync_with_tables_equals_torch_averaging_sparse_gradients(model_fn, opt, shards):
    ds = ctr_data()
    res = run_sync(model_fn, ds, optimizer=opt, shards=shards)
    ref = sync_reference(model_fn, ds, 15, opt=opt)
    assert torch.equal(res.flat_params, ref)  # the same arithmetic, op for op: bit for bit
    s = res.summary
    assert s["strategy"] == "sync" and s["updates_per_shard"] == [15] * shards and s["staleness_max"] == 0
    assert s["examples"] == 15 * 2 * BATCH and s["rows_pushed"] > 0 and s["table_rows"] == sum(ROWS)


def test_the_oracle_tells_the_mean_from_other_updates():
    """The oracle is sharp: one replica's gradients alone end elsewhere than the mean of two (and a run with one
    replica is that oracle too)."""
    ds = ctr_data()
    ref = sync_reference(TinyCTR, ds, 15)
    assert not torch.equal(ref, sync_reference(TinyCTR, ds, 15, replicas=(0,)))
    res = run_sync(TinyCTR, ds, replicas=1)
    assert torch.equal(res.flat_params, sync_reference(TinyCTR, ds, 15, replicas=(0,), num_replicas=1))


# ---------------------------------------------------------------------------------------------- the shard
def _parts(s, shard, *rows_per_replica, seed=0):
    """Full-length gradients for ``shard``: a random dense range (zeros elsewhere), and the given
    rows (``(local_ids, values)`` of row group 0) of each replica."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = s.range(shard.shard_id)
    out = []
    for rows in rows_per_replica:
        dense = torch.randn(hi - lo, generator=g).numpy()
        full = np.zeros(s.total, dtype=np.float32)
        full[lo:hi] = dense
        out.append((full, [rows]))
    return out


def _rows(ids, seed):
    g = torch.Generator().manual_seed(seed)
    return np.array(ids, dtype=np.int64), torch.randn(len(ids), 4, generator=g).numpy()


def test_apply_mean_averages_the_union_of_rows_and_leaves_every_other_row_bit_for_bit():
    s, shard = _table_shard("adagrad")
    tab = shard.tables[0]
    w0, st0 = tab.weight.clone(), tab.state["sum_sq"].clone()
    p0 = shard.vectors["params"].clone()
    a, b = _rows([0, 3, 7], 1), _rows([3, 9, 100], 2)  # row 3 in both, the others in one each
    ga, gb = _parts(s, shard, a, b)
    assert shard.apply_mean(ga, gb) == 1
    # the mean, by hand: each row's values summed over the replicas that sent it, divided by 2
    mean = torch.zeros_like(w0)
    for ids, vals in (a, b):
        mean[torch.from_numpy(ids)] += torch.from_numpy(vals)
    mean /= 2
    ids = torch.tensor([0, 3, 7, 9, 100])
    # torch's Adagrad on the dense mean changes exactly those rows (others have a zero gradient)
    ref_w = nn.Parameter(w0.clone())
    opt = torch.optim.Adagrad([ref_w], lr=0.1, eps=1e-10)
    ref_w.grad = mean
    opt.step()
    untouched = torch.ones(w0.shape[0], dtype=torch.bool)
    untouched[ids] = False
    assert torch.equal(tab.weight[untouched], w0[untouched])
    assert torch.equal(tab.state["sum_sq"][untouched], st0[untouched])
    torch.testing.assert_close(tab.weight, ref_w.detach(), atol=1e-7, rtol=0)
    torch.testing.assert_close(tab.state["sum_sq"], opt.state[ref_w]["sum"], atol=1e-7, rtol=0)
    assert not torch.equal(tab.weight[ids], w0[ids])
    # the dense range: the mean of the two ranges, one Adagrad step
    lo, hi = s.range(1)
    d = (torch.from_numpy(ga[0][lo:hi]) + torch.from_numpy(gb[0][lo:hi])) / 2
    want = p0.clone()
    make_rule("adagrad", lr=0.1).apply(want, d, {"sum_sq": torch.zeros_like(want)})
    assert torch.equal(shard.vectors["params"], want)
    st = shard.stats()
    assert st["rows_pushed"] == 6 and st["updates"] == 1 and st["rejected_pushes"] == 0


def test_a_bad_gradient_of_a_mean_is_refused_whole_and_the_mean_is_over_the_others():
    torch.manual_seed(0)
    s, clean = _table_shard("adagrad")
    good = _parts(s, clean, _rows([0, 3], 1), _rows([3, 9], 2))
    clean.apply_mean(*good)
    torch.manual_seed(0)  # the same initial shard
    _, shard = _table_shard("adagrad")
    nan = _rows([4], 3)
    nan[1][0, 1] = np.nan
    bad_id = (np.array([1, shard.tables[0].num_rows], dtype=np.int64), np.ones((2, 4), np.float32))
    bad = _parts(s, shard, nan, bad_id, seed=7)
    assert shard.apply_mean(good[0], bad[0], good[1], bad[1]) == 1
    assert shard.rejected_pushes == 2
    assert torch.equal(shard.tables[0].weight, clean.tables[0].weight)
    assert torch.equal(shard.tables[0].state["sum_sq"], clean.tables[0].state["sum_sq"])
    assert torch.equal(shard.vectors["params"], clean.vectors["params"])


# ---------------------------------------------------------------------------------------------- backups
def _disjoint_rows_data(n=768, replicas=3, own=(40, 50)):
    """ctr_data, except that table e0's ids of replica 2's examples lie in ``own`` (rows no other replica's
    examples use) and every other example's below it."""
    ds = ctr_data(n=n)
    x, y = ds.tensors
    x = x.clone()
    idx = torch.as_tensor(list(replica_indices(n, replicas, 2, SEED)))
    mine = torch.zeros(n, dtype=torch.bool)
    mine[idx] = True
    e0 = x[:, 2].long()
    x[:, 2] = torch.where(mine, own[0] + e0 % (own[1] - own[0]), e0 % own[0]).float()
    return TensorDataset(x, y)


def test_a_backup_replica_two_of_three_gradients_are_averaged_and_the_dropped_ones_rows_never_applied():
    """Replica 2 is a straggler (each step takes 12 times its compute): every step applies the mean of
    replicas 0 and 1, exactly, and the rows only replica 2's examples use (its gradients, all dropped) stay as
    they were initialised."""
    ds = _disjoint_rows_data()
    steps = 40
    res = run_sync(TinyCTR, ds, replicas=2, backup_replicas=1, max_steps=steps,
                   hooks=Faults(straggler_id=2, straggler_slowdown=12))
    s = res.summary
    assert s["backup_replicas"] == 1 and s["updates_per_shard"] == [steps, steps]
    assert s["examples"] == steps * 2 * BATCH and s["dropped_gradients"] > 0
    ref = sync_reference(TinyCTR, ds, steps, replicas=(0, 1), num_replicas=3)
    assert torch.equal(res.flat_params, ref)
    torch.manual_seed(SEED)
    init = TinyCTR().e0.weight.detach()
    assert torch.equal(res.model.e0.weight.detach()[40:], init[40:])  # replica 2's own rows: never applied
    assert not torch.equal(res.model.e0.weight.detach()[:40], init[:40])


# ---------------------------------------------------------------------------------------------- durability
KILL = Faults(kill_shard_at_step=40, kill_shard_id=1)


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise-adagrad"])
def test_log_mode_recovery_of_a_sync_table_shard_is_bit_for_bit_the_undisturbed_run(tmp_path, optimizer):
    """Shard 1 killed at step 40 (the replicas' steps together: the run's 20th) and rebuilt from its snapshot
    (every 8 updates) plus its log, whose records carry each mean's rows; the step that met the dead shard is
    applied to the new one. The rows and their state are the undisturbed run's, bit for bit."""
    ds = ctr_data(n=512)
    settings = {"max_steps": 30, "durability": "log", "checkpoint_every_seconds": 0, "checkpoint_every_updates": 8,
                "optimizer": optimizer}
    killed = run_sync(TinyCTR, ds, **settings, out=str(tmp_path / "killed"), hooks=KILL)
    undisturbed = run_sync(TinyCTR, ds, **settings, out=str(tmp_path / "undisturbed"))
    s = killed.summary
    assert s["shard_restarts"] == 1 and undisturbed.summary["shard_restarts"] == 0
    restored = next(e for e in s["events"] if e["event"] == "shard restored")
    assert s["updates_lost"] == 0 and restored["replayed_updates"] > 0  # the log, not only the snapshot
    assert s["updates_per_shard"] == undisturbed.summary["updates_per_shard"] == [30, 30]
    assert torch.equal(killed.flat_params, undisturbed.flat_params)


def test_replicate_mode_failover_of_a_sync_table_shard_loses_no_update(tmp_path):
    """Shard 1's primary killed at step 40: its backup, to which every mean was forwarded with its rows, takes
    over; the run ends bit for bit as the same run without the kill, and as the oracle."""
    ds = ctr_data(n=512)
    killed = run_sync(TinyCTR, ds, max_steps=30, durability="replicate", out=str(tmp_path / "killed"), hooks=KILL)
    s = killed.summary
    assert s["shard_restarts"] == 1 and s["updates_lost"] == 0 and s["backups_replaced"] == 1
    assert [e["event"] for e in s["events"]] == ["shard killed", "shard failed over", "backup replaced"]
    assert s["updates_per_shard"] == [30, 30]
    assert torch.equal(killed.flat_params, sync_reference(TinyCTR, ds, 30))
    assert not (tmp_path / "killed" / "checkpoints").exists()  # no disk


# ---------------------------------------------------------------------------------------------- configuration
def test_sync_is_allowed_for_tables_and_sandblaster_still_refused():
    ds = ctr_data(n=64)
    res = run_sync(TinyCTR, ds, consistency="sync", strategy="downpour", replicas=1, max_steps=2)
    assert res.summary["strategy"] == "sync" and res.summary["updates_per_shard"] == [2, 2]
    with pytest.raises(ConfigError) as e:
        train(TinyCTR, ds, ds, runtime="inprocess", strategy="sandblaster", replicas=1, shards=2, max_steps=2,
              max_seconds=0, quiet=True)
    assert e.value.field == "strategy" and "embedding tables" in str(e.value)


# ---------------------------------------------------------------------------------------------- Ray
@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_sync_with_tables_on_ray_is_bit_for_bit_the_in_process_run():
    """Every replica's parts travel as their own objects from its actor to each shard's; the shards apply the
    same means: the Ray run ends exactly where the in-process run (and the oracle) does."""
    ds = ctr_data()
    ref = run_sync(TinyCTR, ds)
    res = run_sync(TinyCTR, ds, runtime="ray")
    assert torch.equal(res.flat_params, ref.flat_params)
    assert torch.equal(ref.flat_params, sync_reference(TinyCTR, ds, 15))
    assert res.summary["updates_per_shard"] == [15, 15]
    assert res.summary["rows_pushed"] == ref.summary["rows_pushed"] > 0
