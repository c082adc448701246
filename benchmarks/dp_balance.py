"""Data-parallel balance benchmark (simulation): replica spread with ``--dp`` replicas, round-robin
(the data loader's even sample split) vs the FLOPs-aware + simulation-refined split.

Per mix: mean over ``--iters`` global batches of the slowest replica's planned time (the step's
time), of slowest / mean replica and of slowest - fastest replica, each replica planned by the
pipetune planner. Latencies are analytical estimates (``--hardware``).
"""

from __future__ import annotations

import argparse
import json

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.data import make_mix
from pipetune.plan.dp_balance import compare_dp
from pipetune.plan.mode import Mode
from pipetune.plan.planner_config import PlannerConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="13b")
    ap.add_argument("--mixes", default="datamix2,datamix3")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--gbs", type=int, default=512, help="global batch over all replicas")
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model = load_model_config(args.model)
    hw = load_hardware(args.hardware)
    cost = CostModel(analytical_table(model, hw, tp=args.tp), StageLayout.even(model.backbone.n_layers, args.pp), recompute_encoder=True)
    planner = PlannerConfig(mode=Mode.PIPETUNE, max_seq_len=args.max_seq_len, memory_bytes=hw.memory_bytes).build(model, cost)
    rows = {
        mix: compare_dp(model, planner, make_mix(mix, args.samples, 0), dp=args.dp, gbs=args.gbs, max_seq_len=args.max_seq_len, iters=args.iters)
        for mix in args.mixes.split(",")
    }
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{args.model} {args.hardware} TP{args.tp} PP{args.pp} DP{args.dp}, GBS {args.gbs}, {args.iters} iterations (simulated)")
    print(f"{'mix':9} {'split':11} {'step (s)':>9} {'slowest/mean':>13} {'slowest-fastest (s)':>20}")
    for mix, r in rows.items():
        for name in ("round_robin", "balanced"):
            d = r[name]
            print(f"{mix:9} {name:11} {d['mean_iter_s']:9.3f} {d['spread_max_over_mean']:13.3f} {d['spread_max_minus_min_s']:20.3f}")
        print(f"{mix:9} balanced split cut vs round-robin: {r['cut_vs_round_robin']:.1%}")


if __name__ == "__main__":
    main()
