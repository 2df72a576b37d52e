"""A run directory's place and what is read back from it: the default ``runs/<timestamp>``, and the records of
its ``metrics.jsonl`` (all of them for plots, the last one for a resumed run's rates)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def default_run_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    p = Path(run_dir) / "metrics.jsonl"
    if not p.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl; is it a distbelief run directory?")
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def last_record(path: Path) -> dict[str, Any] | None:
    """The last record of an existing metrics.jsonl (a resumed run's rates continue from it), else None."""
    if not path.is_file():
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:  # a line cut short by a killed driver
        return None
