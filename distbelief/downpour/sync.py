"""Synchronous data parallelism over Downpour's shards and replicas (the baseline the paper's asynchronous
Downpour is compared with): every step, each live replica computes one minibatch gradient from the current
parameters, each shard applies the mean of the replicas' gradients for its range, and the next step begins.

The driver never holds a gradient: each replica's gradient goes to the shards split by range
(``Runtime.call_split``), the driver waits on small summaries only. Failed replicas are restarted by the same
supervisor as Downpour's and rejoin at the next step.
"""

from __future__ import annotations

import time

from distbelief.downpour.trainer import ParameterServerTrainer
from distbelief.exceptions import DistBeliefError, RemoteTimeoutError, RoleFailedError
from distbelief.metrics import Clock
from distbelief.runtime.base import Future


# Seconds between the driver's checks of the shards' health (a call to each): every step, they held up every
# lockstep step by a round trip (about 4 % of a Fig. 4 step on two cores).
SHARD_CHECK_S = 0.5


class SyncTrainer(ParameterServerTrainer):
    """Runs ``sync`` over a Runtime. One instance per run.

    With ``backup_replicas = b`` it starts ``replicas + b`` replicas (TF1's backup workers): each step applies the
    mean of the first ``replicas`` gradients computed from that step's parameters; the rest are dropped
    (``dropped_gradients``). A replica still computing when its step is applied is not called again until it
    answers, so a straggler never holds a step up while enough others are live."""

    asynchronous = False

    def _run_steps(self) -> int:
        return sum(st.steps for st in self.replicas.values())  # set by the loop at every step: nothing to poll

    def _examples_trained(self, stats: list[dict]) -> int:
        return self.examples_sync  # the driver counts the gradients it applied

    def _data_plane_summary(self, latest: list[dict]) -> dict:
        return dict(backup_replicas=self.cfg.backup_replicas, dropped_gradients=self.dropped_gradients)

    def train(self) -> None:
        cfg = self.cfg
        self._wait_shards_ready()
        # each shard's version after the last step applied: a step is re-applied to a restarted shard only if it
        # lacks it (a backup, or a log replay, may hold it already)
        self._versions = [st["updates"] for st in self.server.stats()]
        started = cfg.replicas_started
        backups = f" (+{cfg.backup_replicas} backup)" if cfg.backup_replicas else ""
        self.rec.log(f"starting {cfg.replicas}{backups} synchronous replicas x {cfg.shards} shards on the "
                     f"{self.runtime.name} runtime ({self.total:,} parameters)")
        self._start_replicas(started)
        self.clock = Clock(offset_s=self.prev.get("wall_s", 0.0))
        next_eval = self.clock.elapsed() + cfg.eval_every_seconds
        step = max([st.steps for st in self.replicas.values()] + [0])
        # replica -> (its sync_step call, the step it is for, when it was made)
        self._calls: dict[int, tuple[Future, int, float]] = {}
        next_check = 0.0
        while not (cfg.max_steps and step >= cfg.max_steps):
            self._restart_due()
            live = [rid for rid, st in self.replicas.items() if st.running]
            if not live:
                if any(st.alive for st in self.replicas.values()):  # all waiting out their restart backoff
                    time.sleep(min(0.5, self.supervisor.until_next()))
                    continue
                raise DistBeliefError("every replica failed and none could be restarted")
            grads = self._gather(step, live)
            self._call_hooks()
            if time.monotonic() >= next_check:  # (a shard that died meanwhile fails _apply, which restores it)
                self._check_shards()
                next_check = time.monotonic() + SHARD_CHECK_S
            if grads:
                self._apply(grads)
                self.examples_sync += cfg.batch_size * len(grads)
                step += 1
                for st in self.replicas.values():
                    st.steps = step
            if self.clock.elapsed() >= next_eval:
                t0 = time.monotonic()
                self.clock.pause()  # synchronous training stops while we evaluate: don't count it
                self.evaluate_now()
                self.clock.resume()
                self._last_eval_s = time.monotonic() - t0
                next_eval = self.clock.elapsed() + self._eval_interval()
            if self._should_stop():
                break
        for st in self.replicas.values():
            st.steps = step

    def _gather(self, step: int, live: list[int]) -> list:
        """The first ``replicas`` gradients of step ``step`` (fewer when fewer replicas are live).

        Each replica returns its gradient split by shard; the driver waits for the small summaries only, and shard
        k receives part k of every gradient straight from the replicas (Runtime.call_split). A replica that
        answers with a gradient of an earlier step is counted in ``dropped_gradients`` and called again at once."""
        calls = self._calls

        def call(rid: int) -> None:
            calls[rid] = (self.runtime.call_split(self.replicas[rid].role, "sync_step", self.cfg.shards), step,
                          time.monotonic())

        for rid in live:
            if rid not in calls:
                call(rid)
        grads: list = []  # (replica id, its call)
        while True:
            # Done with R gradients, or when no call is left (fewer than R replicas live). A call still busy with
            # an older step is waited for: its answer is dropped and the replica called again for this one.
            # In replica order, whatever order they came in: every shard sums them in the same order each run.
            if len(grads) >= self.cfg.replicas or not calls:
                return [f for _, f in sorted(grads, key=lambda item: item[0])]
            now = time.monotonic()
            for rid, (_, _, t) in list(calls.items()):  # no answer within remote_timeout_s: failed
                if now - t > self.timeout_s:
                    self._handle_failure(rid, RemoteTimeoutError(
                        f"replica {rid} did not answer within {self.timeout_s:.0f}s (remote_timeout_s)"))
            if not calls:
                continue
            oldest = min(t for _, _, t in calls.values())
            wait = max(0.01, min(0.5, oldest + self.timeout_s - now))
            # Only answers that are in (the runtimes' wait_any returns those): taking a call still running would
            # wait on it, a straggler included, and drop the quick backup's answer instead of the straggler's.
            done = set(self.runtime.wait_any([f for f, _, _ in calls.values()], wait))
            for rid, (f, s, _) in list(calls.items()):
                if f not in done:
                    continue
                del calls[rid]
                try:
                    f.result(self.timeout_s)  # raises here if the replica died or failed: its parts are unusable
                except (RoleFailedError, RemoteTimeoutError) as e:
                    self._handle_failure(rid, e)
                    continue
                if s == step and len(grads) < self.cfg.replicas:
                    grads.append((rid, f))
                else:  # computed from older parameters, or one more than the step needs
                    self.dropped_gradients += 1
                    self.dropped_by_replica[rid] = self.dropped_by_replica.get(rid, 0) + 1
                    if s != step and self.replicas[rid].running:  # called again for this step
                        call(rid)

    def _apply(self, grads: list) -> None:
        """Every shard applies the mean of ``grads`` for its range (and, with embedding tables, its rows), all
        shards at once."""
        def apply_on(k: int) -> Future:
            parts = [g.part(k) for g in grads]
            # each part covers the shard's dense range: applied where it lies in the whole vector
            return self.runtime.call_with_parts(self.shards[k], "apply_mean", parts, self.layout.range(k)[0])

        applying = [apply_on(k) for k in range(self.cfg.shards)]
        for k, f in enumerate(applying):
            try:
                self._versions[k] = f.result(self.timeout_s)
            except RoleFailedError as e:  # died mid-step: restore it, then apply this step there if it lacks it
                restored = self.server.restart(k, e)["updates"]
                self._versions[k] = (restored if restored > self._versions[k] else
                                     apply_on(k).result(self.timeout_s))

    def _handle_failure(self, rid: int, err: Exception) -> None:
        getattr(self, "_calls", {}).pop(rid, None)
        super()._handle_failure(rid, err)

    def _rejoin(self, rid: int) -> None:
        """A restarted replica is called at the lockstep's next step."""
