"""Planner search time per iteration at GBS 128 / 256 / 512 / 1024 (13B, TP 4, PP 4, A100 estimate).

Plans ``--iters`` batches of DataMix2 in ``pipetune`` mode on one thread and prints the median,
p90 and max search time and the mean number of micro-batches. Goal (issue 5): <= 0.05 s at GBS 128
and <= 0.3 s at GBS 1024 on one core; PipeTune reports < 0.2 s and < 1.5 s (Fig. 8).
"""

from __future__ import annotations

import argparse

import numpy as np

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.data import BatchStream, batch_meta, make_mix
from pipetune.plan import PlannerConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--mix", default="datamix2")
    args = ap.parse_args()
    model = load_model_config("13b")
    hw = load_hardware("a100")
    cost = CostModel(analytical_table(model, hw, tp=4), StageLayout.even(model.backbone.n_layers, 4))
    data = make_mix(args.mix, 200_000, seed=0)
    print(f"13B TP4 PP4, {args.mix}, pipetune mode, {args.iters} iterations per GBS (one thread)")
    print(f"{'gbs':>5} {'p50 (s)':>8} {'p90 (s)':>8} {'max (s)':>8} {'micro-batches':>13}")
    for gbs in (128, 256, 512, 1024):
        planner = PlannerConfig(max_seq_len=8192, memory_bytes=hw.memory_bytes).build(model, cost)
        stream = BatchStream(num_rows=len(data), gbs=gbs, seed=0)
        times, counts = [], []
        for step in range(args.iters):
            meta = batch_meta(data, stream, step, tokens_per_image=576, max_seq_len=8192)
            plan = planner.plan(meta)
            times.append(plan.search_s)
            counts.append(plan.num_micro_batches)
        t = np.array(times)
        print(f"{gbs:5d} {np.percentile(t, 50):8.3f} {np.percentile(t, 90):8.3f} {t.max():8.3f} {np.mean(counts):13.1f}")


if __name__ == "__main__":
    main()
