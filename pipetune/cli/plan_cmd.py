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
    positive_float,
    positive_int,
    table_from_args,
)
from pipetune.config import load_hardware
from pipetune.plan.compare import compare_modes


def register(sub) -> None:
    p = sub.add_parser("plan", help="plan iterations in every mode (original, balanced, reorder, pipetune) and compare")
    add_model_args(p)
    add_data_args(p)
    add_batch_args(p, mbs=None)
    add_cost_args(p)
    p.add_argument("--mbs", type=positive_int, help="micro-batch size of the fixed-size modes (default: largest that fits memory)")
    p.add_argument("--memory-gib", type=positive_float, help="GPU memory per rank (default: the --hardware preset's)")
    p.set_defaults(run=run, iters=50)


def run(args) -> int:
    model = model_from_args(args)
    cost = cost_model_from_args(args, model)
    memory = args.memory_gib * 2**30 if args.memory_gib else load_hardware(args.hardware).memory_bytes
    data = table_from_args(args)
    summary = compare_modes(
        model, cost, data, gbs=args.gbs, max_seq_len=args.max_seq_len, memory_bytes=memory, iters=args.iters,
        mbs=args.mbs, overlong=args.overlong, seed=args.data_seed,
    )
    base = float(summary["original"].iter_s.mean())
    out = {mode: s.to_dict(base) for mode, s in summary.items()}
    source = "analytical estimate" if cost.table.estimate else f"latency table ({cost.table.device})"
    extrapolated = {name: {"largest": x, "grid_end": float(cost.table.curves[name].grid[-1])} for name, x in cost.beyond_grid.items()}
    config = {"model": model.name, "tp": args.tp, "pp": args.pp, "gbs": args.gbs, "max_seq_len": args.max_seq_len,
              "iters": args.iters, "latencies": source, "hardware": args.hardware if cost.table.estimate else None,
              "extrapolated": extrapolated}
    if args.json:
        emit_json({"config": config, **out})
        return 0
    print(f"{model.name} TP{args.tp} PP{args.pp} GBS {args.gbs} max_seq_len {args.max_seq_len}, {args.iters} iterations; "
          f"latencies: {source}")
    print(f"{'mode':10} {'mean iter (s)':>13} {'cut vs original':>16} {'gap to LB':>10} {'search p50 / p99 (ms)':>22}")
    for mode, d in out.items():
        cut = "-" if mode == "original" else f"{d['cut_vs_original']:.1%}"
        print(f"{mode:10} {d['mean_iter_s']:13.3f} {cut:>16} {d['gap_to_lower_bound']:10.1%} "
              f"{d['search_ms_p50']:10.1f} / {d['search_ms_p99']:.1f}")
    counts = summary["pipetune"].mbs
    print("pipetune micro-batch sizes: " + ", ".join(f"mbs={k}: {v}" for k, v in sorted(counts.items())))
    if extrapolated:
        print("warning: planned beyond the latency table's grid (costs extrapolated by FLOPs growth): "
              + ", ".join(f"{n} up to {e['largest']:g} (grid ends at {e['grid_end']:g})" for n, e in extrapolated.items())
              + "; profile larger sizes for measured figures")
    if any(d["fallbacks"] for d in out.values()):
        print("fallbacks: " + ", ".join(f"{m}={d['fallbacks']}" for m, d in out.items()))
    return 0
