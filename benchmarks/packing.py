"""Packing benchmark: FLOPs imbalance (original vs balanced) and balanced packing throughput.

Per mix: mean imbalance (max / mean micro-batch FLOPs) over ``--iters`` batches for both packers,
and the throughput of balanced packing in samples/s on one core at GBS 128 and 1024. Throughput is
measured twice: the packer alone (per-sample FLOPs weights + Alg. 1 on the batch's lengths) and
with the batch metadata lookup (stream, overlong policy) included.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from pipetune.data.images import ImageSizing
from pipetune.config import load_model_config
from pipetune.data import BatchStream, batch_meta, make_mix
from pipetune.packing import FlopsModel, PackingConfig
from pipetune.packing.report import packing_stats


def throughput(fn, batches, repeats: int) -> float:
    n = sum(len(b) for b in batches)
    best = np.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for step, b in enumerate(batches):
            fn(b, step)
        best = min(best, time.perf_counter() - t0)
    return n / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="13b")
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model = load_model_config(args.model)
    flops = FlopsModel(model)
    results = []
    for mix in ("datamix1", "datamix2", "datamix3"):
        table = make_mix(mix, args.samples, seed=0)
        row = {"mix": mix}
        for gbs in (128, 1024):
            stream = BatchStream(num_rows=len(table), gbs=gbs, seed=0)
            metas = [
                batch_meta(table, stream, s, images=ImageSizing.for_model(model), max_seq_len=args.max_seq_len)
                for s in range(args.iters)
            ]
            lengths = [m.table.lengths for m in metas]
            for packer in ("original", "balanced"):
                pk = PackingConfig(packer=packer, mbs=args.mbs, max_seq_len=args.max_seq_len).build(model)
                stats = [packing_stats(l, pk(l, s), flops) for s, l in enumerate(lengths)]
                row[f"imbalance_{packer}_gbs{gbs}"] = float(np.mean([x["imbalance"] for x in stats]))
                row[f"micro_batches_{packer}_gbs{gbs}"] = float(np.mean([x["micro_batches"] for x in stats]))
            balanced = PackingConfig(packer="balanced", mbs=args.mbs, max_seq_len=args.max_seq_len).build(model)
            row[f"samples_per_s_gbs{gbs}"] = throughput(balanced, lengths, 3)

            def with_lookup(_, step, stream=stream, table=table, balanced=balanced):
                m = batch_meta(table, stream, step, images=ImageSizing.for_model(model), max_seq_len=args.max_seq_len)
                balanced(m.table.lengths, step)

            row[f"samples_per_s_with_lookup_gbs{gbs}"] = throughput(with_lookup, lengths, 3)
        results.append(row)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"model={args.model} max_seq_len={args.max_seq_len} mbs={args.mbs} iters={args.iters} (one core)")
    print(f"{'mix':9} {'gbs':>5} {'imbalance original':>18} {'balanced':>9} {'mbs/iter':>8} "
          f"{'balanced samples/s':>18} {'+ lookup':>10}")
    for r in results:
        for gbs in (128, 1024):
            print(
                f"{r['mix']:9} {gbs:5d} {r[f'imbalance_original_gbs{gbs}']:18.3f} {r[f'imbalance_balanced_gbs{gbs}']:9.3f} "
                f"{r[f'micro_batches_balanced_gbs{gbs}']:8.1f} {r[f'samples_per_s_gbs{gbs}']:18,.0f} "
                f"{r[f'samples_per_s_with_lookup_gbs{gbs}']:10,.0f}"
            )


if __name__ == "__main__":
    main()
