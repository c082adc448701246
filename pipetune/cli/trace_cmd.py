"""``pipetune trace``: simulate one iteration's pipeline and draw it (Gantt PNG or Chrome trace)."""

from __future__ import annotations

from pathlib import Path

from pipetune.data.images import ImageSizing
from pipetune.cli.common import (
    add_batch_args,
    add_cost_args,
    add_data_args,
    add_model_args,
    cost_model_from_args,
    emit_json,
    model_from_args,
    non_negative_int,
    table_from_args,
)
from pipetune.cost import MicroBatchShapes
from pipetune.data import BatchStream, batch_meta
from pipetune.packing import PackingConfig
from pipetune.schedule import Schedule
from pipetune.simulate import Latencies, simulate
from pipetune.simulate.lower_bound import placement_lower_bound
from pipetune.simulate.trace import write_trace


def register(sub) -> None:
    p = sub.add_parser("trace", help="simulate one iteration and write a Gantt PNG / Chrome trace / torch CSV")
    add_model_args(p)
    add_data_args(p)
    add_batch_args(p)
    add_cost_args(p)
    p.add_argument("--packer", default="balanced", choices=["balanced", "original"],
                   help="balanced: FLOPs-balanced packing (PipeTune Alg. 1); original: arrival order")
    p.add_argument("--schedule", type=Schedule, default=Schedule.ONE_F_ONE_B, choices=list(Schedule), help="pipeline schedule to simulate")
    p.add_argument("--step", type=non_negative_int, default=0, help="which global batch to simulate")
    p.add_argument("--out", action="append", default=[], help="x.png (Gantt) or x.json (Chrome trace); repeatable")
    p.add_argument("--csv", help="also write the action table in torch's _load_csv format")
    p.set_defaults(run=run)


def run(args) -> int:
    model = model_from_args(args)
    cost = cost_model_from_args(args, model)
    data = table_from_args(args)
    meta = batch_meta(
        data,
        BatchStream(num_rows=len(data), gbs=args.gbs, seed=args.data_seed),
        args.step,
        images=ImageSizing.for_model(model),
        max_seq_len=args.max_seq_len,
        overlong=args.overlong,
    )
    packing = PackingConfig(packer=args.packer, mbs=args.mbs, max_seq_len=args.max_seq_len, seed=args.data_seed).build(model)(
        meta.table.lengths, args.step
    )
    costs = cost.stage_costs(MicroBatchShapes.from_packing(meta.table, packing))
    lat = Latencies.from_costs(costs)
    table = args.schedule.build(args.pp, range(packing.num_micro_batches), encoder=model.encoder is not None,
                                encoder_trained=cost.encoder_trainable)
    result = simulate(table, lat)
    title = f"{model.name} {args.schedule} PP{args.pp} TP{args.tp} mbs{args.mbs} {args.packer} (step {args.step})"
    for out in args.out:
        write_trace(list(result.actions), out, title=title)
    if args.csv:
        Path(args.csv).write_text(table.to_csv())
    summary = {
        "micro_batches": packing.num_micro_batches,
        "makespan_s": result.makespan,
        "lower_bound_s": placement_lower_bound(table, lat),
        "bubble_ratio": result.bubble_ratio,
        "idle_s": result.idle.tolist(),
        "peak_activation_gib": (result.peak_bytes / 2**30).tolist(),
        "estimate": cost.table.estimate,
        "extrapolated_lookups": costs.extrapolated,
    }
    if args.json:
        emit_json(summary)
        return 0
    print(title + (" [analytical estimate]" if cost.table.estimate else ""))
    print(f"  micro-batches {summary['micro_batches']}, makespan {result.makespan:.4g} s, lower bound "
          f"{summary['lower_bound_s']:.4g} s, bubble ratio {result.bubble_ratio:.1%}")
    if costs.extrapolated:
        print(f"  warning: {costs.extrapolated} latency lookups beyond the table's grid (extrapolated by FLOPs growth): "
              + ", ".join(f"{n} up to {x:g}" for n, x in cost.beyond_grid.items()))
    print("  idle per rank (s): " + " ".join(f"{x:.3f}" for x in result.idle))
    print("  peak activations per rank (GiB): " + " ".join(f"{x:.2f}" for x in summary["peak_activation_gib"]))
    for out in args.out + ([args.csv] if args.csv else []):
        print(f"  wrote {out}")
    return 0
