import os
import signal
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset


def pytest_configure(config):
    # Workers inherit this: keep each test process from oversubscribing the 2 cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # A non-interactive shell starts background jobs (`pytest ... &`, nohup) with SIGINT ignored, and the
    # processes they start inherit that: Ctrl-C would never reach the runs the Ctrl-C tests interrupt. Behave as
    # on a terminal; a handled (not ignored) signal is reset to the default in every child at exec.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class OddModel(nn.Module):
    """Tensors of awkward sizes so that shard boundaries fall inside tensors."""

    def __init__(self, d_in: int = 7, classes: int = 3):
        super().__init__()
        self.a = nn.Linear(d_in, 13)
        self.b = nn.Linear(13, 5)
        self.c = nn.Linear(5, classes)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def make_odd_model():
    return OddModel()


def toy_classification(n: int = 256, d_in: int = 7, classes: int = 3, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, classes, generator=g)
    y = (x @ w).argmax(1)
    return TensorDataset(x, y)


RAY_TEST_CPUS = 4  # logical CPUs: room for 2 replicas x 2 partitions or replicas plus shards on a 2-core box


@pytest.fixture
def ray_local():
    """A local Ray instance started with the runtime's own settings and shared by consecutive tests that ask for
    it (starting one costs ~5 s here). ``pytest_collection_modifyitems`` runs those tests back to back and
    ``pytest_runtest_teardown`` shuts Ray down after the last of them, so no other test runs beside it."""
    import ray

    from distbelief.runtime.ray_runtime import connect

    if not ray.is_initialized():
        connect(num_cpus=RAY_TEST_CPUS)
    yield


def _uses_ray_local(item) -> bool:
    return item is not None and "ray_local" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(session, config, items):
    # Stable: every other test keeps its place; the tests sharing one Ray instance move, in order, to the end.
    items.sort(key=_uses_ray_local)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        if _uses_ray_local(item) and not _uses_ray_local(nextitem):
            import ray

            ray.shutdown()


# The quick set (`-m "not slow"`) must stay quick. A test not marked slow that leaves Ray running fails here, naming
# the rule (starting Ray alone takes seconds). One that takes longer than this (its setup and its call) is named at
# the end of the run, under "quick-set rule", but does not fail: this machine's speed changes from day to day (2.3
# times between two days here), and a rule on wall time would fail the suite on a slow day for a test that did not
# change. Mark a test named there `@pytest.mark.slow` or make it faster.
QUICK_TEST_LIMIT_S = float(os.environ.get("DISTBELIEF_QUICK_TEST_LIMIT_S", "5"))  # (the rule's own test lowers it)
_OVER_LIMIT: list[tuple[str, float]] = []


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "setup":
        item.stash[_SETUP_S] = report.duration
    if call.when != "call" or not report.passed or item.get_closest_marker("slow") is not None:
        return report
    spent = item.stash.get(_SETUP_S, 0.0) + report.duration
    if spent > QUICK_TEST_LIMIT_S:
        _OVER_LIMIT.append((item.nodeid, spent))
    if _ray_running():
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} is not marked slow but it starts Ray: mark it @pytest.mark.slow "
                           f"(tests/conftest.py, the quick-set rule)")
    return report


def pytest_terminal_summary(terminalreporter):
    if _OVER_LIMIT:
        terminalreporter.section("quick-set rule")
        terminalreporter.write_line(f"not marked slow, and over the quick set's {QUICK_TEST_LIMIT_S:g}s per test "
                                    f"(setup + call) on this machine: mark them @pytest.mark.slow or make them "
                                    f"quicker (tests/conftest.py)")
        for nodeid, spent in _OVER_LIMIT:
            terminalreporter.write_line(f"  {spent:5.1f}s {nodeid}")


_SETUP_S = pytest.StashKey[float]()


@pytest.fixture(scope="session")
def toy_data():
    return toy_classification(256), toy_classification(64, seed=1)


def config_and_faults(**settings):
    """``(RunConfig, Faults)`` from one set of keyword settings: the fault-injection ones (distbelief.testing.Faults
    fields) go to the Faults, the rest to the config."""
    import dataclasses

    from distbelief import RunConfig
    from distbelief.testing import Faults

    names = {f.name for f in dataclasses.fields(Faults)}
    faults = {k: settings.pop(k) for k in list(settings) if k in names}
    return RunConfig(**settings), Faults(**faults)
