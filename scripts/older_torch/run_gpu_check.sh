#!/usr/bin/env bash
# scripts/gpu_check.sh on a GPU machine whose CUDA torch is older than pipetune's (see
# sitecustomize.py). WHEELS: a folder of wheels for Python there of what pipetune needs beyond its
# torch (torchtitan 0.3.0, torchdata, datasets, dill, multiprocess, spmd_types, tyro,
# docstring_parser, typeguard, fla-core; `pip download --no-deps --python-version ...`).
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS="${WHEELS:?set WHEELS to the folder of wheels}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/pipetune-site "$WHEELS"/*.whl
export PYTHONPATH="$PWD/scripts/older_torch:/tmp/pipetune-site:$PWD" PYTHON=python3
exec bash scripts/gpu_check.sh "$@"
