"""The run's parameter shards, from the driver's side: start them (fresh, or from a resumed run's checkpoints),
read them, checkpoint them, and restart one whose process died — from its checkpoint and, with
``--durability log``, its write-ahead log — while the replicas keep training. With ``--durability replicate``
each shard has a backup in another process (ps/replication.py): a dead shard's backup takes its place, and a new
backup is made for it.
"""

from __future__ import annotations

import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from distbelief.exceptions import RemoteTimeoutError, RoleFailedError
from distbelief.ps.shard import Durability, ParameterShard
from distbelief.ps.sharding import ShardLayout
from distbelief.ps.slicer import Slicer
from distbelief.resume import drop_retired
from distbelief.runtime.base import Role, Runtime


def durability_for(cfg) -> tuple[Durability | None, tempfile.TemporaryDirectory | None]:
    """The shards' durability settings for ``cfg`` (None with ``--durability off`` or ``replicate``: no disk), and
    the temporary directory that holds the checkpoints of a run without a run directory (kept alive by the
    caller)."""
    if cfg.durability in ("off", "replicate"):
        return None, None
    tmp = None
    if cfg.out:
        root = Path(cfg.out) / "checkpoints"
    else:
        tmp = tempfile.TemporaryDirectory(prefix="distbelief-ckpt-")
        root = Path(tmp.name)
    return Durability(str(root.resolve()), every_updates=cfg.checkpoint_every_updates,
                      every_seconds=cfg.checkpoint_every_seconds, wal=cfg.durability == "log",
                      log_max_bytes=int(cfg.log_max_mb * 2**20)), tmp


class ServerShards:
    """The K parameter shards of one run and the driver's client to them.

    Args:
        init: the initial flat parameters (a restarted shard with no checkpoint yet starts from its range of it).
        server_state: a resumed run's shard state (``resume.load_server_state``), or None for a fresh start.
        hand_over: ``hand_over(shard_id, handle) -> acked`` points every running replica at a restarted shard and
            returns the highest version of the dead one any replica saw acknowledged (to count updates lost).
        on_event: ``on_event(record)`` for each restored shard (the trainer adds the training-clock time).
        slicer: the model's ``Slicer`` when it has embedding tables (their rows are then held row-sharded, and
            ``layout`` is the slicer: dense ranges over the dense part, see ps/slicer.py); None for a dense model.
    """

    def __init__(self, cfg, runtime: Runtime, log: Callable[[str], None], optimizer, init: torch.Tensor,
                 durability: Durability | None, server_state, hand_over: Callable[[int, object], int],
                 on_event: Callable[[dict], None], prev: dict, slicer: Slicer | None = None):
        self.cfg, self.runtime, self.log = cfg, runtime, log
        self.optimizer, self.init, self.durability = optimizer, init, durability
        self.hand_over, self.on_event = hand_over, on_event
        self.timeout_s = cfg.remote_timeout_s
        self.total = init.numel()  # the whole model, tables included
        self.tabled = slicer is not None and slicer.has_tables
        self.layout = slicer if self.tabled else ShardLayout.balanced(self.total, cfg.shards)
        # what the shards' dense ranges index: the dense part of a model with tables, else the whole vector
        self.dense_init = self.layout.to_dense(init) if self.tabled else init
        self.roles: list[Role] = []
        for k in range(cfg.shards):
            lo, hi = self.layout.range(k)
            if server_state is not None:  # a resumed run: its dense range, and its rows by their keys
                values, opt_state, counters = server_state.slice_for(lo, hi)
                tables = (self.layout, *server_state.rows_for(k, cfg.shards)) if self.tabled else None
                factory = partial(ParameterShard, k, lo, hi, values.numpy(), optimizer, self.layout.total,
                                  durability, {n: v.numpy() for n, v in opt_state.items()}, counters, tables=tables)
            elif self.tabled:
                factory = partial(ParameterShard, k, lo, hi, self.dense_init[lo:hi].numpy(), optimizer,
                                  self.layout.total, durability, tables=self._tables_arg(k))
            else:
                factory = partial(ParameterShard, k, lo, hi, init[lo:hi].numpy(), optimizer, self.total,
                                  durability)
            self.roles.append(runtime.create_shard(k, factory))
        self.client = runtime.shard_client(self.roles, self.layout)
        # --durability replicate: each shard's backup (None while it has none: before wait_ready, or after one died)
        self.replicate = cfg.durability == "replicate"
        self.backups: list[Role | None] = [None] * cfg.shards
        self.spares: list[Role | None] = [None] * cfg.shards  # a started, blank next backup for each shard
        self._starting: dict[int, Role] = {}  # backups placed with the shards, attached once both are up
        # Backups are placed now, so that their processes start with the shards'. The spares are not: the
        # trainer places them once its replicas are built (place_spares), so that the replicas' processes, which
        # the first step waits for, do not queue behind processes that only a failover needs.
        if self.replicate:
            for k in range(cfg.shards):
                self._starting[k] = runtime.create_backup(k, self._blank(k), away_from=self.roles[k])
        self.backups_replaced = 0
        self.restarts = prev.get("shard_restarts", 0)
        self.updates_lost = prev.get("updates_lost", 0)
        self.recovery_s: list[float] = []
        self._restarts_by_id = [0] * cfg.shards

    def wait_ready(self, retired) -> None:
        """Wait for every shard to be up, then write a base checkpoint per shard (its range and state are on disk
        before any push: a resume needs them) and drop a resumed run's retired checkpoints."""
        for s in self.roles:
            self.runtime.call(s, "stats").result(max(self.timeout_s, 180.0))
        if self.replicate:
            self._attach_backups(range(len(self.roles)), placed=self._starting, spares=False)
            self._starting = {}
        self.checkpoint()
        drop_retired(retired)

    def _tables_arg(self, k: int) -> tuple | None:
        """Shard ``k``'s ``tables`` argument: its rows of the initial parameters (a restarted shard without a
        checkpoint starts from them too)."""
        if not self.tabled:
            return None
        return self.layout, self.layout.shard_rows(self.init, k), None

    def _blank(self, k: int) -> Callable:
        lo, hi = self.layout.range(k)
        if self.tabled:  # the dense range of the dense part, and the keys of the rows
            return partial(ParameterShard.blank, k, lo, hi, self.optimizer, self.layout.total, self.layout)
        return partial(ParameterShard.blank, k, lo, hi, self.optimizer, self.total)

    def _attach_backups(self, ids, placed: dict[int, Role] | None = None, spares: bool = True) -> None:
        """Give shards ``ids`` a new backup each: ``placed[k]`` when given, else its spare when there is one away
        from the shard's node, else a new process (placed together, then awaited). Each receives its primary's
        whole state in the same call that starts the forwarding, so it misses no update. Then (``spares``) each
        of them without a spare places one for next time."""
        placed = dict(placed or {})
        for k in ids:
            if k in placed:
                continue
            spare, self.spares[k] = self.spares[k], None
            if spare is not None and not self.runtime.avoidably_together(spare, self.roles[k]):
                placed[k] = spare
                continue
            if spare is not None:  # on the primary's node while another could take it: no use against losing it
                self.runtime.kill(spare)
            placed[k] = self.runtime.create_backup(k, self._blank(k), away_from=self.roles[k])
        for k, role in placed.items():
            try:
                self.runtime.call(role, "stats").result(max(self.timeout_s, 180.0))
            except RoleFailedError as e:  # a spare gone with its node: start one more
                self.log(f"parameter shard {k}: its spare backup died ({e}); starting a new one")
                role = self.runtime.create_backup(k, self._blank(k), away_from=self.roles[k])
                self.runtime.call(role, "stats").result(max(self.timeout_s, 180.0))
            self.runtime.call(self.roles[k], "attach_backup", self.runtime.backup_link(role)).result(self.timeout_s)
            self.backups[k] = role
        if spares:
            self.place_spares(placed)

    def place_spares(self, ids=None) -> None:
        """A spare for each shard of ``ids`` (all by default) that has a backup and no spare: a blank next
        backup, started now and so ready long before it is needed (a failover then costs a state copy, not a
        process start). Away from the backup's node, which is where the primary will be after a failover."""
        for k in range(len(self.roles)) if ids is None else ids:
            if self.replicate and self.backups[k] is not None and self.spares[k] is None:
                self.spares[k] = self.runtime.create_backup(k, self._blank(k), away_from=self.backups[k])

    def _replace_backup(self, k: int, why: str) -> None:
        """Shard ``k`` lost its backup (``why``): drop what is left of it and give the shard a new one."""
        t0 = time.monotonic()
        old, self.backups[k] = self.backups[k], None
        if old is not None:
            try:
                self.runtime.kill(old)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.log(f"parameter shard {k}: {why}; copying it to a new backup")
        try:
            self._attach_backups([k])
        except (RoleFailedError, RemoteTimeoutError) as e:  # the shard goes on alone; the next check tries again
            self.log(f"parameter shard {k}: could not make a new backup ({e}); trying again")
            return
        self.backups_replaced += 1
        self.on_event({"event": "backup replaced", "id": k, "copy_s": round(time.monotonic() - t0, 3)})

    def check(self) -> None:
        """Restart any shard whose process died (from its checkpoint + log, or its backup), while the replicas keep
        going; with ``--durability replicate``, give a new backup to any shard that lost its own — after every
        dead shard is served again, so that one shard's new backup never delays another's failover."""
        futs = [(k, self.runtime.call(s, "stats")) for k, s in enumerate(self.roles)]
        backups = [(k, b, self.runtime.call(b, "stats")) for k, b in enumerate(self.backups) if b is not None]
        orphans: dict[int, str] = {}  # shard -> why it needs a new backup
        for k, f in futs:
            try:
                st = f.result(self.timeout_s)
            except RoleFailedError as e:
                self._bring_back(k, e)
                if self.replicate:
                    orphans[k] = "it has no backup now"
                continue
            if self.replicate and not st.get("has_backup"):
                orphans[k] = "a push to its backup failed" if self.backups[k] else "it has no backup"
        for k, b, f in backups:
            if self.backups[k] is not b or k in orphans:  # promoted above, or replaced below anyway
                continue
            try:
                f.result(self.timeout_s)
            except RoleFailedError as e:
                orphans[k] = f"its backup died ({e})"
        for k, why in orphans.items():
            self._replace_backup(k, why)

    def restart(self, k: int, err: Exception) -> dict:
        """Bring dead shard ``k`` back (its backup, or a new process from its checkpoint); its stats after."""
        st = self._bring_back(k, err)
        if self.replicate:
            self._replace_backup(k, "it has no backup now")
        return st

    def _bring_back(self, k: int, err: Exception) -> dict:
        if self.replicate:
            return self._fail_over(k, err)
        if self.durability is None:
            raise RoleFailedError(f"parameter shard {k} died ({err}) and --durability is off: its parameters are "
                                  f"lost (use --durability snapshot or log to survive this)") from err
        t0 = self._retire(k, err, "restarts", "restarting it from its checkpoint")
        lo, hi = self.layout.range(k)
        role = self.runtime.create_shard(k, partial(
            ParameterShard.restore, k, lo, hi, self.optimizer, self.layout.total, self.durability,
            self.dense_init[lo:hi].numpy(), tables=self._tables_arg(k)))
        st = self.runtime.call(role, "stats").result(max(self.timeout_s, 180.0))
        lost = self._install(k, role, st, t0)
        self.on_event({"event": "shard restored", "id": k, "updates_lost": lost,
                       "replayed_updates": st["replayed_updates"]})
        for msg in st.get("corrupt_checkpoints") or []:
            self.log(f"parameter shard {k}: skipped a damaged checkpoint: {msg}")
        self.log(f"parameter shard {k} restored at version {st['updates']} (checkpoint "
                 f"{st['restored_from_version']} + {st['replayed_updates']} logged updates) in "
                 f"{self.recovery_s[-1]:.2f}s; updates lost: {lost}")
        return st

    def _retire(self, k: int, err: Exception, what: str, then: str) -> float:
        """Shard ``k``'s process died (``err``): refuse past max_shard_restarts, else say what comes next and
        make sure the process is gone. Returns when this recovery started (monotonic seconds)."""
        if self._restarts_by_id[k] >= self.cfg.max_shard_restarts:
            raise RoleFailedError(f"parameter shard {k} died again after {self.cfg.max_shard_restarts} {what} "
                                  f"(max_shard_restarts)") from err
        t0 = time.monotonic()
        self.log(f"parameter shard {k} died ({err}); {then}")
        try:
            self.runtime.kill(self.roles[k])
        except Exception:  # noqa: BLE001 - already gone
            pass
        return t0

    def _install(self, k: int, role: Role, st: dict, t0: float) -> int:
        """Make ``role`` (at ``st``) shard ``k`` for the driver and every replica; count the recovery that began
        at ``t0``. Returns the updates lost: the highest version of the dead shard any replica saw acknowledged
        (replicas with co-located updates were not blocked on the dead shard's process and may have applied more
        to its memory until now), less the new shard's."""
        self.roles[k] = role
        self.client.replace_shard(k, role.handle)
        lost = max(0, self.hand_over(k, role.handle) - st["updates"])
        self._restarts_by_id[k] += 1
        self.restarts += 1
        self.updates_lost += lost
        self.recovery_s.append(time.monotonic() - t0)
        return lost

    def _fail_over(self, k: int, err: Exception) -> dict:
        """``--durability replicate``: shard ``k``'s backup takes its place, with every update the dead one
        acknowledged; the replicas re-send the rest (each push at most once: ps/replication.py). The caller then
        gives the shard a new backup."""
        backup = self.backups[k]
        if backup is None:
            raise RoleFailedError(f"parameter shard {k} died ({err}) while it had no backup (its last one had "
                                  f"failed and was not replaced yet): its parameters are lost") from err
        t0 = self._retire(k, err, "failovers", "its backup takes over")
        self.backups[k] = None
        try:
            st = self.runtime.call(backup, "stats").result(self.timeout_s)
        except RoleFailedError as e:
            raise RoleFailedError(f"parameter shard {k} died ({err}) and so did its backup ({e}): its parameters "
                                  f"are lost") from e
        lost = self._install(k, backup, st, t0)
        failover_s = self.recovery_s[-1]
        self.on_event({"event": "shard failed over", "id": k, "updates_lost": lost, "version": st["updates"],
                       "failover_s": round(failover_s, 3)})
        self.log(f"parameter shard {k}: its backup took over at version {st['updates']} in {failover_s:.2f}s; "
                 f"updates lost: {lost}")
        return st

    def read(self, fn):
        """Run a driver-side read of the shards; if a shard turns out dead, restart it and read again."""
        for attempt in range(self.cfg.max_shard_restarts + 1):
            try:
                return fn()
            except RoleFailedError:
                if attempt == self.cfg.max_shard_restarts:
                    raise
                self.check()

    def params(self) -> torch.Tensor:
        """The server's flat parameters (a copy)."""
        parts, _ = self.client.fetch_async().result(self.timeout_s)
        flat = torch.empty(self.layout.total, dtype=torch.float32)
        out = flat.numpy()
        for lo, values in parts:
            out[lo : lo + len(values)] = values  # numpy copy: the values may be a read-only view of Ray's store
        if not self.tabled:
            return flat
        n_groups = len(self.layout.groups)
        futs = [[self.runtime.call(s, "read_table", g) for g in range(n_groups)] for s in self.roles]
        rows = [[f.result(self.timeout_s) for f in per_shard] for per_shard in futs]
        return self.layout.assemble(flat, rows)

    def stats(self) -> list[dict]:
        futs = [self.runtime.call(s, "stats") for s in self.roles]
        return [f.result(self.timeout_s) for f in futs]

    def checkpoint(self) -> None:
        """Ask every shard to write a checkpoint now (start and end of a run, Ctrl-C)."""
        if self.durability is None:
            return
        futs = [self.runtime.call(s, "checkpoint") for s in self.roles]
        for f in futs:
            f.result(self.timeout_s)

    def kill(self, k: int) -> None:
        """Fault injection: shard ``k``'s process dies."""
        self.runtime.kill(self.roles[k])


def staleness(stats: list[dict]) -> tuple[float, int]:
    """``(mean, max)`` staleness over every push the shards applied."""
    count = sum(s["staleness_count"] for s in stats)
    return (sum(s["staleness_sum"] for s in stats) / count if count else 0.0,
            max(s["staleness_max"] for s in stats))
