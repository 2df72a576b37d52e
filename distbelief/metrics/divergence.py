"""Divergence detection: tells from a run's metrics records that the loss exploded, and says which flag to
change."""

from __future__ import annotations

import math
from typing import Any

# The divergence rule (DivergenceWatch). A loss counts as exploded when it is both many times the first
# evaluation's and large in absolute terms: the factor leaves room for the noise of a minibatch loss and for a
# run that gets worse for a while, the floor for runs whose first loss is already small (a resumed run, a warm
# start) — 10 nats is above the chance-level cross-entropy of every shipped task (ln 8192 = 9.0). A rate far too
# large explodes the loss within the first steps, before the first evaluation (the paper's model at Adagrad
# gamma = 0.05: 117 at 10 s, then flat), so a loss above the ceiling counts too: a mean cross-entropy of 50 nats
# gives the true class e^-50 on average, which no classifier does at initialization or while training. The
# ceiling holds for the default cross-entropy loss only: train() drops it for a custom loss_fn, whose scale it
# cannot know (a summed loss, say).
DIVERGENCE_FACTOR = 10.0
DIVERGENCE_FLOOR = 10.0
DIVERGENCE_CEILING = 50.0
_LOSS_NAMES = {"train_loss": "train loss", "test_loss": "test loss"}


class DivergenceWatch:
    """Tells from a run's metrics records whether training diverged, so that a run with too large a rate stops
    early with advice instead of spending its budget at chance accuracy.

    A record has diverged when its ``train_loss`` or ``test_loss`` is non-finite (nan, inf), is more than
    DIVERGENCE_FACTOR times the same loss at the first evaluation *and* more than DIVERGENCE_FLOOR, or is more
    than DIVERGENCE_CEILING. It fires once: a trainer that evaluates once more on its way out records that
    evaluation without a second error.
    """

    def __init__(self, ceiling: float = DIVERGENCE_CEILING):
        self.first: dict[str, float] = {}
        self.fired = False
        self.ceiling = ceiling

    def check(self, rec: dict[str, Any]) -> str | None:
        """The reason ``rec`` (raw: before non-finite values became None) shows divergence, else None."""
        if self.fired:
            return None
        for key, name in _LOSS_NAMES.items():
            v = rec.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if not math.isfinite(v):
                self.fired = True
                return f"{name} {v}"
            first = self.first.setdefault(key, float(v))
            if v > DIVERGENCE_FACTOR * first and v > DIVERGENCE_FLOOR:
                self.fired = True
                return f"{name} {v:.4g} (was {first:.4g} at the first evaluation)"
            if v > self.ceiling:
                self.fired = True
                return f"{name} {v:.4g} (above {self.ceiling:g}: far beyond the loss of an untrained model)"
        return None


def divergence_message(config: dict[str, Any], wall_s: float, reason: str) -> str:
    """The DivergedError text: what diverged, and the flag to change with a value to try."""
    head = f"training diverged at {wall_s:.1f}s: {reason}"
    if config.get("strategy") == "sandblaster":
        return (f"{head}; sandblaster's L-BFGS chooses its own steps by line search and takes no --lr: try a "
                f"larger --lbfgs-batch (now {config.get('lbfgs_batch')}) or a smaller --history (now "
                f"{config.get('history')})")
    lr = config.get("lr")
    if not isinstance(lr, (int, float)) or not lr > 0:
        return f"{head}; lower the learning rate (--lr)"
    return f"{head}; lower the learning rate, e.g. --lr {lr / 10:g} (now {lr:g})"
