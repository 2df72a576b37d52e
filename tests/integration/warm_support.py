"""Roles and a model for tests/integration/test_warm_workers.py, in a module Ray's workers can import."""

import threading

from torch import nn


def make_dropout_model():
    """Dropout draws from the replica process's global generator: a warm process must start from a fresh one's."""
    return nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 3))


class Waiter:
    """A role whose ``wait`` holds a call open until ``finish`` (``waiting``: it has begun)."""

    def __init__(self):
        self.began = False
        self.finished = threading.Event()

    def wait(self, timeout_s: float) -> str:
        self.began = True
        return "waited" if self.finished.wait(timeout_s) else "timed out"

    def waiting(self) -> bool:
        return self.began

    def finish(self) -> None:
        self.finished.set()

    def name(self) -> str:
        return "waiter"


class Other:
    def name(self) -> str:
        return "other"


def broken():
    raise ValueError("no such role")
