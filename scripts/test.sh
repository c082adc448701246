#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the 30 slowest tests close the output: the suite's time is a budget
exec .venv/bin/python -m pytest --durations=30 "$@"
