"""Single-process SGD: the paper's single-replica baseline, a plain torch training loop in this process."""

from __future__ import annotations

import copy
import math

import torch

from distbelief.baselines.loop import OneReplicaRun
from distbelief.devices import resolve_device
from distbelief.data.batches import BatchSource, StreamBatches
from distbelief.data.loading import stream_of
from distbelief.metrics import RunRecorder
from distbelief.ps.rules import make_rule
from distbelief.summary import RunSummary


def make_torch_optimizer(cfg, params) -> torch.optim.Optimizer:
    """``torch.optim`` for the server rule ``cfg.optimizer`` (its ``torch_optimizer``) with the run's settings.
    ``RunConfig.validate`` has refused a rule without one."""
    rule = make_rule(cfg.optimizer, lr=cfg.lr, eps=cfg.adagrad_eps,
                     initial_accumulator=cfg.adagrad_initial_accumulator)
    return rule.torch_optimizer(params)


class SingleProcessRun(OneReplicaRun):
    """One model trained step by step in this process on all the training data."""

    def __init__(self, job, recorder: RunRecorder):
        from distbelief.job import materialize

        super().__init__(job, recorder)
        cfg = job.cfg
        torch.set_num_threads(job.threads)
        torch.manual_seed(cfg.seed)
        self.device = resolve_device(cfg.device)  # the model and each batch live there; evaluation on the CPU
        self.model = job.model_fn().to(self.device)
        ds = materialize(job.train_data)
        if stream_of(ds) is not None:  # an IterableDataset: the whole stream, pass after pass
            self.batches = StreamBatches(ds, 0, 1, cfg.batch_size)
        else:
            self.batches = BatchSource(ds, range(len(ds)), cfg.batch_size, seed=cfg.seed * 7919)
        self.opt = make_torch_optimizer(cfg, self.model.parameters())
        recorder.log(f"single-process {cfg.optimizer} with {job.threads} torch thread(s) "
                     f"({sum(p.numel() for p in self.model.parameters()):,} parameters)")

    def train_until_eval(self) -> None:
        while True:
            x, y = self.batches.next_batch()
            if self.device.type != "cpu":
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            self.opt.zero_grad(set_to_none=False)
            loss = self.job.loss_fn(self.model(x), y)
            loss.backward()
            self.opt.step()
            self.steps += 1
            self.examples += len(y)
            lv = loss.item()
            self.loss_ema = lv if math.isnan(self.loss_ema) else 0.9 * self.loss_ema + 0.1 * lv
            if self.eval_due() or self.limit_reached():
                return

    def model_now(self) -> torch.nn.Module:
        if self.device.type == "cpu":
            return self.model
        return copy.deepcopy(self.model).cpu()  # evaluated, flattened and returned on the CPU

    def summary_fields(self) -> dict:
        return {"threads": self.job.threads}

    def close(self) -> None:
        self.batches.close()  # DataLoader workers, if any: now, not whenever the run is collected


def run_single_process(job, recorder: RunRecorder) -> tuple[RunSummary, torch.Tensor, dict | None]:
    """Train with ``torch.optim`` (SGD or Adagrad, as ``optimizer``) on all the training data."""
    return SingleProcessRun(job, recorder).run()
