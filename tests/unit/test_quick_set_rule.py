"""The quick set's rule (tests/conftest.py): a test not marked slow fails when it leaves Ray running, and is named at
the end of the run when it runs too long."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = '''
import time

import pytest


def test_quick():
    pass


def test_too_long():
    time.sleep(0.6)


@pytest.mark.slow
def test_marked_slow():
    time.sleep(0.6)


def test_starts_ray():
    import ray

    ray.init(num_cpus=1, include_dashboard=False)
'''


@pytest.mark.slow  # a pytest of its own: torch's import alone is seconds here, and one probe starts Ray
def test_a_test_starting_ray_fails_and_a_long_one_is_named_unless_marked_slow(tmp_path):
    shutil.copy(Path(__file__).parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {**os.environ, "DISTBELIEF_QUICK_TEST_LIMIT_S": "0.5"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 failed, 3 passed" in out.stdout
    assert "test_starts_ray is not marked slow but it starts Ray" in out.stdout
    rule = out.stdout.split(" quick-set rule =")[1].split("short test summary")[0]  # the section
    assert "test_probe.py::test_too_long" in rule
    assert "test_marked_slow" not in rule and "test_quick" not in rule
