"""The command line: validation before any worker starts, end-to-end train, plot."""

import json
import re
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
        (["--lr", "-1"], "lr"),
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
    assert f"error: --{field.replace('_', '-')}:" in err  # the flag the user typed, not the TOML key
    assert "starting" not in err  # no worker was started
    assert not (out / "metrics.jsonl").exists()


def test_errors_speak_flags_to_flag_users_and_toml_to_file_users(tmp_path, capsys):
    rc = main(["train", "--runtime", "inprocess", "--strategy", "sandblaster", "--partitions", "2",
               "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and "error: --partitions: sandblaster runs unpartitioned replicas; use --partitions 1" in err
    cfg = tmp_path / "c.toml"
    cfg.write_text("[sandblaster]\nlr = 7.5\n")
    assert main(["train", "--config", str(cfg)]) == 2
    assert "c.toml: [sandblaster] lr: it belongs in [run]" in capsys.readouterr().err


def test_unknown_choice_and_unknown_config_key(tmp_path, capsys):
    from distbelief.cli import main

    with pytest.raises(SystemExit) as e:  # argparse's own error (in this process: what the console script runs)
        main(["train", "--strategy", "hogwash"])
    assert e.value.code == 2 and "--strategy" in capsys.readouterr().err
    cfg = tmp_path / "bad.toml"
    cfg.write_text('replicass = 3\n')
    assert main(["train", "--config", str(cfg)]) == 2
    assert "replicass: unknown setting" in capsys.readouterr().err


def test_every_setting_has_a_flag_and_the_version_is_printed():
    import dataclasses

    from distbelief import RunConfig, __version__
    from distbelief.cli import build_parser

    train_parser = build_parser()._subparsers._group_actions[0].choices["train"]
    flags = {s for a in train_parser._actions for s in a.option_strings}
    for f in dataclasses.fields(RunConfig):  # a setting without a flag could only be set from a file
        name = f"--{f.name.replace('_', '-')}"
        assert name in flags or f"--no-{f.name.replace('_', '-')}" in flags, name
    r = subprocess.run(PY + ["--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"distbelief {__version__}"


@pytest.mark.slow
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


@pytest.mark.slow
def test_unreachable_address_fails_fast_naming_it():
    r = subprocess.run(PY + ["train", "--address", "127.0.0.1:1", "--max-seconds", "5", "--num-samples", "200"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "127.0.0.1:1" in r.stderr


@pytest.mark.slow
def test_progress_bar_on_a_terminal_plain_lines_without(tmp_path):
    import fcntl
    import os
    import pty
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))  # a 120x30 terminal
    cmd = PY + ["train", "--runtime", "inprocess", "--max-seconds", "3", "--eval-every-seconds", "1",
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
    # the bar's fields: updates, examples/s, last test accuracy, staleness, time left against --max-seconds
    for field in ("updates=", "ex/s=", "acc=0.", "staleness=", "left="):
        assert field in screen, field
    assert "|" in screen and "/3s" in screen  # a bar against --max-seconds
    # Without a terminal: plain, periodic lines with the same pieces.
    r = subprocess.run(cmd[:-1] + [str(tmp_path / "plain")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "updates=" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if re.match(r"\[\s*[\d.]+s\] ", x)]  # "[    2.0s] updates ..."
    assert len(lines) >= 2  # periodic
    for piece in ("updates ", "/s)", "test acc 0.", "staleness ", "time left "):
        assert all(piece in x for x in lines), piece


RECORDS = [{"wall_s": 2.0 * i, "updates": 100 * i, "examples": 640 * i, "examples_per_s": 320.0,
            "train_loss": 0.5, "test_accuracy": 0.5 + i / 10, "staleness_mean": 1.25} for i in (1, 2, 3)]


def _record_all(max_seconds: float) -> None:
    from distbelief.metrics import RunRecorder

    rec = RunRecorder(None, {"max_seconds": max_seconds})
    for r in RECORDS:
        rec.record(r)
    rec.finish({})


def _drain(master: int) -> str:
    """Everything written to a pty whose other end is closed (the kernel may hand it over in pieces)."""
    import os
    import select

    chunks = []
    while select.select([master], [], [], 10)[0]:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the other end is closed and all was read
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_progress_pieces_with_and_without_a_time_limit_on_a_pty(monkeypatch):
    """The bar itself, in this process: time left against max_seconds, or 'no time limit' without one."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    screens = {}
    for max_s in (10.0, 0.0):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 160, 0, 0))
        with os.fdopen(slave, "w") as tty:
            monkeypatch.setattr(sys, "stderr", tty)
            _record_all(max_s)
        screens[max_s] = _drain(master)
    with_limit, without = screens[10.0], screens[0.0]
    for field in ("updates=300", "ex/s=320", "acc=0.8000", "staleness=1.25"):
        assert field in with_limit and field in without, field
    assert "6/10s" in with_limit and "left=4s" in with_limit
    assert "no time limit" in without and "left=" not in without


def test_plain_lines_with_and_without_a_time_limit(capsys):
    _record_all(10.0)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and [x.split("time left ")[1] for x in lines] == ["8s", "6s", "4s"]
    assert "updates      300" in lines[-1] and "(320/s)" in lines[-1] and "test acc 0.8000" in lines[-1]
    assert "staleness 1.25" in lines[-1]
    _record_all(0.0)  # no time budget: the run stops on steps or accuracy, so no time left is claimed
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and not any("time left" in x for x in lines) and "test acc 0.8000" in lines[-1]
