#!/usr/bin/env bash
# The README's main job: set up .venv if needed, then train a tiny VLM on 2 gloo ranks with the
# original plan and with pipetune's plans, and compare measured and simulated iteration times.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_DATASETS_DISABLE_PROGRESS_BARS=1 OMP_NUM_THREADS=1
PT=.venv/bin/pipetune
DATA=out/data/datamix2
TABLE=out/tables/tiny_cpu.json
if [ ! -f "$DATA/pipetune.json" ]; then
  "$PT" data make --mix datamix2 --samples 20000 --seed 0 --out "$DATA"
fi
echo "== packing report (tiny model, GBS 32, max_seq_len 512, mbs 4) =="
for packer in original balanced; do
  "$PT" pack --data "$DATA" --model tiny --max-seq-len 512 --mbs 4 --gbs 32 --packer "$packer" --iters 5 | tail -1 | sed "s/^/$packer /"
done
if [ ! -f "$TABLE" ]; then
  echo "== profiling the tiny model on this CPU =="
  "$PT" profile --model tiny --out "$TABLE" --quiet
fi
echo "== training on 2 gloo ranks: original plan, then pipetune plans =="
.venv/bin/torchrun --nproc-per-node 2 -m torchtitan_patches.train \
  --data "$DATA" --latency-table "$TABLE" --out out/demo --steps 24 --modes original,pipetune "$@" 2>&1 \
  | grep -v -e "^W.*torch.distributed" -e "^\*\*\*\*" -e "OMP_NUM_THREADS" -e "^\s*$"
echo "timelines: out/demo/{original,pipetune}_{measured,simulated}.png (and .json for Perfetto)"
