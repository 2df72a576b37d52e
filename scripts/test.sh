#!/usr/bin/env bash
# The full test suite (installs everything it needs first; idempotent). Extra arguments go to pytest,
# e.g. `scripts/test.sh -m "not slow"` for the quick set.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
