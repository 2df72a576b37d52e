"""When to evaluate next: the evaluation cadence every strategy's driver shares."""

from __future__ import annotations

from typing import Callable


class EvalSchedule:
    """When to evaluate next: every ``every_s`` seconds of training, stretched when one evaluation takes so long
    (a big model, a big test set) that evaluating would take more than ``SHARE`` of the run's wall-clock time.
    Every strategy's driver uses it, so their evaluations are spaced the same way; the user is told once."""

    SHARE = 0.1

    def __init__(self, every_s: float, log: Callable[[str], None] | None = None):
        self.every_s, self.log, self._told = every_s, log, False

    def interval(self, last_eval_s: float) -> float:
        """Training seconds from now to the next evaluation, given that the last one took ``last_eval_s``
        wall-clock seconds."""
        need = last_eval_s * (1 - self.SHARE) / self.SHARE
        if need <= self.every_s:
            return self.every_s
        if not self._told and self.log is not None:
            self._told = True
            self.log(f"an evaluation takes {last_eval_s:.1f}s: evaluating every {need:.0f}s of training instead "
                     f"of every {self.every_s:g}s (--eval-every-seconds), so that evaluation stays under "
                     f"{self.SHARE:.0%} of the run's time; --eval-samples N evaluates on fewer examples")
        return need
