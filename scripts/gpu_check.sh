#!/usr/bin/env bash
# pipetune's runtime checks on a machine with one CUDA GPU (benchmarks/gpu_check.py: executor vs
# reference in bf16, host syncs, predicted vs measured memory, latency-table accuracy), PASS/FAIL
# per check. Run it in an environment with a CUDA build of torch and pipetune installed
# (`pip install -e .`), or set PYTHON to that interpreter; it does not install anything.
# `--dry-run` runs the same checks on the CPU with small sizes (CI does, so the script keeps working).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
export HF_DATASETS_DISABLE_PROGRESS_BARS=1 PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
exec "$PYTHON" benchmarks/gpu_check.py "$@"
