"""The paper's Fig. 5 on this machine: `distbelief bench fig5` with its output in benchmarks/results/fig5-DATE/.

    .venv/bin/python benchmarks/fig5.py [--quick] [--cores N] [other `distbelief bench fig5` options]

The sweep itself lives in `distbelief.bench`; this wrapper only fixes where dated results go. Not a test.
"""

import sys
import time
from pathlib import Path

from distbelief.cli import main

if __name__ == "__main__":
    out = Path(__file__).resolve().parent / "results" / f"fig5-{time.strftime('%Y-%m-%d')}"
    sys.exit(main(["bench", "fig5", "--out", str(out), *sys.argv[1:]]))
