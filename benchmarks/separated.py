"""Co-located (even and searched backbone split) vs separated layout (DIP), in simulation.

For each preset and mix: the partitioner's choices (images per sub-microbatch ``B``, encoder
segments ``K``), then ``--iters`` iterations planned in ``pipetune`` mode on each layout (the same
batches): mean predicted iteration time, the separated layout's cut against the best co-located
layout, and planner search time per iteration (p50 / max, one thread). Latencies are analytical
estimates (H100 / A100 presets), so iteration times are deterministic; search times are not (run
it on a quiet machine).

Then the segment-order search against random orders: on each of ``--order-batches`` batches, at
the micro-batch size the planner chose, the best greedy table over the clustered orders x encoder
leads the planner tries, against the best over as many random orders x the same leads.

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
from pipetune.plan import PlannerConfig
from pipetune.plan.interleave import interleave, segment_priorities
from pipetune.plan.layout_search import LayoutSearch, compare_layouts, sample_batches
from pipetune.plan.ordering import candidate_orders
from pipetune.plan.separated import LEADS, MAX_CLUSTERS
from pipetune.simulate import Latencies

PRESETS = (  # model, hardware, recompute the trained encoder's activations
    ("dip_5b_8b", "h100", True),
    ("dip_5b_8b", "h100", False),
    ("13b", "a100", False),
)
MIXES = ("datamix3", "datamix2")


def order_search_vs_random(model, cost, data, memory_bytes, *, batches: int, gbs: int, max_seq_len: int, seed: int) -> tuple[float, float, int]:
    """Mean best makespan of the clustered orders and of as many random orders (both x ``LEADS``)."""
    planner = PlannerConfig(max_seq_len=max_seq_len, memory_bytes=memory_bytes, seed=seed).build(model, cost)
    stream = BatchStream(num_rows=len(data), gbs=gbs, seed=seed + 1)
    rng = np.random.default_rng(seed)
    ours, rand, runs = [], [], 0
    for step in range(batches):
        meta = batch_meta(data, stream, step, tokens_per_image=model.tokens_per_image, max_seq_len=max_seq_len)
        plan = planner.plan(meta)
        costs = cost.stage_costs(plan.shapes(meta))
        lat, parent = Latencies.from_costs(costs), tuple(costs.sub_batches.parent.tolist())
        limit = planner.budget - planner.states
        orders = candidate_orders(lat, MAX_CLUSTERS, parent)
        m = lat.fwd.shape[0]

        def best(candidates) -> float:
            spans = []
            for order in candidates:
                for lead in LEADS:
                    g = interleave(cost.placement(), parent, lat, *segment_priorities(order, parent, lead), limit)
                    spans.append(g.makespan if g is not None else np.inf)
            return min(spans)

        ours.append(best(orders))
        rand.append(best([rng.permutation(m) for _ in range(len(orders))]))
        runs += len(orders) * len(LEADS)
    return float(np.mean(ours)), float(np.mean(rand)), runs // batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--gbs", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--order-batches", type=int, default=4)
    args = ap.parse_args()
    print(f"TP 4, PP 4, GBS {args.gbs}, max_seq_len {args.max_seq_len}, {args.iters} iterations, pipetune mode on every layout "
          "(analytical estimates)")
    print(f"{'preset':28} {'mix':9} {'B':>3} {'K':>2} {'even (s)':>9} {'split (s)':>9} {'separated (s)':>13} {'cut vs best':>11} "
          f"{'search p50/max ms: split':>24} {'separated':>12}")
    for name, hw, recompute in PRESETS:
        model = load_model_config(name)
        h = load_hardware(hw)
        cost = CostModel(analytical_table(model, h, tp=4), StageLayout.even(model.backbone.n_layers, 4), recompute_encoder=recompute)
        label = f"{name} {hw}" + (" recompute-enc" if recompute else "")
        for mix in MIXES:
            data = make_mix(mix, args.samples, 0)
            runs, part = compare_layouts(model, cost, data, gbs=args.gbs, max_seq_len=args.max_seq_len, memory_bytes=h.memory_bytes,
                                         iters=args.iters)
            by = {r.name: r for r in runs}
            mean = {k: float(r.summary.iter_s.mean()) if r.summary is not None else np.inf for k, r in by.items()}
            best = min(mean["even"], mean["split"])
            cut = f"{1 - mean['separated'] / best:.1%}" if np.isfinite(best) and np.isfinite(mean["separated"]) else "-"
            cell = lambda k: f"{mean[k]:.3f}" if np.isfinite(mean[k]) else "no fit"  # noqa: E731
            times = lambda k: (f"{np.percentile(by[k].summary.search_s, 50) * 1e3:.0f}/{by[k].summary.search_s.max() * 1e3:.0f}"  # noqa: E731
                               if by[k].summary is not None else "-")
            print(f"{label:28} {mix:9} {part.image_sub_batch:3d} {part.segments:2d} {cell('even'):>9} {cell('split'):>9} "
                  f"{cell('separated'):>13} {cut:>11} {times('split'):>24} {times('separated'):>12}")
    print()
    print(f"segment order search, {args.order_batches} batches each: clustered orders (<= {MAX_CLUSTERS} clusters) x leads {LEADS} "
          "vs as many random orders x the same leads (mean best predicted iteration, s)")
    for name, hw, recompute in PRESETS[:2]:
        model = load_model_config(name)
        h = load_hardware(hw)
        base = CostModel(analytical_table(model, h, tp=4), StageLayout.even(model.backbone.n_layers, 4), recompute_encoder=recompute)
        for mix in MIXES:
            data = make_mix(mix, args.samples, 0)
            metas = sample_batches(data, model, gbs=args.gbs, max_seq_len=args.max_seq_len, count=8, seed=0)
            part = LayoutSearch(model, base, metas, max_seq_len=args.max_seq_len, memory_bytes=h.memory_bytes).partition()
            ours, rand, runs = order_search_vs_random(model, base.with_layout(part.layout), data, h.memory_bytes,
                                                      batches=args.order_batches, gbs=args.gbs, max_seq_len=args.max_seq_len, seed=0)
            print(f"  {name} {hw}{' recompute-enc' if recompute else ''} {mix}: clustered {ours:.3f}, random {rand:.3f} "
                  f"({runs} greedy runs per batch each)")


if __name__ == "__main__":
    main()
