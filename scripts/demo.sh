#!/usr/bin/env bash
# The README's main job: set up .venv if needed, then train TorchTitan's multimodal debug model on
# 2 gloo ranks through TorchTitan's own trainer, with the original plan and with pipetune's plans,
# and compare measured and predicted iteration times and the loss curves; then the same model and
# data on TorchTitan's stock pipeline at its best micro-batch size against pipetune.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_DATASETS_DISABLE_PROGRESS_BARS=1 OMP_NUM_THREADS=1
PT=.venv/bin/pipetune
DATA=out/data/datamix2
if [ ! -f "$DATA/pipetune.json" ]; then
  echo "== generating DataMix2 (20,000 samples) =="
  "$PT" data make --mix datamix2 --samples 20000 --seed 0 --out "$DATA"
fi
echo "== packing report (tiny model, GBS 32, max_seq_len 512, mbs 4) =="
for packer in original balanced; do
  "$PT" pack --data "$DATA" --model tiny --max-seq-len 512 --mbs 4 --gbs 32 --packer "$packer" --iters 5 | tail -1 | sed "s/^/$packer /"
done
echo "== TorchTitan job on 2 gloo ranks (torchrun -m torchtitan.train, Muse Glimmer debugmodel_mm): original, balanced@1, pipetune =="
.venv/bin/python benchmarks/titan_compare.py --out out/titan --rounds 3 "$@" 2>&1 | grep --line-buffered -v -e "^W.*torch.distributed" -e "^\*\*\*\*" -e "OMP_NUM_THREADS" -e "^\s*$" -e "initial_load" -e "Triton is not supported" -e "_cpu_device_warning"
echo "== the same model and data on TorchTitan's stock pipeline (its own split, 1F1B over fixed-shape micro-batches), its micro-batch size swept, vs pipetune at sequence lengths 256, 512, 1024 =="
.venv/bin/python benchmarks/vs_torchtitan.py --out out/titan --rounds 1 --steps 12 2>&1 | grep --line-buffered -v -e "^W.*torch.distributed" -e "^\*\*\*\*" -e "OMP_NUM_THREADS" -e "^\s*$" -e "initial_load" -e "Triton is not supported" -e "_cpu_device_warning"
echo "per-step records: out/titan/<job>_0/pipetune/steps.jsonl (TorchTitan's stock jobs: out/titan/vs_torchtitan_<seq_len>_<mbs>_0/stock/steps.jsonl); TorchTitan logs and checkpoints beside them"
