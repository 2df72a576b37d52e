#!/usr/bin/env bash
# Idempotent environment set-up: creates .venv (if missing) and installs the pinned
# dependencies plus distbelief itself (editable). Re-running is cheap: pip skips what
# is already satisfied, and a stamp file skips pip entirely when nothing changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DISTBELIEF_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment in $VENV" >&2
  "$PY" -m venv "$VENV"
fi

STAMP="$VENV/.distbelief-installed"
WANT="$(cat "$ROOT/requirements.txt" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi

echo "[setup] installing pinned dependencies (first run takes a few minutes)" >&2
LOG="$VENV/setup.log"
run() { "$@" >>"$LOG" 2>&1 || { echo "[setup] failed: $* (log: $LOG)" >&2; tail -30 "$LOG" >&2; exit 1; }; }
: > "$LOG"
run "$VENV/bin/python" -m pip install --upgrade pip
run "$VENV/bin/python" -m pip install -r "$ROOT/requirements.txt"
run "$VENV/bin/python" -m pip install --no-deps -e "$ROOT"
echo "$WANT" > "$STAMP"
echo "[setup] done" >&2
