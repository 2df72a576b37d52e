"""The quick set's rule (tests/conftest.py): a test not marked slow fails when it starts Ray or runs too long."""

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
'''


@pytest.mark.slow  # a pytest of its own: torch's import alone is seconds here
def test_a_long_test_not_marked_slow_fails_and_a_marked_one_passes(tmp_path):
    shutil.copy(Path(__file__).parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {**os.environ, "DISTBELIEF_QUICK_TEST_LIMIT_S": "0.5"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 failed, 2 passed" in out.stdout
    assert "test_too_long is not marked slow but it took" in out.stdout
    assert "test_marked_slow" not in out.stdout.split("short test summary")[-1]
