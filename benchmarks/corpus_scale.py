"""Corpus-scale data: opening a 1M / 10M / 100M-sample VLM corpus through its index, and building one.

1. **Index build rate** (``build_index(..., workers=W)``, samples/s for each ``--workers-list``
   entry, each into a fresh directory) over ``--build-rows`` rows of raw text and image files: 100
   JSON-lines shards in pipetune's columns (``text`` with ``<image>`` placeholders, ``images``
   naming files relative to the shard's directory). Text lengths, image counts and image positions
   are DataMix2's (``make_mix``), at 0.75 words per drawn token, the words being runs of Python's
   own documentation. Rows name a pool of 20,000 distinct JPEG/PNG files (16 x 16 to 640 x 480,
   ``pipetune.data.fixture``) at random: writing one file per reference is out of reach here, and
   every reference still costs the build a header read. Raw text is tokenized with the byte
   tokenizer, or ``--tokenizer PATH`` (a HuggingFace tokenizer folder).
2. **Open, first batch, RSS, per step** at each ``--sizes`` entry: indexes of generated DataMix2
   metadata written directly as valid index files (``disk_format.write_generated``, chunks of up to
   5M rows; building them through a tokenizer is out of reach on 2 cores). In a fresh process per
   index (its RSS is that open's alone): seconds from ``DataLoaderConfig(...).build`` (which opens
   the index) to the first ``GlobalBatch`` (model ``tiny``, GBS 128, max_seq_len 4096, no loader
   workers), RSS growth from before the open to after the last step (``VmRSS``: memory-mapped
   record pages touched count; ``RssAnon``, its anonymous part, beside it), and the mean time of
   each of the ``--steps`` ``next()`` after the first. Twice per index: ``cold``, its records
   dropped from the page cache first (``POSIX_FADV_DONTNEED``: the open reads them from disk, as a
   job's first start on a machine does; the last line's figures), then ``warm``, the same again.
   The index of part 1 is measured the same way on its own line: there rows are read from the
   files by location and images decoded, another workload.

Corpora and generated indexes are cached under ``--out``; a rerun only measures (and rebuilds
part 1's indexes). Nothing is asserted; the issue's targets are printed beside the figures.

    .venv/bin/python benchmarks/corpus_scale.py                         # 9 min on 2 cores, 5 on a rerun
    .venv/bin/python benchmarks/corpus_scale.py --sizes 1M --build-rows 20000  # a quick run

Run it alone: timings on a machine shared with other work are not comparable.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
IMAGE_POOL = 20_000
SHARDS = 100
CHUNK = 5_000_000
WORDS_PER_TOKEN = 0.75
GBS, MAX_SEQ_LEN = 128, 4096


def count(text: str) -> int:
    """``1M``, ``20k``, ``20000`` -> a row count."""
    scale = {"k": 10**3, "m": 10**6}.get(text[-1].lower(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def label(n: int) -> str:
    return f"{n // 10**6}M" if n % 10**6 == 0 else f"{n // 10**3}k" if n % 10**3 == 0 else str(n)


def disk_mb(path: Path) -> float:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file()) / 2**20


# ---------------------------------------------------------------- part 1: raw corpus and build


def write_images(out: Path) -> list[str]:
    """The image pool (cached): ``IMAGE_POOL`` distinct JPEG/PNG files; their names."""
    from tqdm import tqdm

    from pipetune.data.fixture import _encode

    if not (out / "pool.json").is_file():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        rng, names = np.random.default_rng(0), []
        for k in tqdm(range(IMAGE_POOL), desc="writing the image pool", unit=" images", mininterval=2):
            data, (_, _, _, fmt) = _encode(rng, f"i{k}", png_share=0.3)
            names.append(f"{k:05d}.{'png' if fmt == 'PNG' else 'jpg'}")
            (tmp / names[-1]).write_bytes(data)
        (tmp / "pool.json").write_text(json.dumps(names))
        os.replace(tmp, out)
    return json.loads((out / "pool.json").read_text())


def write_corpus(out: Path, rows: int) -> Path:
    """``rows`` rows of raw text naming the pool's images, in ``SHARDS`` JSON-lines files (cached)."""
    from pydoc_data.topics import topics
    from tqdm import tqdm

    from pipetune.data import make_mix

    data = out / f"rows_{label(rows)}"
    if data.is_dir():
        return data
    pool = write_images(out / "images")
    words = re.findall(r"[A-Za-z]+", " ".join(topics[k] for k in sorted(topics)))
    table = make_mix("datamix2", rows, seed=0)
    rng = np.random.default_rng(1)
    refs = [f"../images/{pool[k]}" for k in rng.integers(0, len(pool), len(table.image_offsets))]
    tmp = data.with_name(data.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    per_shard = -(-rows // SHARDS)
    for s in tqdm(range(SHARDS), desc=f"writing {label(rows)} rows", unit=" shards"):
        with (tmp / f"shard-{s:05d}.jsonl").open("w") as fh:
            for i in range(s * per_shard, min(rows, (s + 1) * per_shard)):
                n = min(max(1, round(WORDS_PER_TOKEN * int(table.text_tokens[i]))), len(words) // 2)  # cut: a few rows in 10^6
                start = int(rng.integers(0, len(words) - n))
                text = words[start:start + n]
                lo, hi = int(table.image_ptr[i]), int(table.image_ptr[i + 1])
                for off in table.image_offsets[lo:hi][::-1].tolist():  # descending: earlier inserts stay put
                    text.insert(round(WORDS_PER_TOKEN * off), "<image>")
                fh.write(json.dumps({"text": " ".join(text), "images": refs[lo:hi]}) + "\n")
    os.replace(tmp, data)
    return data


def build_rates(data: Path, out: Path, workers_list: list[int], tokenizer_path: str | None) -> tuple[list[tuple], Path]:
    """``[(workers, samples/s, seconds)]`` of a build into a fresh directory each; the last index."""
    from pipetune.data.index import build_index
    from pipetune.data.text import BYTE_TOKENIZER
    from pipetune.data.tokenizer_files import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else BYTE_TOKENIZER
    rates = []
    for w in workers_list:
        index = out / f"index_{data.name}_w{w}"
        shutil.rmtree(index, ignore_errors=True)
        t0 = time.perf_counter()
        manifest = build_index(data, index, tokenizer=tokenizer, tokenizer_path=tokenizer_path, workers=w)
        seconds = time.perf_counter() - t0
        rates.append((w, manifest["samples"] / seconds, seconds))
        print(f"built {index.name}: {manifest['samples']:,} samples in {seconds:.1f} s", flush=True)
    return rates, index


# ---------------------------------------------------------------- part 2: generated indexes


def generated_index(out: Path, n: int) -> tuple[Path, float | None]:
    """An index of ``n`` generated DataMix2 samples (cached); its path and write seconds (None: cached)."""
    from tqdm import tqdm

    from pipetune.data import make_mix
    from pipetune.data.index.disk_format import write_generated

    index = out / f"generated_{label(n)}"
    if (index / "manifest.json").is_file():  # written last
        return index, None
    shutil.rmtree(index, ignore_errors=True)
    starts = range(0, n, CHUNK)

    def chunks():
        for k, start in enumerate(starts):
            t = make_mix("datamix2", min(CHUNK, n - start), seed=k)
            yield replace(t, ids=t.ids + start)  # unique over the chunks

    t0 = time.perf_counter()
    write_generated(index, tqdm(chunks(), total=len(starts), desc=f"writing generated_{label(n)}", unit=" chunks"))
    return index, time.perf_counter() - t0


# ---------------------------------------------------------------- measuring an open (own process)


def rss_mb() -> dict[str, float]:
    """Resident MB: all (``VmRSS``) and anonymous (``RssAnon``: not the index's mapped file pages)."""
    status = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+) kB", status).group(1)) / 1024 for k in ("VmRSS", "RssAnon")}


def measure(index: Path, steps: int, tokenizer_path: str | None) -> dict:
    """Open ``index`` into a loader and run ``1 + steps`` steps (in a process of its own)."""
    from pipetune.config import load_model_config
    from pipetune.data.index import open_index  # noqa: F401  (its modules load before the RSS baseline)
    from pipetune.data.text import BYTE_TOKENIZER
    from pipetune.data.tokenizer_files import load_tokenizer
    from pipetune.packing import PackingConfig
    from torchtitan_patches.data import DataLoaderConfig

    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else BYTE_TOKENIZER
    model = load_model_config("tiny")
    if tokenizer.vocab_size > model.backbone.vocab_size:  # tiny's 512 ids, widened to the tokenizer's
        model = replace(model, backbone=replace(model.backbone, vocab_size=tokenizer.vocab_size))
    config = DataLoaderConfig(data=index, gbs=GBS, max_seq_len=MAX_SEQ_LEN, packing=PackingConfig(max_seq_len=MAX_SEQ_LEN))
    before = rss_mb()
    t0 = time.perf_counter()
    loader = config.build(model, tokenizer=tokenizer)
    opened = time.perf_counter() - t0
    batches = iter(loader)
    next(batches)
    first = time.perf_counter() - t0
    times, images = [], 0
    for _ in range(steps):
        t = time.perf_counter()
        batch = next(batches)
        times.append(time.perf_counter() - t)
        images += sum(mb.num_images for mb in batch.micro_batches)
    after = rss_mb()
    return {"samples": len(loader.store), "open_s": opened, "first_batch_s": first, "per_step_ms": 1e3 * float(np.mean(times)),
            "rss_growth_mb": after["VmRSS"] - before["VmRSS"], "anon_growth_mb": after["RssAnon"] - before["RssAnon"],
            "images_per_step": images / steps}


def evict(index: Path) -> None:
    """Drop the index's records from the page cache (written back first), so that the open reads
    them from disk as a job's first start on a machine does."""
    os.sync()
    for f in index.glob("*.npy"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measured(index: Path, steps: int, tokenizer_path: str | None = None) -> dict[str, dict]:
    """``measure`` in a process of its own: first with the records dropped from the page cache
    (``cold``), then again with them as that left them (``warm``)."""
    command = [sys.executable, __file__, "--measure", str(index), "--steps", str(steps)]
    command += ["--tokenizer", tokenizer_path] if tokenizer_path else []
    out = {}
    for state in ("cold", "warm"):
        if state == "cold":
            evict(index)
        result = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
        out[state] = json.loads(result.stdout.strip().splitlines()[-1])
    return out


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "corpus_scale")
    ap.add_argument("--sizes", default="1M,10M,100M", help="generated index sizes, e.g. 1M,10M")
    ap.add_argument("--build-rows", default="1M", help="rows of the raw corpus that part 1 builds")
    ap.add_argument("--workers-list", default="1,2", help="build_index workers, one build each")
    ap.add_argument("--tokenizer", help="HuggingFace tokenizer folder for raw text (default: the byte tokenizer)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    tokenizer_path = str(Path(args.tokenizer).resolve()) if args.tokenizer else None
    if args.measure:
        print(json.dumps(measure(args.measure, args.steps, tokenizer_path)))
        return 0
    sizes = sorted(count(s) for s in args.sizes.split(","))
    build_rows = count(args.build_rows)
    t_start = time.perf_counter()

    data = write_corpus(args.out / "corpus", build_rows)
    rates, real = build_rates(data, args.out, [int(w) for w in args.workers_list.split(",")], tokenizer_path)
    real_images = len(json.loads((args.out / "corpus" / "images" / "pool.json").read_text()))
    refs = int(json.loads((real / "manifest.json").read_text())["images"])

    rows = []
    for n in sizes:
        index, wrote = generated_index(args.out, n)
        rows.append((f"generated {label(n)}", index, wrote, measured(index, args.steps)))
    rows.append((f"raw corpus {label(build_rows)}", real, rates[-1][2], measured(real, args.steps, tokenizer_path)))

    tokenizer_name = f"tokenizer {tokenizer_path}" if tokenizer_path else "byte tokenizer"
    print(f"\n== index build: {build_rows:,} rows of raw text ({tokenizer_name}) in {SHARDS} JSON-lines shards, {refs:,} image "
          f"references to a pool of {real_images:,} distinct JPEG/PNG files (every reference costs a header read) ==")
    for w, rate, seconds in rates:
        print(f"workers {w}: {rate:10,.0f} samples/s ({seconds:.1f} s)")
    print(f"\n== open + first batch, RSS, per step: model tiny, GBS {GBS}, max_seq_len {MAX_SEQ_LEN}, no loader workers, "
          f"{args.steps} steps after the first; cold: the index's records dropped from the page cache before the open, "
          f"warm: the same again right after ==")
    print(f"{'index':22} {'cache':5} {'samples':>12} {'disk MB':>8} {'write/build s':>13} {'open s':>6} {'first batch s':>13} "
          f"{'RSS growth MB':>13} {'of it anon':>10} {'per step ms':>11} {'images/step':>11}")
    for name, index, wrote, by_state in rows:
        for state, m in by_state.items():
            written = "" if state == "warm" else "cached" if wrote is None else f"{wrote:.1f}"
            disk = f"{disk_mb(index):,.0f}" if state == "cold" else ""
            print(f"{name if state == 'cold' else '':22} {state:5} {m['samples']:12,} {disk:>8} {written:>13} {m['open_s']:6.2f} "
                  f"{m['first_batch_s']:13.2f} {m['rss_growth_mb']:13.0f} {m['anon_growth_mb']:10.0f} {m['per_step_ms']:11.1f} "
                  f"{m['images_per_step']:11.0f}")
    print(f"(raw corpus: rows read from the shards by location and their images decoded, another workload than the "
          f"generated indexes' synthesized content; its build is the workers={rates[-1][0]} one, its disk size includes the "
          f"build's parts/. Generated: write includes generating the metadata)")
    top, base = rows[len(sizes) - 1][3], rows[0][3]
    ratio = {state: top[state]["per_step_ms"] / base[state]["per_step_ms"] for state in top}
    print(f"\nissue targets at {label(sizes[-1])}, cold (warm): first batch <= 5 s: {top['cold']['first_batch_s']:.2f} s "
          f"({top['warm']['first_batch_s']:.2f} s); RSS growth <= 500 MB: {top['cold']['rss_growth_mb']:.0f} MB "
          f"({top['warm']['rss_growth_mb']:.0f} MB); per step within 1.2 x the {label(sizes[0])} figure: {ratio['cold']:.2f} x "
          f"({ratio['warm']:.2f} x). Whole run {time.perf_counter() - t_start:.0f} s")
    top, base = top["cold"], base["cold"]
    print(f"{label(sizes[-1])} samples: first batch {top['first_batch_s']:.2f} s, RSS growth {top['rss_growth_mb']:.0f} MB, "
          f"per step {top['per_step_ms']:.1f} ms ({label(sizes[0])}: {base['per_step_ms']:.1f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
