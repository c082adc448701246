"""Layout benchmark (simulation): even vs auto stage layout per model preset and data mix.

Per (preset, mix): the layout the search picks on ``--sample`` batches drawn with their own seed,
then every mode planned on the same ``--iters`` iterations under the even and under the auto
layout. Printed: layers per stage, pipetune's mean simulated iteration time under each layout and
the cut of auto against even, and under each layout pipetune's cut against ``original`` and against
``best-static`` (the best fixed mbs and packer chosen once for the run). Latencies are analytical
estimates (``--hardware``); a trained ViT recomputes its activations (``recompute_encoder``) so the
heavy preset fits memory. ``--chunks-per-rank 2`` searches the chunks of virtual stages, and
``--split-backward`` scores layouts (and plans every mode) with zero-bubble tables.
"""

from __future__ import annotations

import argparse
import json

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.data import make_mix
from pipetune.plan.layout.compare import compare_modes
from pipetune.plan.layout.layout_search import LayoutSearch, sample_batches
from pipetune.plan.layout.planner_config import SplitBackward


def run_one(name: str, mix: str, args) -> dict:
    model = load_model_config(name)
    hw = load_hardware(args.hardware)
    memory = hw.memory_bytes
    V, split = args.chunks_per_rank, SplitBackward(args.split_backward)
    even = StageLayout.even(model.backbone.n_layers, args.pp * V, chunks_per_rank=V)
    cost = CostModel(analytical_table(model, hw, tp=args.tp), even, recompute_encoder=True)
    data = make_mix(mix, args.samples, 0)
    sample = sample_batches(data, model, gbs=args.gbs, max_seq_len=args.max_seq_len, count=args.sample, seed=0)
    search = LayoutSearch(model, cost, sample, max_seq_len=args.max_seq_len, memory_bytes=memory, split_backward=split).search()
    row = {"model": name, "mix": mix, "layout_search_s": search.search_s, "layouts_scored": search.evaluated}
    for tag, layout in (("even", search.even.layout), ("auto", search.best.layout)):
        s = compare_modes(model, cost.with_layout(layout), data, gbs=args.gbs, max_seq_len=args.max_seq_len, memory_bytes=memory, iters=args.iters,
                          split_backward=split)
        pt = float(s["pipetune"].iter_s.mean())
        row[tag] = {
            "layers_per_stage": layout.layers_per_stage(),
            "pipetune_iter_s": pt,
            "original_iter_s": float(s["original"].iter_s.mean()),
            "best_static_iter_s": float(s["best-static"].iter_s.mean()),
            "best_static": s["best-static"].choice,
            "cut_vs_original": 1 - pt / float(s["original"].iter_s.mean()),
            "cut_vs_best_static": 1 - pt / float(s["best-static"].iter_s.mean()),
        }
    row["auto_cut_vs_even"] = 1 - row["auto"]["pipetune_iter_s"] / row["even"]["pipetune_iter_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="3b,7b,13b,dip_5b_8b")
    ap.add_argument("--mixes", default="datamix1,datamix2,datamix3")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--gbs", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--sample", type=int, default=8, help="batches the layout search scores layouts on")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--chunks-per-rank", type=int, default=1, help="virtual stages: backbone chunks per rank (interleaved)")
    ap.add_argument("--split-backward", default="off", choices=[x.value for x in SplitBackward])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [run_one(m, x, args) for m in args.models.split(",") for x in args.mixes.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{args.hardware} TP{args.tp} PP{args.pp} GBS {args.gbs} max_seq_len {args.max_seq_len}, {args.iters} iterations (simulated), "
          f"{args.chunks_per_rank} chunk(s) per rank, split backward {args.split_backward}; layers per chunk")
    print(f"{'model':10} {'mix':9} {'even':>9} {'auto':>9} {'auto cut':>8} | {'vs orig even/auto':>17} | {'vs best-static even/auto':>24} | search")
    for r in rows:
        e, a = r["even"], r["auto"]
        print(f"{r['model']:10} {r['mix']:9} {','.join(map(str, e['layers_per_stage'])):>9} {','.join(map(str, a['layers_per_stage'])):>9} "
              f"{r['auto_cut_vs_even']:8.1%} | {e['cut_vs_original']:8.1%} {a['cut_vs_original']:8.1%} | "
              f"{e['cut_vs_best_static']:11.1%} {a['cut_vs_best_static']:12.1%} | {r['layout_search_s']:.2f} s ({r['layouts_scored']})")


if __name__ == "__main__":
    main()
