"""Resuming a run whose model has embedding tables, with the same or another number of shards: the dense part
moves by ranges, the rows and their optimizer state by their keys (key q to shard q % K', local index q // K')."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from distbelief.data.batches import BatchSource, replica_indices
from distbelief.ps.checkpoint import latest_good_checkpoint
from distbelief.ps.rules import make_rule
from distbelief.ps.sharding import flatten
from distbelief.ps.slicer import Slicer
from distbelief.resume import load_server_state
from tests.unit.test_sparse_tables import BATCH, ROWS, SEED, TinyCTR, ctr_data, run_downpour

pytestmark = pytest.mark.timeout(120)


def reference_with_restart(ds, first: int, more: int) -> torch.Tensor:
    """Single-process torch: ``first`` steps, then ``more`` steps with the optimizer state kept but the batches
    started over — what a resumed replica does (it draws its minibatches afresh, the server keeps its state)."""
    torch.manual_seed(SEED)
    model = TinyCTR()
    tables = [m.weight for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    dense = [p for p in model.parameters() if all(p is not w for w in tables)]
    opts = (torch.optim.Adagrad(dense, lr=0.05, eps=1e-10, fused=True),
            torch.optim.Adagrad(tables, lr=0.05, eps=1e-10))
    for steps in (first, more):
        batches = BatchSource(ds, replica_indices(len(ds), 1, 0, SEED), BATCH, seed=SEED * 7919)
        for _ in range(steps):
            x, y = batches.next_batch()
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            for o in opts:
                o.step()
    return flatten(model)


@pytest.mark.parametrize("shards_after", [2, 3])
def test_a_resumed_run_is_the_run_that_went_on(tmp_path, shards_after):
    """The exact oracle: 12 steps on 2 shards, stopped, resumed for 10 more on ``shards_after`` shards, equals
    torch's sparse Adagrad run for 12 + 10 steps with its state carried over, bit for bit."""
    ds = ctr_data()
    out = str(tmp_path / "run")
    first = run_downpour(TinyCTR, ds, max_steps=12, durability="snapshot", out=out)
    assert first.summary["updates_per_shard"] == [12, 12]
    again = run_downpour(TinyCTR, ds, max_steps=22, durability="snapshot", out=out, shards=shards_after,
                         resume=True)
    assert again.summary["steps_per_replica"] == [22] and again.summary["updates_per_shard"] == [22] * shards_after
    assert torch.equal(again.flat_params, reference_with_restart(ds, 12, 10))


def gathered(ckpt_root, num_shards: int) -> dict[str, np.ndarray]:
    """Row group 0's arrays (rows and row state) in key order, read straight from the shards' checkpoint files:
    shard k's local row i is key i * K + k."""
    parts = [latest_good_checkpoint(ckpt_root, k).tensors for k in range(num_shards)]
    names = [n for n in parts[0] if n.startswith("table.0.")]
    out = {}
    for name in names:
        local = [p[name].numpy() for p in parts]
        whole = np.empty((sum(a.shape[0] for a in local), *local[0].shape[1:]), dtype=np.float32)
        for k, a in enumerate(local):
            whole[k::num_shards] = a
        out[name] = whole
    return out


@pytest.mark.parametrize("rule,state_name", [("adagrad", "sum_sq"), ("rowwise-adagrad", "row_sum_sq")])
def test_resharding_moves_every_row_and_its_state_to_its_new_shard(tmp_path, rule, state_name):
    """A checkpoint of 2 shards resumed on 3: the full parameters, and every row's optimizer state (per element
    for adagrad, per row for rowwise-adagrad), are those of the 2 shards bit for bit — each row now on shard
    key % 3 at local index key // 3."""
    ds = ctr_data()
    out = tmp_path / "run"
    first = run_downpour(TinyCTR, ds, max_steps=15, durability="snapshot", optimizer=rule, out=str(out))
    saved = load_file(str(out / "params.safetensors"))["flat_params"]
    assert torch.equal(first.flat_params, saved)
    before = gathered(out / "checkpoints", 2)
    name = f"table.0.opt.{state_name}"
    assert name in before and before[name].shape[0] == sum(ROWS)
    assert np.count_nonzero(before[name]) > 0  # some rows were trained, their state is not the initial one

    # load_server_state gathers the same arrays and deals them out to 3 shards by key
    slicer3 = Slicer.for_model(TinyCTR(), 3)
    state = load_server_state(out / "checkpoints", slicer3.total, make_rule(rule, lr=0.05), slicer=slicer3)
    assert np.array_equal(state.tables[0]["weight"], before["table.0.weight"])
    assert np.array_equal(state.tables[0][f"opt.{state_name}"], before[name])
    for j in range(3):
        rows, row_state = state.rows_for(j, 3)
        assert np.array_equal(rows[0], before["table.0.weight"][j::3])
        assert np.array_equal(row_state[0][state_name], before[name][j::3])

    # the resumed run (no step left to do) holds exactly that on its 3 shards, and the same full parameters
    again = run_downpour(TinyCTR, ds, max_steps=15, durability="snapshot", optimizer=rule, out=str(out), shards=3,
                         resume=True)
    assert again.summary["updates_per_shard"] == [15, 15, 15]
    assert torch.equal(again.flat_params, saved)
    after = gathered(out / "checkpoints", 3)
    assert after.keys() == before.keys()
    for n in before:
        assert np.array_equal(after[n], before[n]), n


def test_a_checkpoint_of_other_tables_is_refused_naming_them(tmp_path):
    class OtherRows(TinyCTR):  # the same dense part; its last table has one row more
        def __init__(self):
            super().__init__()
            self.bags[1] = nn.EmbeddingBag(ROWS[2] + 1, 4, mode="sum", sparse=True)

    ds = ctr_data()
    out = str(tmp_path / "run")
    run_downpour(TinyCTR, ds, max_steps=3, durability="snapshot", out=out)
    with pytest.raises(ValueError, match="embedding tables of other shapes.*resume with the same model"):
        run_downpour(OtherRows, ds, max_steps=6, durability="snapshot", out=out, resume=True)
    # a checkpoint without the layout checksum (written before it existed) is still checked by its row counts
    slicer = Slicer.for_model(OtherRows(), 2)
    with pytest.raises(ValueError, match="rows of width 4 for row group 0.*need 179 rows"):
        from distbelief.ps.durability import checkpointed_rows

        ck = latest_good_checkpoint(tmp_path / "run" / "checkpoints", 1)
        checkpointed_rows(ck.tensors, {k: v for k, v in ck.meta.items() if k != "table_layout"}, slicer, 1)
