"""The paper's Fig. 3 on this machine: `distbelief bench fig3` with its output in benchmarks/results/fig3-DATE/.

    .venv/bin/python benchmarks/fig3.py [--quick] [--cores N] [other `distbelief bench fig3` options]

The sweep itself lives in `distbelief.bench`; this wrapper only fixes where dated results go. Not a test.
"""

import sys
import time
from pathlib import Path

from distbelief.cli import main

if __name__ == "__main__":
    out = Path(__file__).resolve().parent / "results" / f"fig3-{time.strftime('%Y-%m-%d')}"
    sys.exit(main(["bench", "fig3", "--out", str(out), *sys.argv[1:]]))
