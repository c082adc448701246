"""pipetune over the wider schedule space (issue #39), in simulation: 13B + SigLIP (A100 estimate,
TP 4, GBS 128, max_seq_len 8192) at PP 4 and PP 8 on DataMix1/2/3.

Spaces compared, each planned per iteration by pipetune and, as the baseline, by the best static
configuration of the same space (one packer, micro-batch size and, where the space has it,
backward split, chosen once for the run over the same iterations; ``pipetune.plan.layout.compare``):

* ``1F1B``: one chunk per rank, whole backwards (the space before #39);
* ``+ZB``: the planner chooses per iteration between 1F1B and its zero-bubble twin (ZB-H1);
* ``V=2 +ZB``: the same over an interleaved layout with two chunks per rank (``--chunks-per-rank``:
  one such space per count given, e.g. ``2 3 4``).

The "best static" column is the best over all the spaces (it may itself interleave or split).
Printed per row: mean iteration time (s) of pipetune in each space and of that best static
configuration; pipetune's cut against it; pipetune's mean gap to its lower bound; the ceiling
``best static / pipetune's bound - 1``: no plan the planner could find for those packings beats
the bound, so pipetune cannot cut the best static configuration by more than that (the bound is
``placement_lower_bound`` of the space's split table, which holds for whole backwards too); search
time per iteration, the p50 of the space where it is largest / the max over all (ms, one thread;
noisy unless the machine is quiet; automatic GC off, as TorchTitan's trainer runs, unless
``--python-gc``). Compiled tables are cached per
micro-batch count, so early iterations of a run search slower than later ones: all are counted.
``--gbs 1024`` measures the search at the issue's larger batch.
"""

from __future__ import annotations

import argparse
import gc

import numpy as np

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.data import make_mix
from pipetune.plan.layout.compare import compare_modes
from pipetune.plan.mode import Mode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--pp", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--mixes", nargs="+", default=["datamix1", "datamix2", "datamix3"])
    ap.add_argument("--gbs", type=int, default=128)
    ap.add_argument("--chunks-per-rank", type=int, nargs="+", default=[2], help="interleaved spaces (with split backward): chunks per rank of each")
    ap.add_argument("--python-gc", action="store_true", help="time the search with Python's automatic GC on (a TorchTitan job turns it off)")
    args = ap.parse_args()
    spaces = [("1F1B", 1, "off"), ("+ZB", 1, "auto")] + [(f"V={v} +ZB", v, "auto") for v in args.chunks_per_rank]
    if not args.python_gc:
        gc.disable()  # as in a TorchTitan job: its trainer collects every training.gc_freq steps, outside the step
    model = load_model_config("13b")
    hw = load_hardware("a100")
    table = analytical_table(model, hw, tp=4)
    print(f"13b + SigLIP, A100 estimate, TP 4, GBS {args.gbs}, max_seq_len 8192, {args.iters} iterations; times in s")
    print(f"{'PP':>2} {'mix':9} " + " ".join(f"{name:>8}" for name, _, _ in spaces)
          + f" {'best static':>12} {'(its space)':40} {'cut':>6} {'gap LB':>7} {'ceiling':>8} {'search p50/max':>15}")
    for pp in args.pp:
        for mix in args.mixes:
            data = make_mix(mix, args.samples, seed=0)
            runs = {}
            for name, V, split in spaces:
                gc.collect()  # what the job's periodic collection does between steps, outside the timed search
                cost = CostModel(table, StageLayout.even(model.backbone.n_layers, pp * V, chunks_per_rank=V))
                runs[name] = compare_modes(model, cost, data, gbs=args.gbs, max_seq_len=8192, memory_bytes=hw.memory_bytes, iters=args.iters,
                                           modes=(Mode.PIPETUNE,), split_backward=split)
            best_name = min(runs, key=lambda n: runs[n]["best-static"].iter_s.mean())
            static = runs[best_name]["best-static"]
            name, pt = min(((n, r["pipetune"]) for n, r in runs.items()), key=lambda x: x[1].iter_s.mean())
            cut = 1 - pt.iter_s.mean() / static.iter_s.mean()
            gap = float((pt.iter_s / pt.lower_bound_s - 1).mean())
            ceiling = float(static.iter_s.mean() / pt.lower_bound_s.mean() - 1)
            p50 = max(np.percentile(r["pipetune"].search_s, 50) for r in runs.values()) * 1e3  # the slowest space's
            top = max(r["pipetune"].search_s.max() for r in runs.values()) * 1e3
            print(f"{pp:2} {mix:9} " + " ".join(f"{r['pipetune'].iter_s.mean():8.3f}" for r in runs.values())
                  + f" {static.iter_s.mean():12.3f} {best_name + ': ' + static.choice:40} {cut:6.1%} {gap:7.1%} {ceiling:8.1%}"
                  f" {p50:7.0f} / {top:.0f}   (pipetune's best: {name})")


if __name__ == "__main__":
    main()
