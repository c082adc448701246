"""``pipetune data make``: write a generated data mix to disk as an HF data set.
``pipetune data fixture``: write a small real-looking VLM corpus (image files, text, a tokenizer)
in TorchTitan's multimodal sample formats (``pipetune.data.fixture``)."""

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
    fix = dsub.add_parser("fixture", help="write a small corpus of real image files and text in TorchTitan's "
                                         "multimodal formats, with a tokenizer (offline)")
    fix.add_argument("--out", required=True, help="output directory (new, or empty)")
    fix.add_argument("--seed", type=int, default=0)
    fix.add_argument("--pairs", type=int, default=300, help="CC12M-style image-caption pairs")
    fix.add_argument("--documents", type=int, default=40, help="OBELICS-style interleaved documents, 1-8 images each")
    fix.add_argument("--text-only", type=int, default=40, help="text-only documents (FLAN-like)")
    fix.set_defaults(run=run_fixture)


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


def run_fixture(args) -> int:
    from pipetune.data.fixture import write_fixture  # Pillow, pyarrow and tokenizers: only for this command

    info = write_fixture(args.out, seed=args.seed, pairs=args.pairs, documents=args.documents,
                         text_only=args.text_only)
    im, tok = info["images"], info["tokenizer"]
    print(f"wrote {args.pairs} caption pairs ({info['pairs']['shards']} webdataset shards), {args.documents} "
          f"interleaved and {args.text_only} text-only documents ({info['interleaved']['parts']} parquet parts) "
          f"to {args.out}")
    print(f"  {im['count']} images ({im['jpeg']} JPEG, {im['png']} PNG), {im['distinct_sizes']} distinct sizes "
          f"from {im['smallest'][0]}x{im['smallest'][1]} to {im['largest'][0]}x{im['largest'][1]}")
    print(f"  tokenizer: {tok['vocab_size']} ids, special ids {tok['special_ids']}")
    return 0
