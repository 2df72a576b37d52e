#!/usr/bin/env bash
# The main job: a short, real Downpour SGD run (2 replicas x 2 shards, server-side Adagrad) on MNIST-1D,
# on a local Ray instance. Installs everything it needs first (idempotent). Extra arguments are passed to
# `distbelief train`, e.g. `scripts/demo.sh --replicas 3 --max-seconds 60`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
OUT="runs/demo-$(date +%Y%m%d-%H%M%S)"
exec .venv/bin/distbelief train --config configs/demo.toml --out "$OUT" "$@"
