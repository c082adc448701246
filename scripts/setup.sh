#!/usr/bin/env bash
# Create .venv and install pipetune with its dependencies. Idempotent: re-runs only when
# pyproject.toml changed. Installs the CPU wheel of torch 2.13.0 first, so that pip never pulls a
# multi-GB CUDA build on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.pipetune-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # a line per package, so that a first install (a few minutes) shows progress
  echo "installing torch 2.13.0 (CPU) and pipetune's dependencies into .venv"
  .venv/bin/python -m pip install --progress-bar off --disable-pip-version-check "torch==2.13.0" | { grep --line-buffered -E "^(Collecting|Building|Installing|Successfully)" || true; }
  .venv/bin/python -m pip install --progress-bar off --disable-pip-version-check -e ".[dev]" | { grep --line-buffered -E "^(Collecting|Building|Installing|Successfully)" || true; }
  echo "$want" > "$stamp"
fi
