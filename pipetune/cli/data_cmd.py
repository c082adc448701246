"""``pipetune data make``: write a generated data mix to disk as an HF data set.
``pipetune data fixture``: write a small real-looking VLM corpus (image files, text, a tokenizer)
in TorchTitan's multimodal sample formats (``pipetune.data.fixture``).
``pipetune data index``: index a corpus once (``pipetune.data.index``)."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from pipetune.cli.common import non_negative_int, positive_int
from pipetune.data import make_mix, write_dataset
from pipetune.data.image_files import BadImages
from pipetune.data.mixes import parse_mix
from pipetune.data.storage import check_new_dir


def register(sub) -> None:
    p = sub.add_parser("data", help="generate data sets")
    dsub = p.add_subparsers(dest="data_cmd", required=True)
    make = dsub.add_parser("make", help="generate a mix of COYO-, MMC4- and FLAN-like samples (PipeTune Table 1), "
                                                 "or an image-heavy tail (web documents, video)")
    make.add_argument("--mix", default="datamix2", help="datamix1|datamix2|datamix3, webdocs (3.3 images a document, up to 64), "
                                                         "video (36 frames a sample, up to 64), or weights mmc4:coyo:flan")
    make.add_argument("--samples", type=positive_int, default=100_000, help="samples to write")
    make.add_argument("--seed", type=non_negative_int, default=0, help="generator seed (same seed, same data set)")
    make.add_argument("--out", required=True, help="output directory (new, or empty)")
    make.set_defaults(run=run_make)
    fix = dsub.add_parser("fixture", help="write a small corpus of real image files and text in TorchTitan's "
                                         "multimodal formats, with a tokenizer (offline)")
    fix.add_argument("--out", required=True, help="output directory (new, or empty)")
    fix.add_argument("--seed", type=non_negative_int, default=0, help="seed of the corpus's choices (same seed, same files)")
    fix.add_argument("--pairs", type=int, default=300, help="CC12M-style image-caption pairs")
    fix.add_argument("--documents", type=int, default=40, help="OBELICS-style interleaved documents, 1-8 images each")
    fix.add_argument("--text-only", type=int, default=40, help="text-only documents (FLAN-like)")
    fix.set_defaults(run=run_fixture)
    idx = dsub.add_parser("index", help="index a corpus once (metadata and locations, read in place) so that jobs open it in "
                                       "seconds; give the index wherever a data set goes",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    idx.add_argument("data", help="the data set: a save_to_disk directory, .jsonl/.parquet file(s), webdataset .tar "
                                  "shards, or a directory of such data sets")
    idx.add_argument("--out", required=True, help="index directory (new; or the same one again to resume a build)")
    idx.add_argument("--tokenizer", help="the job's tokenizer (HuggingFace tokenizer folder or tokenizer.json) for raw "
                                         "text; default: pipetune's byte tokenizer")
    idx.add_argument("--bad-images", default="error", choices=[b.value for b in BadImages],
                     help="an unreadable image: stop naming it, or leave its sample out (listed in the index)")
    idx.add_argument("--workers", type=positive_int, default=1, help="worker processes (files are spread over them)")
    idx.add_argument("--part", type=_part, default=(0, 1), metavar="I/N",
                     help="build every N-th file starting at file I (machines sharing --out split the work)")
    idx.set_defaults(run=run_index)


def run_make(args) -> int:
    weights = parse_mix(args.mix)
    check_new_dir(args.out)  # before the generation, which takes a while
    print(f"generating {args.samples:,} samples ({args.mix}, seed {args.seed}) into {args.out}", flush=True)
    table = make_mix(weights, args.samples, args.seed)
    write_dataset(table, args.out, {"mix": args.mix, "weights": weights, "seed": args.seed, "samples": args.samples})
    print(f"wrote {len(table)} samples ({args.mix}) to {args.out}")
    for code, name in enumerate(table.source_names):
        sel = table.source == code
        if sel.any():
            t, k = table.text_tokens[sel], table.num_images[sel]
            print(
                f"  {name:6s} {sel.sum():7d} samples  text tokens mean {t.mean():8.2f} median {np.median(t):6.0f} "
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


def _part(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be I/N with whole numbers, e.g. 0/4, got {text!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"I/N needs 0 <= I < N, got {text!r}")
    return i, n


def run_index(args) -> int:
    import time

    from pipetune.data.index import build_index
    from pipetune.data.text import BYTE_TOKENIZER

    if args.tokenizer:
        from pipetune.data.tokenizer_files import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    else:
        tokenizer = BYTE_TOKENIZER
    start = time.perf_counter()
    manifest = build_index(args.data, args.out, tokenizer=tokenizer, tokenizer_path=args.tokenizer, bad_images=args.bad_images,
                           workers=args.workers, part=args.part)
    if manifest is None:
        return 0
    seconds = time.perf_counter() - start
    files = sum(len(s["files"]) for s in manifest["sets"])
    print(f"indexed {manifest['samples']:,} samples ({manifest['images']:,} images) of {files} files into {args.out} in "
          f"{seconds:.1f} s; {manifest['skipped']} rows left out{' (listed in skipped.jsonl)' if manifest['skipped'] else ''}")
    if any(s["raw_text"] for s in manifest["sets"]) and not args.tokenizer:
        print("note: raw text counted with pipetune's byte tokenizer (UTF-8 bytes, about 4x a BPE tokenizer's count); "
              "pass --tokenizer for the job's tokenizer", file=sys.stderr)
    return 0
