"""Shard durability modes end to end: ``snapshot`` (the default) loses exactly the updates since a shard's last
background snapshot and reports that number; ``log`` loses none; ``off`` keeps nothing on disk."""

import pytest

from distbelief import RunConfig
from distbelief.api import train, train_task
from distbelief.testing import Faults
from tests.conftest import make_odd_model


def kill_run(tmp_path, durability: str, hooks=None, **kw):
    """One replica, two shards, a fixed number of steps, shard 1 killed at step 40 (unless ``hooks`` says
    otherwise): deterministic enough that the run always reaches the kill, and every push goes to both shards (the
    odd model's tensors span them)."""
    settings = dict(runtime="inprocess", replicas=1, shards=2, batch_size=64, max_steps=400, max_seconds=0,
                    eval_every_seconds=3600, num_samples=2000,
                    durability=durability, checkpoint_every_seconds=0, out=str(tmp_path / durability))
    settings.update(kw)
    hooks = hooks or Faults(kill_shard_at_step=40, kill_shard_id=1)
    return train_task(RunConfig(**settings), quiet=True, hooks=hooks).summary


def kill_between_snapshots(every: int):
    """``(seen, probe)``: a probe (Faults.on_evaluation) that kills shard 1 while the replicas are held for an
    evaluation (no push in flight), once the shard's last snapshot is a periodic one (at least ``every`` updates
    in) and it applied fewer than ``every`` updates since, but some: no snapshot is due or being taken, so those
    updates are certainly lost. ``seen`` gets the shard's version and last snapshot's at the kill. Once the
    shard is restored, the probe ends the run."""
    seen = {}

    def probe(trainer, record):
        if trainer.stop_reason:  # the final evaluation
            return
        if not seen:
            st = trainer.server.stats()[1]
            if st["snapshot_version"] >= every and 0 < st["updates"] - st["snapshot_version"] < every:
                seen.update(updates=st["updates"], snapshot=st["snapshot_version"])
                trainer.kill_shard(1)
        elif any(e["event"] == "shard restored" for e in trainer.events):
            trainer.request_stop("shard killed and restored")

    return seen, probe


def test_snapshot_mode_reports_exactly_the_updates_it_lost(tmp_path):
    # A snapshot every 25 updates (in the background): shard 1 dies between two of them, with updates applied
    # since the last, and comes back from that snapshot. Shard 0 applied every push; shard 1 lacks exactly the
    # updates it had applied after its snapshot. (A step budget far beyond the kill: the probe ends the run.)
    seen, probe = kill_between_snapshots(25)
    s = kill_run(tmp_path, "snapshot", hooks=Faults(on_evaluation=probe), checkpoint_every_updates=25,
                 max_steps=10**6, eval_every_seconds=0.05, evaluation="paused")
    assert s["stop_reason"] == "shard killed and restored"
    up = s["updates_per_shard"]
    assert s["shard_restarts"] == 1 and up[0] == s["steps_per_replica"][0]
    # the loss happened, and is counted exactly: what the shard applied since the snapshot it came back from
    assert s["updates_lost"] == seen["updates"] - seen["snapshot"] > 0
    assert s["updates_lost"] == up[0] - up[1]
    # not everything since the start: a periodic snapshot (at update 25 or later) was used, not the base one
    assert seen["snapshot"] >= 25
    restored = next(e for e in s["events"] if e["event"] == "shard restored")
    assert restored["replayed_updates"] == 0 and restored["updates_lost"] == s["updates_lost"]


def test_snapshot_mode_with_only_the_base_snapshot_loses_everything_since_the_start(tmp_path):
    s = kill_run(tmp_path, "snapshot", checkpoint_every_updates=0)  # no periodic snapshot: only the base one
    killed = next(e for e in s["events"] if e["event"] == "shard killed")
    assert s["updates_lost"] == s["updates_per_shard"][0] - s["updates_per_shard"][1] >= killed["step"] >= 40


def test_log_mode_loses_nothing(tmp_path):
    s = kill_run(tmp_path, "log", checkpoint_every_updates=25)
    assert s["shard_restarts"] == 1 and s["updates_lost"] == 0
    assert s["updates_per_shard"] == [400, 400]
    assert list((tmp_path / "log" / "checkpoints" / "shard-001").glob("wal-*.log"))


def test_log_mode_recovery_is_bit_for_bit_the_undisturbed_run(tmp_path):
    """The exact oracle for shard recovery: one replica (a deterministic schedule), shard 1 killed at step 40 and
    rebuilt from its snapshot plus its log, the push that met the dead shard re-sent to the new one. The run ends
    with exactly the parameters of the same run without the kill."""
    import torch

    settings = dict(runtime="inprocess", replicas=1, shards=2, batch_size=64, max_steps=120, max_seconds=0,
                    eval_every_seconds=3600, num_samples=2000, durability="log", checkpoint_every_seconds=0,
                    checkpoint_every_updates=25)
    killed = train_task(RunConfig(**settings, out=str(tmp_path / "killed")), quiet=True,
                        hooks=Faults(kill_shard_at_step=40, kill_shard_id=1))
    undisturbed = train_task(RunConfig(**settings, out=str(tmp_path / "undisturbed")), quiet=True)
    assert killed.summary["shard_restarts"] == 1 and undisturbed.summary["shard_restarts"] == 0
    assert killed.summary["updates_lost"] == 0
    assert killed.summary["updates_per_shard"] == undisturbed.summary["updates_per_shard"] == [120, 120]
    assert torch.equal(killed.flat_params, undisturbed.flat_params)
    # the fault is not part of the run's configuration: a resume of this run directory injects nothing
    saved = (tmp_path / "killed" / "config.toml").read_text().splitlines()
    assert saved and not [line for line in saved if line.startswith("kill")]


@pytest.mark.parametrize("strategy", ["downpour", "sync"])
def test_replicate_mode_failover_is_bit_for_bit_the_undisturbed_run(tmp_path, strategy):
    """The exact oracle for failover: one replica, shard 1's primary killed at step 40; its backup, which applied
    every update the primary did in the same order, takes over and the push that met the dead primary is re-sent
    to it. Nothing touches the disk, and the run ends with exactly the parameters of the same run without the
    kill (and of a run with no durability at all)."""
    import torch

    settings = dict(runtime="inprocess", strategy=strategy, replicas=1, shards=2, batch_size=64, max_steps=120,
                    max_seconds=0, eval_every_seconds=3600, num_samples=2000)
    killed = train_task(RunConfig(**settings, durability="replicate", out=str(tmp_path / "killed")), quiet=True,
                        hooks=Faults(kill_shard_at_step=40, kill_shard_id=1))
    undisturbed = train_task(RunConfig(**settings, durability="off"), quiet=True)
    s = killed.summary
    assert s["shard_restarts"] == 1 and s["updates_lost"] == 0 and s["backups_replaced"] == 1
    assert [e["event"] for e in s["events"]] == ["shard killed", "shard failed over", "backup replaced"]
    assert s["updates_per_shard"] == undisturbed.summary["updates_per_shard"] == [120, 120]
    assert torch.equal(killed.flat_params, undisturbed.flat_params)
    assert not (tmp_path / "killed" / "checkpoints").exists()  # no disk


def test_replicate_mode_is_refused_where_it_cannot_work(tmp_path):
    from distbelief.exceptions import ConfigError

    with pytest.raises(ConfigError, match="durability"):
        RunConfig(strategy="sandblaster", durability="replicate").validate()
    train_task(RunConfig(runtime="inprocess", replicas=1, max_steps=5, max_seconds=0, durability="replicate",
                         out=str(tmp_path / "run")), quiet=True)
    with pytest.raises(ConfigError, match="resume.*--durability replicate"):
        train_task(RunConfig(runtime="inprocess", replicas=1, max_steps=5, max_seconds=0, durability="replicate",
                             out=str(tmp_path / "run")), quiet=True, resume=True)


def test_off_mode_writes_no_checkpoints_and_a_dead_shard_ends_the_run_with_a_clear_error(tmp_path):
    from distbelief.exceptions import RoleFailedError

    with pytest.raises(RoleFailedError, match="--durability"):
        kill_run(tmp_path, "off")
    assert not (tmp_path / "off" / "checkpoints").exists()


def test_snapshot_mode_is_the_default_and_writes_no_log(tmp_path, toy_data):
    assert RunConfig().durability == "snapshot"
    res = train(make_odd_model, toy_data[0], toy_data[1], quiet=True, runtime="inprocess", replicas=1, shards=2,
                max_steps=30, max_seconds=0, eval_every_seconds=3600, batch_size=8, checkpoint_every_updates=10,
                out=str(tmp_path / "run"))
    d = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in d.iterdir()) == ["shard-000", "shard-001"]
    assert not list(d.glob("*/wal-*.log"))
    ckpts = sorted(p.name for p in (d / "shard-000").glob("ckpt-*.safetensors"))
    assert ckpts[-1] == "ckpt-000000000030.safetensors"  # the final checkpoint holds the last update
    assert res.summary["updates_per_shard"] == [30, 30]


def test_old_run_configs_with_wal_still_load():
    from distbelief.config import config_from

    assert config_from({"wal": True}).durability == "log"
    assert config_from({"wal": False}).durability == "snapshot"
    assert config_from({"wal": False, "checkpoint_every_seconds": 0}).durability == "off"
    with pytest.raises(Exception, match="kill_shard_after_s: fault injection is test tooling"):
        config_from({"kill_shard_after_s": 3})


def test_bad_durability_names_the_flag():
    from distbelief import ConfigError

    with pytest.raises(ConfigError, match="durability"):
        RunConfig(durability="wal").validate()
    with pytest.raises(ConfigError, match="log_max_mb"):
        RunConfig(log_max_mb=0).validate()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_snapshot_mode_counts_exactly_with_colocated_updates_on_ray(tmp_path):
    """On Ray on one machine the replica applies its pushes to the shards' shared memory itself and is not blocked
    by the death of shard 1's process: it goes on updating the memory that process left until the restarted
    shard is installed. Those updates are lost with it, and still counted exactly: shard 0 applied every push,
    shard 1 lacks exactly ``updates_lost`` of them. Shard 1 dies between two snapshots with updates applied
    since the last, so the loss is certain: at least those (more when the replica's writes to the dead shard's
    memory went on after the kill, or the last snapshot's write died with the process)."""
    seen, probe = kill_between_snapshots(25)
    s = kill_run(tmp_path, "snapshot", hooks=Faults(on_evaluation=probe), runtime="ray",
                 checkpoint_every_updates=25, max_steps=10**6, eval_every_seconds=0.05, evaluation="paused")
    assert s["stop_reason"] == "shard killed and restored"
    up = s["updates_per_shard"]
    assert s["replicas_colocated"] == 1
    assert s["shard_restarts"] == 1 and up[0] == s["steps_per_replica"][0]
    assert s["updates_lost"] == up[0] - up[1] >= seen["updates"] - seen["snapshot"] > 0
    restored = next(e for e in s["events"] if e["event"] == "shard restored")
    assert restored["updates_lost"] == s["updates_lost"]


def test_replicate_mode_starts_the_spares_once_the_replicas_are_built(tmp_path):
    """Each shard's spare (a blank next backup, so that a failover costs a state copy and not a process start)
    is placed after the replicas are built: the replicas' processes, which the first step waits for, never
    queue behind processes that only a failover needs. The backups start with the shards."""
    from distbelief.runtime.inprocess import InProcessRuntime

    made = []

    class Recording(InProcessRuntime):
        def create_backup(self, shard_id, factory, away_from):
            made.append(("backup", shard_id))
            return super().create_backup(shard_id, factory, away_from)

        def create_replica(self, replica_id, factory, shards, layout, threads):
            made.append(("replica", replica_id))
            return super().create_replica(replica_id, factory, shards, layout, threads)

    spares = []
    cfg = RunConfig(runtime="inprocess", replicas=2, shards=2, batch_size=64, max_steps=20, max_seconds=0,
                    eval_every_seconds=3600, num_samples=500, durability="replicate", out=str(tmp_path / "run"))
    hooks = Faults(on_evaluation=lambda trainer, record: spares.append(list(trainer.server.spares)))
    train_task(cfg, quiet=True, runtime=Recording(), hooks=hooks)
    # the backups (with the shards), the replicas, then one spare per shard
    assert made == [("backup", 0), ("backup", 1), ("replica", 0), ("replica", 1), ("backup", 0), ("backup", 1)], made
    assert spares and all(s is not None for s in spares[-1])
