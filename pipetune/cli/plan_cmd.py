"""``pipetune plan``: simulate N iterations in every mode and print a PipeTune-Table-2-style summary."""

from __future__ import annotations

from pipetune.cli.common import (
    add_batch_args,
    add_cost_args,
    add_data_args,
    add_model_args,
    cost_model_from_args,
    emit_json,
    model_from_args,
    positive_int,
    table_from_args,
)
from pipetune.cli.layout_cmd import add_layout_args, cost_and_layout_from_args, memory_from_args
from pipetune.plan.layout.compare import compare_modes
from pipetune.plan.layout.planner_config import SplitBackward


def gap(x: float) -> str:
    """A gap to the lower bound as a percentage; float noise at the bound prints as 0.0 %, not -0.0 %."""
    return f"{0.0 if -5e-4 < x < 5e-4 else x:.1%}"


def register(sub) -> None:
    p = sub.add_parser("plan", help="plan iterations in every mode (original, balanced, reorder, pipetune) and compare")
    add_model_args(p)
    add_data_args(p)
    add_batch_args(p, mbs=None)
    add_cost_args(p)
    p.add_argument("--mbs", type=positive_int, help="micro-batch size of the fixed-size modes (default: largest that fits memory)")
    add_layout_args(p, default="even")
    p.add_argument("--dp", type=positive_int, default=1, help="data-parallel replicas: also split each global batch over them (balanced vs round-robin)")
    p.set_defaults(run=run, iters=50)


def run(args) -> int:
    model = model_from_args(args)
    data = table_from_args(args)
    if args.layout == "separated":
        return _separated(args, model, data)
    cost, search = cost_and_layout_from_args(args, model, data)
    memory = memory_from_args(args)
    summary = compare_modes(
        model, cost, data, gbs=args.gbs, max_seq_len=args.max_seq_len, memory_bytes=memory, iters=args.iters,
        mbs=args.mbs, overlong=args.overlong, seed=args.data_seed, split_backward=SplitBackward(args.split_backward), offload=args.offload,
    )
    base = float(summary["original"].iter_s.mean())
    out = {mode: s.to_dict(base) for mode, s in summary.items()}
    static = summary.get("best-static")
    if static is not None:
        out["pipetune"]["cut_vs_best_static"] = 1 - out["pipetune"]["mean_iter_s"] / float(static.iter_s.mean())
    source = "analytical estimate" if cost.table.estimate else f"latency table ({cost.table.device})"
    extrapolated = {name: {"largest": x, "grid_end": float(cost.table.curves[name].grid[-1])} for name, x in cost.beyond_grid.items()}
    config = {"model": model.name, "tp": args.tp, "pp": args.pp, "gbs": args.gbs, "max_seq_len": args.max_seq_len,
              "iters": args.iters, "latencies": source, "hardware": args.hardware if cost.table.estimate else None,
              "layout": args.layout, "layers_per_stage": cost.layout.layers_per_stage(), "separated": cost.layout.is_separated,
              "chunks_per_rank": cost.layout.chunks_per_rank, "chunk_style": cost.layout.style.value, "split_backward": args.split_backward,
              "offload": args.offload,
              "recompute_encoder": cost.recompute_encoder, "extrapolated": extrapolated}
    if search is not None:
        config["layout_search"] = {"layouts_scored": search.evaluated, "search_s": search.search_s,
                                   "sample_cut_vs_even": search.cut_vs_even}
    dp = _data_parallel(args, model, cost, data, memory) if args.dp > 1 else None
    if dp is not None:
        out["data_parallel"] = dp
    if args.json:
        emit_json({"config": config, **out})
        return 0
    print(f"{model.name} TP{args.tp} PP{args.pp} GBS {args.gbs} max_seq_len {args.max_seq_len}, {args.iters} iterations; "
          f"latencies: {source}")
    print(f"layout ({args.layout}): layers per {'chunk' if cost.layout.chunks_per_rank > 1 else 'stage'} "
          f"{','.join(map(str, cost.layout.layers_per_stage()))}"
          + (f", {cost.layout.chunks_per_rank} chunks per rank ({cost.layout.style.value}-style)" if cost.layout.chunks_per_rank > 1 else "")
          + (f"; split backward {args.split_backward}" if args.split_backward != "off" else "")
          + ("; offload where memory binds" if args.offload else "")
          + (f", separated encoder in {len(cost.layout.encoder_chunks)} chunks" if cost.layout.is_separated else "")
          + (f"; searched {search.evaluated} layouts in {search.search_s:.2f} s, sampled cut vs even {search.cut_vs_even:.1%}"
             if search is not None else "")
          + "; lower bounds are for this layout")
    print(f"{'mode':11} {'mean iter (s)':>13} {'cut vs original':>16} {'gap to LB':>10} {'search p50 / p99 (ms)':>22}")
    for mode, d in ((m, out[m]) for m in summary):
        cut = "-" if mode == "original" else f"{d['cut_vs_original']:.1%}"
        print(f"{mode:11} {d['mean_iter_s']:13.4g} {cut:>16} {gap(d['gap_to_lower_bound']):>10} "
              f"{d['search_ms_p50']:10.1f} / {d['search_ms_p99']:.1f}")
    if static is not None:
        print(f"best-static = {static.choice} (fixed for the run); pipetune cut vs best-static: "
              f"{out['pipetune']['cut_vs_best_static']:.1%}")
    counts = summary["pipetune"].mbs
    print("pipetune micro-batch sizes: " + ", ".join(f"mbs={k}: {v}" for k, v in sorted(counts.items())))
    if dp is not None:
        print(f"data parallel dp={args.dp} (GBS {args.gbs} split over replicas, each planned by pipetune; a step waits for the slowest):")
        for name in ("round_robin", "balanced"):
            d = dp[name]
            print(f"  {name:11} mean iter {d['mean_iter_s']:.4g} s, slowest/mean replica {d['spread_max_over_mean']:.3f}, "
                  f"slowest-fastest {d['spread_max_minus_min_s']:.4g} s")
        print(f"  balanced split cut vs round-robin: {dp['cut_vs_round_robin']:.1%}")
    if extrapolated:
        print("warning: planned beyond the latency table's grid (costs extrapolated by FLOPs growth): "
              + ", ".join(f"{n} up to {e['largest']:g} (grid ends at {e['grid_end']:g})" for n, e in extrapolated.items())
              + "; profile larger sizes for measured figures")
    if any(out[m]["fallbacks"] for m in summary):
        print("fallbacks: " + ", ".join(f"{m}={out[m]['fallbacks']}" for m in summary))
    return 0


def _data_parallel(args, model, cost, data, memory) -> dict:
    from pipetune.plan.data_parallel.dp_balance import compare_dp
    from pipetune.plan.mode import Mode
    from pipetune.plan.layout.planner_config import PlannerConfig

    if args.gbs % args.dp:
        raise ValueError(f"--gbs {args.gbs} is not a multiple of --dp {args.dp}")
    planner = PlannerConfig(mode=Mode.PIPETUNE, max_seq_len=args.max_seq_len, memory_bytes=memory, seed=args.data_seed).build(model, cost)
    return compare_dp(model, planner, data, dp=args.dp, gbs=args.gbs, max_seq_len=args.max_seq_len, iters=args.iters,
                      seed=args.data_seed, overlong=args.overlong)


def _separated(args, model, data) -> int:
    """``--layout separated``: the co-located layouts (even and searched split) beside the
    separated one (DIP), each planned in ``pipetune`` mode on the same iterations."""
    import numpy as np

    from pipetune.cost import CostModel
    from pipetune.plan.layout.layout_search import compare_layouts

    if args.dp > 1:
        raise ValueError("--layout separated compares layouts on one pipeline; leave out --dp")
    if model.encoder is None:
        raise ValueError(f"--layout separated needs a model with a vision encoder; {model.name!r} has none")
    if args.offload:
        raise ValueError("--layout separated: the separated layout's planner keeps activations on the device; leave out --offload")
    base = cost_model_from_args(args, model)
    cost = CostModel(base.table, base.layout, recompute_encoder=args.recompute_encoder)
    runs, part = compare_layouts(model, cost, data, gbs=args.gbs, max_seq_len=args.max_seq_len, memory_bytes=memory_from_args(args),
                                 iters=args.iters, sample=args.layout_sample, seed=args.data_seed, overlong=args.overlong)
    best = min((float(r.summary.iter_s.mean()) for r in runs if r.summary is not None and not r.layout.is_separated), default=float("inf"))
    rows = {}
    for r in runs:
        row = {"backbone_layers_per_stage": r.layout.layers_per_stage(), "error": r.error or None}
        if r.layout.is_separated:
            row["encoder_layers_per_chunk"] = [hi - lo for lo, hi in r.layout.encoder_chunks]
        if r.summary is not None:
            s = r.summary
            row.update(mean_iter_s=float(s.iter_s.mean()), lower_bound_s=float(s.lower_bound_s.mean()),
                       search_ms_p50=float(np.percentile(s.search_s, 50) * 1e3), search_ms_max=float(s.search_s.max() * 1e3),
                       mbs_counts={str(k): v for k, v in sorted(s.mbs.items())})
            if r.layout.is_separated and np.isfinite(best):
                row["cut_vs_best_colocated"] = 1 - row["mean_iter_s"] / best
        rows[r.name] = row
    partition = {"image_sub_batch": part.image_sub_batch, "segments": part.segments, "encoder_chunks": len(part.layout.encoder_chunks),
                 "encoder_s_per_sub_micro_batch": part.encoder_s, "backbone_s_per_micro_batch": part.backbone_s}
    source = "analytical estimate" if cost.table.estimate else f"latency table ({cost.table.device})"
    if args.json:
        emit_json({"config": {"model": model.name, "tp": args.tp, "pp": args.pp, "gbs": args.gbs, "max_seq_len": args.max_seq_len,
                              "iters": args.iters, "latencies": source, "recompute_encoder": cost.recompute_encoder},
                   "partition": partition, **rows})
        return 0
    print(f"{model.name} TP{args.tp} PP{args.pp} GBS {args.gbs} max_seq_len {args.max_seq_len}, {args.iters} iterations; "
          f"latencies: {source}; pipetune mode on every layout")
    print(f"separated layout: {part.image_sub_batch} images per sub-microbatch (95 % of the encoder's best throughput), "
          f"{part.segments} encoder segment(s) = {len(part.layout.encoder_chunks)} encoder chunks "
          f"(encoder {part.encoder_s * 1e3:.0f} ms per sub-microbatch vs backbone {part.backbone_s * 1e3:.0f} ms per micro-batch)")
    print(f"{'layout':10} {'backbone layers':>16} {'mean iter (s)':>13} {'vs best co-located':>19} {'search p50 / max (ms)':>22}")
    for name, row in rows.items():
        if row["error"]:
            print(f"{name:10} {','.join(map(str, row['backbone_layers_per_stage'])):>16}  no plan fits: {row['error']}")
            continue
        cut = f"{row['cut_vs_best_colocated']:.1%} cut" if "cut_vs_best_colocated" in row else "-"
        print(f"{name:10} {','.join(map(str, row['backbone_layers_per_stage'])):>16} {row['mean_iter_s']:13.4g} {cut:>19} "
              f"{row['search_ms_p50']:10.1f} / {row['search_ms_max']:.1f}")
    sep = rows.get("separated", {})
    if "cut_vs_best_colocated" in sep:
        verdict = "separated wins" if sep["cut_vs_best_colocated"] > 0 else "co-located wins"
        print(f"{verdict}: separated vs best co-located {-sep['cut_vs_best_colocated']:+.1%} iteration time")
    return 0
