"""Loader throughput on real image files, and metadata look-ahead time of a 100k-sample data set.

1. **Images per second per worker** (decode + resize + patchify + pack): the loader of the fixture
   corpus (``pipetune data fixture``: JPEG/PNG files from 22 x 17 to 640 x 480, TorchTitan's
   formats) builds global batches in this process (``num_workers=0``, one worker's work) for
   Muse Glimmer ``debugmodel_mm`` at two pixel budgets: the model's (at most 56 x 56 pixels, as
   TorchTitan's config of it) and a Qwen-VL-like one (at most 448 x 448). Images per second =
   images built / seconds, best of ``--repeats``.
2. **Metadata look-ahead of ``--rows`` samples**: a data set in pipetune's columns (raw text with
   ``<image>`` placeholders and image file names, the fixture's files, 80 % caption pairs, 10 %
   documents of 2-6 images, 10 % text-only) opened with the fixture's tokenizer (tokenising
   every row and reading every image header), then the metadata of the next 4 batches; seconds.

    .venv/bin/python benchmarks/loader.py --out out/loader

Run it alone: timings on a machine shared with other work are not comparable.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def images_per_second(corpus: Path, tokenizer, model, *, max_pixels: int, repeats: int, gbs: int) -> tuple[float, int]:
    from pipetune.packing import PackingConfig
    from torchtitan_patches.data import DataLoaderConfig

    cfg = DataLoaderConfig(data=corpus / "data", gbs=gbs, max_seq_len=4096, packing=PackingConfig(mbs=1, max_seq_len=4096),
                           max_pixels=max_pixels)
    epoch = dataclasses.replace(cfg, max_steps=len(cfg.build(model, tokenizer=tokenizer).store) // gbs)
    best, images = np.inf, 0
    for _ in range(repeats):
        loader = epoch.build(model, tokenizer=tokenizer)  # a loader's stream is spent after one pass
        t0 = time.perf_counter()
        images = sum(mb.num_images for batch in loader for mb in batch.micro_batches)
        best = min(best, time.perf_counter() - t0)
    return images / best, images


def write_rows(corpus: Path, out: Path, rows: int, seed: int = 0) -> Path:
    """``rows`` samples in pipetune's columns referring to the corpus's images, extracted to files."""
    import io

    from PIL import Image

    from pipetune.data.storage import open_dataset

    store = open_dataset(corpus / "data")
    images_dir = out / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for r, row in enumerate(store.rows(range(len(store)))):
        for k, ref in enumerate(row["images"]):
            with Image.open(io.BytesIO(ref) if isinstance(ref, bytes) else ref) as im:
                name = f"{r}_{k}.{'png' if im.format == 'PNG' else 'jpg'}"
            (images_dir / name).write_bytes(ref if isinstance(ref, bytes) else Path(ref).read_bytes())
            names.append(f"images/{name}")
    words = " ".join(row["text"].replace("<image>", " ") for row in store.rows(range(len(store)), images=False)).split()
    rng = np.random.default_rng(seed)
    path = out / "rows.jsonl"
    with path.open("w") as f:
        for _ in range(rows):
            kind = rng.random()
            n_img = 1 if kind < 0.8 else int(rng.integers(2, 7)) if kind < 0.9 else 0
            n_words = int(rng.integers(5, 40)) if n_img == 1 else int(rng.integers(50, 400))
            start = int(rng.integers(0, len(words) - n_words))
            text = words[start:start + n_words]
            for _ in range(n_img):
                text.insert(int(rng.integers(0, len(text) + 1)), "<image>")
            f.write(json.dumps({"text": " ".join(text), "images": [names[i] for i in rng.integers(0, len(names), n_img)]}) + "\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "loader")
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gbs", type=int, default=32)
    args = ap.parse_args(argv)
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from pipetune.data.fixture import write_fixture
    from pipetune.packing import PackingConfig
    from torchtitan_patches.data import DataLoaderConfig
    from torchtitan_patches.models.muse_glimmer.spec import muse_glimmer_spec
    from torchtitan_patches.models.model_spec import planning_model_config
    from torchtitan_patches.titan.tokenizer import text_tokenizer

    corpus = args.out / "fixture"
    if not corpus.exists():
        write_fixture(corpus)
    tokenizer = text_tokenizer(HuggingFaceTokenizer(tokenizer_path=str(corpus / "tokenizer")))
    model = planning_model_config(muse_glimmer_spec(), image_grid=4)
    print("== images per second, one worker (decode + resize + patchify + pack) ==")
    for label, budget in (("debugmodel_mm budget, <= 56 x 56", 3136), ("Qwen-VL-like budget, <= 448 x 448", 448 * 448)):
        rate, n = images_per_second(corpus, tokenizer, model, max_pixels=budget, repeats=args.repeats, gbs=args.gbs)
        print(f"{label:36} {rate:8.0f} images/s ({n} images per pass)")

    rows = args.out / f"rows_{args.rows}"
    if not (rows / "rows.jsonl").exists():
        write_rows(corpus, rows, args.rows)
    t0 = time.perf_counter()
    loader = DataLoaderConfig(data=rows / "rows.jsonl", gbs=128, max_seq_len=4096,
                              packing=PackingConfig(max_seq_len=4096)).build(model, tokenizer=tokenizer)
    opened, store = time.perf_counter() - t0, loader.store
    t1 = time.perf_counter()
    loader.upcoming(4)
    ahead = time.perf_counter() - t1
    print(f"== metadata look-ahead of {len(store)} samples ({int(store.table.num_images.sum())} images): open (tokenise every row, "
          f"read every image header) {opened:.1f} s, then 4 batches' metadata {ahead * 1e3:.0f} ms (goal < 30 s) ==")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
