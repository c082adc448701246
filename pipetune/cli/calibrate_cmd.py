"""``pipetune calibrate``: fit a latency table's component scales to stage times measured here."""

from __future__ import annotations

from pipetune.cli.common import add_model_args, model_from_args, positive_int


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="measure real stage times and fit the table's scales (needs torch)")
    add_model_args(p, default="tiny")
    p.add_argument("--table", required=True, help="latency table to calibrate")
    p.add_argument("--data", required=True, help="data set to draw micro-batches from")
    p.add_argument("--out", required=True, help="calibrated table to write")
    p.add_argument("--stages", type=positive_int, default=2, help="pipeline stages to split the model into")
    p.add_argument("--samples", type=positive_int, default=12, help="micro-batches to time")
    p.add_argument("--max-seq-len", type=positive_int, default=512, help="longest packed sequence of the drawn micro-batches (tokens)")
    p.add_argument("--max-mbs", type=positive_int, default=4, help="largest micro-batch size drawn")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (use what training uses)")
    p.set_defaults(run=run)


def run(args) -> int:
    import torch

    from pipetune.cost import CostModel, StageLayout, load_latency_table
    from pipetune.calibrate.action_fit import calibrate
    from profiling.stage_timing import StageTimer, observe, sample_micro_batches

    torch.set_num_threads(args.threads)
    model = model_from_args(args)
    table = load_latency_table(args.table, model=model, tp=1)  # StageTimer runs whole, unsharded layers
    layout = StageLayout.even(model.backbone.n_layers, args.stages)
    max_tokens = args.max_mbs * args.max_seq_len
    timer = StageTimer(model, layout, max_seq_len=max_tokens)
    samples = sample_micro_batches(model, args.data, args.samples, max_seq_len=args.max_seq_len, max_mbs=args.max_mbs)
    calibrated, report = calibrate(table, CostModel(table, layout), observe(timer, samples))
    calibrated.save(args.out)
    print(f"wrote {args.out}: {report.observations} timings, mean |error| "
          f"{report.mean_abs_pct_error_before:.1f}% before -> {report.mean_abs_pct_error_after:.1f}% after")
    print("  scales: " + ", ".join(f"{k}={v:.3f}" for k, v in sorted(report.scales.items())))
    return 0
