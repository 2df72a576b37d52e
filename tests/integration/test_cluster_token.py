"""Joining a token-authenticated cluster started the documented way (docs/cluster.md: `ray get-auth-token
--generate`, then `RAY_AUTH_MODE=token ray start --head`) with `--address`, with nothing else set: no RAY_AUTH_MODE
in the driver's environment. The head is started and stopped by the test, on loopback."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

PY = [sys.executable, "-m", "distbelief.cli"]
RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"ray start --head did not listen on {port} within {timeout_s:.0f}s")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_address_joins_a_cluster_started_with_ray_start_head(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # nothing but what a user has
    port = _free_port()
    subprocess.run([RAY, "get-auth-token", "--generate"], env=env, stdout=subprocess.DEVNULL, check=True, timeout=60)
    head = subprocess.Popen([RAY, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                             "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats", "--block"],
                            env={**env, "RAY_AUTH_MODE": "token"}, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "head.log", "w"))
    try:
        _wait_listening(port, 90)
        out = tmp_path / "run"
        r = subprocess.run(PY + ["train", "--address", f"127.0.0.1:{port}", "--replicas", "1", "--shards", "1",
                                 "--num-samples", "1000", "--max-steps", "30", "--max-seconds", "0",
                                 "--eval-every-seconds", "5", "--out", str(out)],
                           env=env, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "InvalidAuthToken" not in r.stderr
        assert "Token authentication is disabled" not in (tmp_path / "head.log").read_text()
        summary = json.loads((out / "summary.json").read_text())
        assert summary["runtime"] == "ray" and summary["steps_per_replica"] == [30]
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops everything it started
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
