"""``pipetune data make``: write a generated data mix to disk as an HF data set."""

from __future__ import annotations

import numpy as np

from pipetune.data import make_mix, write_dataset
from pipetune.data.mixes import parse_mix
from pipetune.data.storage import check_new_dir


def register(sub) -> None:
    p = sub.add_parser("data", help="generate data sets")
    dsub = p.add_subparsers(dest="data_cmd", required=True)
    make = dsub.add_parser("make", help="generate a mix of COYO-, MMC4- and FLAN-like samples (PipeTune Table 1)")
    make.add_argument("--mix", default="datamix2", help="datamix1|datamix2|datamix3 or weights mmc4:coyo:flan")
    make.add_argument("--samples", type=int, default=100_000)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--out", required=True, help="output directory (new, or empty)")
    make.set_defaults(run=run_make)


def run_make(args) -> int:
    weights = parse_mix(args.mix)
    check_new_dir(args.out)  # before the generation, which takes a while
    table = make_mix(weights, args.samples, args.seed)
    write_dataset(table, args.out, {"mix": args.mix, "weights": weights, "seed": args.seed, "samples": args.samples})
    print(f"wrote {len(table)} samples ({args.mix}) to {args.out}")
    for code, name in enumerate(table.source_names):
        sel = table.source == code
        if sel.any():
            t, k = table.text_tokens[sel], table.num_images[sel]
            print(
                f"  {name:5s} {sel.sum():7d} samples  text tokens mean {t.mean():8.2f} median {np.median(t):6.0f} "
                f"max {t.max():6d}  images mean {k.mean():4.2f} median {np.median(k):2.0f} max {k.max():2d}"
            )
    return 0
