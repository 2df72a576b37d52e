"""The command line: validation before any worker starts, end-to-end train, plot."""

import json
import subprocess
import sys

import pytest

from distbelief.cli import main

PY = [sys.executable, "-m", "distbelief.cli"]


@pytest.mark.parametrize(
    "args,field",
    [
        (["--replicas", "0"], "replicas"),
        (["--shards", "-2"], "shards"),
        (["--lr", "abc"], "lr"),
        (["--lr", "0"], "lr"),
        (["--batch-size", "1.5"], "batch_size"),
        (["--model", "resnet"], "model"),
        (["--target-accuracy", "1.5"], "target_accuracy"),
        (["--max-seconds", "0"], "max_seconds"),
        (["--shards", "100000000"], "shards"),
        (["--address", "localhost:6379", "--runtime", "inprocess"], "address"),
    ],
)
def test_invalid_values_exit_nonzero_naming_the_option(tmp_path, capsys, args, field):
    out = tmp_path / "run"
    rc = main(["train", "--runtime", "inprocess", "--num-samples", "200", "--out", str(out), *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"error: {field}:" in err
    assert "starting" not in err  # no worker was started
    assert not (out / "metrics.jsonl").exists()


def test_unknown_choice_and_unknown_config_key(tmp_path):
    r = subprocess.run(PY + ["train", "--strategy", "hogwash"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--strategy" in r.stderr
    cfg = tmp_path / "bad.toml"
    cfg.write_text('replicass = 3\n')
    r = subprocess.run(PY + ["train", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "replicass: unknown setting" in r.stderr


def test_help_documents_every_required_option():
    r = subprocess.run(PY + ["train", "--help"], capture_output=True, text=True, timeout=60)
    for opt in ["--task", "--model", "--strategy", "--replicas", "--shards", "--fetch-every", "--push-every",
                "--server-optimizer", "--lr", "--local-lr", "--batch-size", "--warmstart-steps", "--max-steps",
                "--max-seconds", "--target-accuracy", "--eval-every-seconds", "--seed", "--out", "--address",
                "--config"]:
        assert opt in r.stdout


def test_train_with_config_and_overrides_then_plot(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('strategy = "downpour"\nreplicas = 3\n[stop]\nmax_seconds = 30\n')
    out = tmp_path / "run"
    r = subprocess.run(PY + ["train", "--config", str(cfg), "--runtime", "inprocess", "--replicas", "2",
                             "--max-steps", "40", "--num-samples", "1000", "--eval-every-seconds", "1",
                             "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "final test accuracy" in r.stdout
    assert "test acc" in r.stderr  # progress lines
    summary = json.loads((out / "summary.json").read_text())
    assert summary["replicas"] == 2 and summary["steps_per_replica"] == [40, 40]
    resolved = (out / "config.toml").read_text()
    assert "replicas = 2" in resolved and "max_steps = 40" in resolved
    png = tmp_path / "cmp.png"
    r = subprocess.run(PY + ["plot", str(out), str(out), "--out", str(png)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unreachable_address_fails_fast_naming_it():
    r = subprocess.run(PY + ["train", "--address", "127.0.0.1:1", "--max-seconds", "5", "--num-samples", "200"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "127.0.0.1:1" in r.stderr


def test_progress_bar_on_a_terminal_plain_lines_without(tmp_path):
    import os
    import pty
    import select

    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))  # a 120x30 terminal
    cmd = PY + ["train", "--runtime", "inprocess", "--max-seconds", "4", "--eval-every-seconds", "1",
                "--num-samples", "1000", "--out", str(tmp_path / "tty")]
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        if not ready:
            break
        try:
            data = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(60)
    os.close(master)
    screen = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0
    assert "updates=" in screen and "acc=" in screen and "ex/s=" in screen  # the tqdm bar's fields
    assert "|" in screen and "/4s" in screen  # a bar against --max-seconds
    # Without a terminal: plain, periodic lines with the time left.
    r = subprocess.run(cmd[:-1] + [str(tmp_path / "plain")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "test acc" in r.stderr and "time left" in r.stderr and "updates=" not in r.stderr
