#!/usr/bin/env bash
# The README's main job: set up .venv if needed, then run the demo on the embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_DATASETS_DISABLE_PROGRESS_BARS=1
PT=".venv/bin/pipetune"
DATA=out/data/datamix2
if [ ! -f "$DATA/pipetune.json" ]; then
  "$PT" data make --mix datamix2 --samples 100000 --seed 0 --out "$DATA"
fi
for packer in original balanced; do
  echo
  echo "== $packer packing, 13B, max_seq_len 8192, mbs 2, GBS 128 =="
  "$PT" pack --data "$DATA" --model 13b --max-seq-len 8192 --mbs 2 --gbs 128 --packer "$packer" --iters 10
done
