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


class SyncTrainer(ParameterServerTrainer):
    """Runs ``sync`` over a Runtime. One instance per run."""

    def train(self) -> None:
        cfg = self.cfg
        self._wait_shards_ready()
        self.rec.log(f"starting {cfg.replicas} synchronous replicas x {cfg.shards} shards on the "
                     f"{self.runtime.name} runtime ({self.total:,} parameters)")
        for rid in range(cfg.replicas):
            self.replicas[rid] = self._new_replica_state(rid)
        self.clock = Clock(offset_s=self.prev.get("wall_s", 0.0))
        next_eval = self.clock.elapsed() + cfg.eval_every_seconds
        step = max([st.steps for st in self.replicas.values()] + [0])
        while not (cfg.max_steps and step >= cfg.max_steps):
            self._restart_due()
            live = [rid for rid, st in self.replicas.items() if st.running]
            if not live:
                if any(st.alive for st in self.replicas.values()):  # all waiting out their restart backoff
                    time.sleep(min(0.5, self.supervisor.until_next()))
                    continue
                raise DistBeliefError("every replica failed and none could be restarted")
            # Each replica returns its gradient split by shard; the driver waits for the small summaries only,
            # and shard k receives part k of every gradient straight from the replicas (Runtime.call_split).
            futs = {rid: self.runtime.call_split(self.replicas[rid].role, "sync_step", cfg.shards) for rid in live}
            grads = []
            for rid, f in futs.items():
                try:
                    f.result(self.timeout_s)  # raises here if the replica died or failed: its parts are unusable
                    grads.append(f)
                except (RoleFailedError, RemoteTimeoutError) as e:
                    self._handle_failure(rid, e)
            self._maybe_inject_fault()
            self._check_shards()
            if grads:
                def apply_on(k: int) -> Future:
                    parts = [g.part(k) for g in grads]
                    return self.runtime.call_with_parts(self.shards[k], "apply_mean", parts, self.layout.range(k)[0],
                                                        self.total)

                applying = [apply_on(k) for k in range(cfg.shards)]  # every shard at once, not one after another
                for k, f in enumerate(applying):
                    try:
                        f.result(self.timeout_s)
                    except RoleFailedError as e:  # died mid-step: restore it, then apply this step there
                        self.server.restart(k, e)
                        apply_on(k).result(self.timeout_s)
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

    def _rejoin(self, rid: int) -> None:
        """A restarted replica is called at the lockstep's next step."""
