"""Co-located (even and searched backbone split) vs separated layout (DIP), in simulation, and
pipetune's per-batch search on the separated layout against the best static configuration there.

For each preset and mix (PipeTune's DataMix2/3, and on an A100 the image-heavy tails: web documents
with 3.3 images on average and up to 64, video clips of about 36 frames), ``--iters`` iterations (the same batches on every layout), all planned in
``pipetune`` mode; printed per row:

* the partitioner's choices (images per sub-microbatch ``B``, encoder segments ``K``);
* mean predicted iteration time of the best co-located layout and of the separated one, and the
  separated layout's cut against it;
* on the separated layout: the best static configuration (one packer and micro-batch size for the
  whole run, packing order, the partitioner's ``B``; ``pipetune.plan.layout.compare``), pipetune's cut
  against it, the mean gap of each to its own lower bound (``placement_lower_bound`` with the
  memory term; pipetune's is the smallest over every configuration its search considered);
* pipetune's search time per iteration on the separated layout, p50 / max (one thread).

``--audit N`` then splits pipetune's gap into the search's part and the bound's part, over the
first ``N`` iterations of each row: every configuration the search considers is searched again,
exhaustively (every order, lead and lag; ``segment_search.exhaustive``) where it holds at most
``AUDIT_MAX_MB`` micro-batches, else by a scan and a 20x longer climb. Printed: the mean cut
of that best over pipetune's plan (what a perfect search would gain) and the mean gap of that best
to the lower bound (what no search over this space can close).

Latencies are analytical estimates (H100 / A100 presets), so iteration times are deterministic;
search times are not (run it on a quiet machine).

DIP's own figures (Table 5, VLM-S = ViT 5B + Llama3 8B on 16 H800s, against Megatron-LM): +17.3 %
throughput from the partitioner alone, +62.8 % with the whole scheduler (interleaving, segment
reordering, per-layer memory optimisation). Their baseline is Megatron-LM's balanced-parameter
partition, not PipeTune's co-located one, and they report throughput (time cut = 1 - 1 / (1 + gain):
14.7 % and 38.6 %).
"""

from __future__ import annotations

import argparse

import numpy as np

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.data import BatchStream, batch_meta, make_mix
from pipetune.data.images import ImageSizing
from pipetune.plan.layout.planner_config import PlannerConfig
from pipetune.plan.layout.compare import compare_modes
from pipetune.plan.layout.layout_search import compare_layouts
from pipetune.plan.mode import Mode
from pipetune.plan.separated.segment_search import Budget, climb, exhaustive, open_configuration, scan

PRESETS = (  # model, hardware, recompute the trained encoder's activations, mixes
    ("dip_5b_8b", "h100", True, ("datamix3", "datamix2")),
    ("dip_5b_8b", "h100", False, ("datamix3", "datamix2")),
    ("13b", "a100", False, ("datamix3", "datamix2")),
    ("dip_5b_8b", "a100", False, ("webdocs", "video")),  # image-heavy tails (pipetune.data.sources)
)
AUDIT_MAX_MB = 5


def audit(model, cost, data, *, gbs: int, max_seq_len: int, memory_bytes: float, iters: int) -> tuple[float, float]:
    """Mean (1 - best / plan) and mean (best / lower bound - 1) over ``iters`` batches (module doc)."""
    planner = PlannerConfig(max_seq_len=max_seq_len, memory_bytes=memory_bytes).build(model, cost)
    limit = planner.budget - planner.states
    stream = BatchStream(num_rows=len(data), gbs=gbs, seed=0)
    cut, gap = [], []
    for step in range(iters):
        meta = batch_meta(data, stream, step, images=ImageSizing.for_model(model), max_seq_len=max_seq_len)
        plan = planner.plan(meta)
        configs = planner.configurations(meta, range(1, planner.max_mbs + 1), adaptive=True)
        for c in configs:
            if not np.isfinite(open_configuration(c, limit).base_s):
                continue
            if c.packing.num_micro_batches <= AUDIT_MAX_MB:
                exhaustive(c, limit)
            else:
                budget = Budget(4000 * len(c.problem.acts), None)
                scan(c, limit, budget)
                climb(c, limit, budget, np.random.default_rng(step), 4000)
        best = min(c.best_s for c in configs)
        cut.append(1 - best / plan.predicted_s)
        gap.append(best / plan.lower_bound_s - 1)
    return float(np.mean(cut)), float(np.mean(gap))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--gbs", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--mixes", help="only the rows of these mixes (comma-separated), e.g. webdocs,video")
    ap.add_argument("--audit", type=int, default=0, metavar="N", help="split the gap into search and bound over N iterations")
    args = ap.parse_args()
    print(f"TP 4, PP 4, GBS {args.gbs}, max_seq_len {args.max_seq_len}, {args.iters} iterations (analytical estimates); "
          "times in s, search in ms")
    print(f"{'preset':28} {'mix':9} {'B':>3} {'K':>2} {'co-located':>10} {'separated':>9} {'cut':>6} | {'best static':>18} "
          f"{'pipetune':>8} {'cut':>6} {'gap LB static':>13} {'gap LB pipetune':>15} {'search p50/max':>14}")
    only = set(args.mixes.split(",")) if args.mixes else None
    for name, hw, recompute, mixes in PRESETS:
        if only is not None and not only & set(mixes):
            continue
        model = load_model_config(name)
        h = load_hardware(hw)
        cost = CostModel(analytical_table(model, h, tp=4), StageLayout.even(model.backbone.n_layers, 4), recompute_encoder=recompute)
        label = f"{name} {hw}" + (" recompute-enc" if recompute else "")
        for mix in (m for m in mixes if only is None or m in only):
            data = make_mix(mix, args.samples, 0)
            runs, part = compare_layouts(model, cost, data, gbs=args.gbs, max_seq_len=args.max_seq_len, memory_bytes=h.memory_bytes,
                                         iters=args.iters)
            colocated = min((float(r.summary.iter_s.mean()) for r in runs if r.summary is not None and not r.layout.is_separated),
                            default=np.inf)
            sep = compare_modes(model, cost.with_layout(part.layout), data, gbs=args.gbs, max_seq_len=args.max_seq_len,
                                memory_bytes=h.memory_bytes, iters=args.iters, modes=(Mode.PIPETUNE,))
            tuned, static = sep["pipetune"], sep.get("best-static")
            mean = float(tuned.iter_s.mean())
            gap = lambda s: f"{(s.iter_s / s.lower_bound_s - 1).mean():.1%}"  # noqa: E731
            cut = f"{1 - mean / colocated:.1%}" if np.isfinite(colocated) else "-"
            col = f"{colocated:.3f}" if np.isfinite(colocated) else "no fit"
            st = f"{float(static.iter_s.mean()):.3f} ({static.choice.replace('balanced', 'bal').replace('original', 'orig')})" if static else "no fit"
            st_cut = f"{1 - mean / float(static.iter_s.mean()):.1%}" if static else "-"
            search = f"{np.percentile(tuned.search_s, 50) * 1e3:.0f}/{tuned.search_s.max() * 1e3:.0f}"
            print(f"{label:28} {mix:9} {part.image_sub_batch:3d} {part.segments:2d} {col:>10} {mean:9.3f} {cut:>6} | {st:>18} "
                  f"{mean:8.3f} {st_cut:>6} {gap(static) if static else '-':>13} {gap(tuned):>15} {search:>14}", flush=True)
            if args.audit:
                lost, left = audit(model, cost.with_layout(part.layout), data, gbs=args.gbs, max_seq_len=args.max_seq_len,
                                   memory_bytes=h.memory_bytes, iters=min(args.audit, args.iters))
                print(f"{'':28} {'':9} audit, {min(args.audit, args.iters)} iterations: a perfect search over orders, leads "
                      f"and lags would cut {lost:.2%}; its best sits {left:.1%} above the lower bound", flush=True)


if __name__ == "__main__":
    main()
