"""End to end: a process that starts Ray through distbelief's connect() prints our token notice the first time on
a machine and Ray's own never (the filter itself: tests/unit/test_ray_notice.py)."""

import os
import subprocess
import sys

import pytest

from distbelief.runtime import ray_notice

SCRIPT = ("from distbelief.runtime.ray_runtime import connect; import ray; connect(num_cpus=1); ray.shutdown()")


@pytest.mark.slow
def test_connect_says_the_token_notice_once_per_machine(tmp_path):
    env = dict(os.environ, DISTBELIEF_CACHE=str(tmp_path / "cache"))
    env.pop("RAY_AUTH_MODE", None)  # Ray's default: the case in which it logs its notice
    runs = [subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120,
                           check=False)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
        assert ray_notice.RAY_TEXT not in r.stderr
    assert runs[0].stderr.count("[distbelief] note") == 1
    assert "[distbelief] note" not in runs[1].stderr
