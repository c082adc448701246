"""PipeTune Table 2 (13B, TP 4, PP 4, GBS 128, max_seq_len 8192, A100) with pipetune's planner.

Runs ``--iters`` simulated iterations per data mix on the analytical A100 preset (an estimate, not a
measurement) and prints our mean iteration time per mode and its cut versus ``original`` beside the
paper's. Exits non-zero if the ``pipetune`` cut does not beat ``balanced`` on every mix.
"""

from __future__ import annotations

import argparse
import sys

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.data import make_mix
from pipetune.plan.layout.compare import compare_modes

PAPER = {  # seconds per iteration, PipeTune Table 2
    "datamix1": {"original": 15.35, "balanced": 10.52, "reorder": 10.34, "pipetune": 9.10},
    "datamix2": {"original": 17.76, "balanced": 15.61, "reorder": 14.73, "pipetune": 12.63},
    "datamix3": {"original": 17.25, "balanced": 16.82, "reorder": 16.04, "pipetune": 14.47},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--samples", type=int, default=100_000)
    args = ap.parse_args()
    model = load_model_config("13b")
    hw = load_hardware("a100")
    cost = CostModel(analytical_table(model, hw, tp=4), StageLayout.even(model.backbone.n_layers, 4))
    print(f"13B TP4 PP4 GBS 128 max_seq_len 8192, {args.iters} iterations per mix, A100 analytical estimate")
    print(f"{'mode':9} " + " ".join(f"{m + ' ours':>16} {'paper':>14}" for m in PAPER))
    ok = True
    results = {}
    for mix in PAPER:
        s = compare_modes(model, cost, make_mix(mix, args.samples, seed=0), gbs=128, max_seq_len=8192,
                          memory_bytes=hw.memory_bytes, iters=args.iters)
        results[mix] = {m: float(v.iter_s.mean()) for m, v in s.items()}
        results[mix]["mbs"] = dict(s["pipetune"].mbs)
        results[mix]["best_static_choice"] = s["best-static"].choice
    for mode in ("original", "balanced", "reorder", "pipetune"):
        cells = []
        for mix, paper in PAPER.items():
            ours = results[mix][mode]
            cut = 1 - ours / results[mix]["original"]
            pcut = 1 - paper[mode] / paper["original"]
            cells.append(f"{ours:7.2f}s ({cut:5.1%})  {paper[mode]:6.2f}s ({pcut:5.1%})")
        print(f"{mode:9} " + "  ".join(cells))
    for mix in PAPER:
        beats = results[mix]["pipetune"] < results[mix]["balanced"]
        ok &= beats
        print(f"{mix}: pipetune {'beats' if beats else 'DOES NOT beat'} balanced; pipetune mbs chosen {results[mix]['mbs']}; "
              f"cut vs best-static ({results[mix]['best_static_choice']}, not in the paper): "
              f"{1 - results[mix]['pipetune'] / results[mix]['best-static']:.1%}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
