"""``pipetune pack``: per-iteration packing report (micro-batch count, FLOPs imbalance, utilisation)."""

from __future__ import annotations

import numpy as np

from pipetune.data.images import ImageSizing
from pipetune.cli.common import add_batch_args, add_data_args, add_model_args, emit_json, model_from_args, table_from_args
from pipetune.data import BatchStream, OverlongTotals, batch_meta
from pipetune.packing import FlopsModel, PackingConfig
from pipetune.packing.report import packing_stats


def register(sub) -> None:
    p = sub.add_parser("pack", help="pack batches and report balance and utilisation")
    add_model_args(p)
    add_data_args(p)
    add_batch_args(p)
    p.add_argument("--packer", default="balanced", choices=["balanced", "original"],
                   help="balanced: FLOPs-balanced packing (PipeTune Alg. 1); original: arrival order")
    p.set_defaults(run=run)


def run(args) -> int:
    model = model_from_args(args)
    table = table_from_args(args)
    stream = BatchStream(num_rows=len(table), gbs=args.gbs, seed=args.data_seed)
    packer = PackingConfig(packer=args.packer, mbs=args.mbs, max_seq_len=args.max_seq_len, seed=args.data_seed).build(model)
    flops = FlopsModel(model)
    rows = []
    overlong = OverlongTotals(args.overlong)
    for step in range(args.iters):
        meta = batch_meta(
            table, stream, step, images=ImageSizing.for_model(model), max_seq_len=args.max_seq_len, overlong=args.overlong
        )
        lengths = meta.table.lengths
        stats = packing_stats(lengths, packer(lengths, step), flops)
        rows.append({"step": step, **stats, **meta.overlong.to_dict()})
        overlong = overlong + meta.overlong
    summary = {k: float(np.mean([r[k] for r in rows])) for k in ("micro_batches", "imbalance", "utilisation")}
    summary |= {k: v for k, v in overlong.to_dict().items() if k != "policy"}
    config = {
        "model": model.name,
        "packer": args.packer,
        "mbs": args.mbs,
        "gbs": args.gbs,
        "max_seq_len": args.max_seq_len,
        "overlong": args.overlong,
        "samples_in_data": len(table),
    }
    if args.json:
        emit_json({"config": config, "iterations": rows, "summary": summary})
        return 0
    print(" ".join(f"{k}={v}" for k, v in config.items()))
    print(overlong.describe())
    print(f"{'step':>5} {'micro-batches':>13} {'imbalance':>10} {'utilisation':>11} {'truncated':>9} {'rejected':>8}")
    for r in rows:
        print(
            f"{r['step']:5d} {r['micro_batches']:13d} {r['imbalance']:10.3f} {r['utilisation']:11.1%} "
            f"{r['truncated']:9d} {r['rejected']:8d}"
        )
    s = summary
    print(
        f"{'mean':>5} {s['micro_batches']:13.2f} {s['imbalance']:10.3f} {s['utilisation']:11.1%} "
        f"{s['truncated']:9d} {s['rejected']:8d}"
    )
    return 0
