"""Shard recovery for a model with embedding tables, end to end in one process: with ``--durability log`` a
killed table shard comes back from its snapshot plus the log of every push's dense part and rows; with
``--durability replicate`` its backup, which applied every push's rows too, takes over. Either way one replica's
run ends bit for bit as the same run without the kill."""

import pytest
import torch

from distbelief.testing import Faults
from tests.unit.test_sparse_tables import TinyCTR, ctr_data, run_downpour

pytestmark = pytest.mark.timeout(180)

KILL = Faults(kill_shard_at_step=40, kill_shard_id=1)


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise-adagrad"])
def test_log_mode_recovery_of_a_table_shard_is_bit_for_bit_the_undisturbed_run(tmp_path, optimizer):
    """One replica (a deterministic schedule), shard 1 killed at step 40 and rebuilt from its base snapshot plus
    its log (every update it had: the driver's kill lands at step 40 or some steps later, so a periodic snapshot
    could coincide with it and leave nothing to replay; periodic snapshot + log is tests/unit/
    test_table_log_and_backup.py), the push that met the dead shard re-sent to the new one: the rows and their
    state are the undisturbed run's, bit for bit."""
    ds = ctr_data(n=1024)
    settings = {"max_steps": 90, "durability": "log", "checkpoint_every_seconds": 0,
                "checkpoint_every_updates": 10**6, "optimizer": optimizer}
    killed = run_downpour(TinyCTR, ds, **settings, out=str(tmp_path / "killed"), hooks=KILL)
    undisturbed = run_downpour(TinyCTR, ds, **settings, out=str(tmp_path / "undisturbed"))
    s = killed.summary
    assert s["shard_restarts"] == 1 and undisturbed.summary["shard_restarts"] == 0
    restored = next(e for e in s["events"] if e["event"] == "shard restored")
    assert s["updates_lost"] == 0 and restored["replayed_updates"] >= 40  # the log: every update since the base
    assert s["updates_per_shard"] == undisturbed.summary["updates_per_shard"] == [90, 90]
    assert s["rows_pushed"] > 0
    assert torch.equal(killed.flat_params, undisturbed.flat_params)


def test_replicate_mode_failover_of_a_table_shard_loses_no_update(tmp_path):
    """Shard 1's primary killed at step 40: its backup, which applied every push's rows in the primary's order,
    takes over; the run ends bit for bit as the same run without the kill, and without durability at all."""
    ds = ctr_data(n=1024)
    killed = run_downpour(TinyCTR, ds, max_steps=90, durability="replicate", out=str(tmp_path / "killed"),
                          hooks=KILL)
    undisturbed = run_downpour(TinyCTR, ds, max_steps=90, durability="off")
    s = killed.summary
    assert s["shard_restarts"] == 1 and s["updates_lost"] == 0 and s["backups_replaced"] == 1
    assert [e["event"] for e in s["events"]] == ["shard killed", "shard failed over", "backup replaced"]
    assert s["updates_per_shard"] == undisturbed.summary["updates_per_shard"] == [90, 90]
    assert torch.equal(killed.flat_params, undisturbed.flat_params)
    assert not (tmp_path / "killed" / "checkpoints").exists()  # no disk


def test_a_log_mode_table_run_resumes_from_its_logs(tmp_path):
    """The log is replayed on resume too: with the shards' final snapshots gone (a driver killed before it
    could ask for them), the resumed run rebuilds every update, rows included, from the base snapshots and the
    logs, and reshards them."""
    ds = ctr_data(n=1024)
    out = tmp_path / "run"
    first = run_downpour(TinyCTR, ds, max_steps=30, durability="log", checkpoint_every_seconds=0,
                         checkpoint_every_updates=0, out=str(out))
    for k in range(2):
        *_, final = sorted((out / "checkpoints" / f"shard-{k:03d}").glob("ckpt-*.safetensors"))
        assert final.name == "ckpt-000000000030.safetensors"
        final.unlink()
    again = run_downpour(TinyCTR, ds, max_steps=30, durability="log", out=str(out), shards=3, resume=True)
    assert again.summary["updates_per_shard"] == [30, 30, 30]
    assert torch.equal(again.flat_params, first.flat_params)
