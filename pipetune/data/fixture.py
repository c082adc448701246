"""A small, real-looking VLM corpus made offline, in TorchTitan's own multimodal sample formats.

Tests and the main job need real image files and real text, not synthesized ids and pixels, and
the machines that run them have no internet. ``write_fixture`` makes one from a seed:

- ``data/``: one data set of two sources (``pipetune.data.storage``: a directory of data sets),
  each in one of TorchTitan's formats:
- ``data/pairs/shard-NNNNN.tar``: CC12M-style caption pairs as webdataset shards, one ``<key>.jpg``
  (JPEG bytes) and ``<key>.txt`` (caption, 5-40 words) per sample, as TorchTitan's
  ``_process_cc12_wd_sample`` reads them (``txt``, ``jpg``).
- ``data/interleaved/part-NNNNN.parquet``: OBELICS-style documents as TorchTitan's
  ``_process_obelics_sample`` reads them: ``texts: list<string>`` and ``images: list<binary>`` of
  equal length, a null text where an image goes and a null image where text goes. Documents
  (MMC4-like, 1-8 JPEG or PNG images between paragraphs, every third one starting with an image)
  and text-only documents (FLAN-like: one text, no image) alternate in the parts.
- ``tokenizer/``: a byte-level BPE tokenizer trained on the text pool (2,048 ids, the vocabulary
  of TorchTitan's ``debugmodel_mm``), its special tokens (``SPECIAL_TOKENS``) the last ids, so no
  code can pass by assuming id 0 is the image token; ``tokenizer_config.json`` names BOS/EOS/pad
  as TorchTitan's ``HuggingFaceTokenizer`` reads them, and the image / video / vision start/end
  strings are TorchTitan's Muse Glimmer / Qwen3.5 ones (``MultiModalTokenizer`` loads it).
- ``fixture.json``: the seed, counts, image sizes, the tokenizer's special ids.

Images are drawn with Pillow (a gradient, shapes, a word of text, noise on photos), sizes from
16x16 to 640x480 with a log-normal area, landscape and portrait, a few tiny and a few 10:1 strips;
mostly RGB, some grayscale, and RGBA among the PNGs (only in documents: CC12M pairs are JPEG).
Text is Python's own documentation (``pydoc_data.topics``, in the standard library), its prose
paragraphs only; lengths follow the COYO / MMC4 / FLAN statistics of ``pipetune.data.sources``
loosely, in words rather than tokens. The defaults make about 3 MB in a few seconds.

Limits: the same seed gives the same bytes only with the same Python (its documentation is the
text), Pillow (JPEG/PNG encoders, the default font) and ``tokenizers``; the text is technical
prose, not web captions; images have no EXIF orientation and no animation. ``write_bad_images``
makes damaged inputs for the loaders' error tests; ``write_fixture`` never writes them.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageFont

from pipetune.data.storage import check_new_dir

DATA_DIR = "data"
PAIRS_DIR = "data/pairs"
INTERLEAVED_DIR = "data/interleaved"
TOKENIZER_DIR = "tokenizer"
INFO_FILE = "fixture.json"
PAIRS_PER_SHARD = 64
ROWS_PER_PART = 32
ROWS_PER_GROUP = 8
"""Parquet row groups stay small: a reader streaming documents holds one group's images at a time."""

VOCAB_SIZE = 2048
SPECIAL_TOKENS = {
    "pad": "<|endoftext|>",
    "bos": "<|begin_of_text|>",
    "eos": "<|end_of_text|>",
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
    "image": "<|image_pad|>",
    "video": "<|video_pad|>",
}
"""Role -> token string; the strings are those of TorchTitan's ``MUSE_GLIMMER_SPECIAL_TOKENS``."""

INTERLEAVED_SCHEMA = pa.schema([("texts", pa.list_(pa.string())), ("images", pa.list_(pa.binary()))])

_CAPTION_WORDS = (np.log(10.0), 0.5, 5, 40)  # log-normal (mu, sigma), clipped to [min, max]
_DOCUMENT_WORDS = (np.log(260.0), 0.5, 40, 1500)  # MMC4: median 362 tokens, mean / median 1.13
_TEXT_ONLY_WORDS = (np.log(38.0), 1.4, 5, 3000)  # FLAN: median 52 tokens, a long tail
_DOCUMENT_IMAGES = (1.21, 0.64, 1, 8)  # MMC4's image count (pipetune.data.sources), max 8
_ASPECTS = (1.0, 4 / 3, 3 / 4, 3 / 2, 2 / 3, 16 / 9, 9 / 16, 2.0, 0.5)


def write_fixture(out: str | Path, *, seed: int = 0, pairs: int = 300, documents: int = 40,
                  text_only: int = 40) -> dict:
    """Write the fixture to ``out`` (new, or an empty directory) and return what ``fixture.json`` says.

    It is written to a temporary sibling and renamed into place, so ``out`` is absent or complete.
    Pairs, documents and the text-only part draw from separate streams of ``seed``: changing one
    count leaves the others' content as it was.
    """
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")
    if pairs < 1 or documents < 1 or text_only < 0:
        raise ValueError(f"a fixture needs --pairs >= 1, --documents >= 1 and --text-only >= 0; "
                         f"got {pairs}, {documents}, {text_only}")
    out = check_new_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        paragraphs = _paragraphs()
        words = " ".join(paragraphs).split()
        shapes: list[tuple[int, int, str, str]] = []  # (width, height, mode, format) of every image
        shards = _write_pairs(tmp / PAIRS_DIR, np.random.default_rng([seed, 0]), words, pairs, shapes)
        parts = _write_interleaved(tmp / INTERLEAVED_DIR, np.random.default_rng([seed, 1]),
                                   np.random.default_rng([seed, 2]), paragraphs, documents, text_only, shapes)
        vocab, ids = _write_tokenizer(tmp / TOKENIZER_DIR, paragraphs)
        sizes = {(w, h) for w, h, _, _ in shapes}
        info = {
            "seed": seed,
            "pairs": {"samples": pairs, "shards": shards},
            "interleaved": {"documents": documents, "text_only": text_only, "parts": parts},
            "images": {
                "count": len(shapes),
                "jpeg": sum(f == "JPEG" for *_, f in shapes),
                "png": sum(f == "PNG" for *_, f in shapes),
                "modes": {m: sum(s[2] == m for s in shapes) for m in sorted({s[2] for s in shapes})},
                "distinct_sizes": len(sizes),
                "smallest": list(min(sizes, key=lambda s: (s[0] * s[1], s))),
                "largest": list(max(sizes, key=lambda s: (s[0] * s[1], s))),
            },
            "tokenizer": {"vocab_size": vocab, "special_ids": ids},
        }
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        os.replace(tmp, out)  # over an empty directory too
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


# ---------------------------------------------------------------------------------------- text


def _paragraphs() -> list[str]:
    """The prose paragraphs of Python's documentation, one line each (no grammar, code or headings)."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[key]):
            if block.startswith((" ", "\t")) or re.search(r"^[*=\-~^]{3,}\s*$", block, re.M) or ">>>" in block:
                continue  # code, grammar, a heading, an interactive session
            text = " ".join(block.split())
            if text.startswith("* "):
                text = text[2:]
            if len(text.split()) >= 8 and text[-1] in ".:)" and text[0].isupper():
                out.append(text)
    return out


def _length(rng: np.random.Generator, law: tuple[float, float, int, int]) -> int:
    mu, sigma, lo, hi = law
    return int(np.clip(round(rng.lognormal(mu, sigma)), lo, hi))


def _caption(rng: np.random.Generator, words: list[str]) -> str:
    """A run of consecutive words of the text pool, starting at a sentence."""
    n = _length(rng, _CAPTION_WORDS)
    start = int(rng.integers(0, len(words) - n))
    while start > 0 and not words[start - 1].endswith("."):
        start -= 1
    return " ".join(words[start:start + n]).rstrip(",;:")


def _passage(rng: np.random.Generator, paragraphs: list[str], n: int) -> list[str]:
    """Consecutive paragraphs from a random one on, the last cut so they hold ``n`` words."""
    k = int(rng.integers(0, len(paragraphs)))
    out: list[str] = []
    while n > 0:
        words = paragraphs[k % len(paragraphs)].split()[:n]
        out.append(" ".join(words))
        n -= len(words)
        k += 1
    return out


# -------------------------------------------------------------------------------------- images


def _image_size(rng: np.random.Generator) -> tuple[int, int]:
    u = rng.random()
    if u < 0.06:  # an icon or a thumbnail
        return int(rng.integers(16, 41)), int(rng.integers(16, 41))
    if u < 0.12:  # a banner or a strip, 6:1 to 12:1
        long = int(rng.integers(240, 641))
        short = max(16, round(long / rng.uniform(6, 12)))
        return (long, short) if u < 0.09 else (short, long)
    if u < 0.16:  # a full-size picture
        return (640, 480) if u < 0.14 else (480, 640)
    area = float(np.clip(rng.lognormal(np.log(160 * 120), 0.8), 32 * 32, 640 * 480))
    aspect = _ASPECTS[int(rng.integers(0, len(_ASPECTS)))]
    w = int(np.clip(round(np.sqrt(area * aspect)), 24, 640 if aspect >= 1 else 480))
    h = int(np.clip(round(w / aspect), 24, 480 if aspect >= 1 else 640))
    return w, h


def _picture(rng: np.random.Generator, width: int, height: int, mode: str, label: str, photo: bool) -> Image.Image:
    """A gradient with shapes and a word on it; a photo also gets sensor-like noise (not constant,
    not flat: resizing and JPEG decoding are exercised as on real pictures)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    t = x * np.cos(angle) + y * np.sin(angle)
    t = (t - t.min()) / max(float(np.ptp(t)), 1.0)
    c0, c1 = rng.integers(0, 256, (2, 3))
    rgb = c0 + t[..., None] * (c1 - c0).astype(np.float32)
    img = Image.fromarray(rgb.astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(1, 7))):
        box = sorted(rng.integers(0, width, 2).tolist()), sorted(rng.integers(0, height, 2).tolist())
        xy = [box[0][0], box[1][0], box[0][1], box[1][1]]
        fill = tuple(rng.integers(0, 256, 3).tolist())
        kind = int(rng.integers(0, 4))
        if kind == 0:
            draw.ellipse(xy, fill=fill)
        elif kind == 1:
            draw.rectangle(xy, fill=fill)
        elif kind == 2:
            draw.polygon([tuple(p) for p in rng.integers(0, [width, height], (3, 2)).tolist()], fill=fill)
        else:
            draw.line(xy, fill=fill, width=int(rng.integers(1, 5)))
    if min(width, height) >= 24:
        size = int(np.clip(min(width, height) // 4, 8, 48))
        draw.text((int(rng.integers(0, max(1, width // 2))), int(rng.integers(0, max(1, height - size)))), label,
                  fill=tuple(rng.integers(0, 256, 3).tolist()), font=ImageFont.load_default(size=size))
    if photo:
        noisy = np.asarray(img, np.float32) + rng.normal(0, 6, (height, width, 3))
        img = Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")
    if mode == "L":
        return img.convert("L")
    if mode == "RGBA":
        alpha = (255 * (0.25 + 0.75 * t[:, ::-1])).astype(np.uint8)
        img.putalpha(Image.fromarray(alpha, "L"))
    return img


def _encode(rng: np.random.Generator, label: str, *, png_share: float) -> tuple[bytes, tuple[int, int, str, str]]:
    """One image file: its bytes and (width, height, mode, format)."""
    width, height = _image_size(rng)
    fmt = "PNG" if rng.random() < png_share else "JPEG"
    u = rng.random()
    if fmt == "PNG":
        mode = "RGBA" if u < 0.25 else "L" if u < 0.4 else "RGB"
    else:
        mode = "L" if u < 0.08 else "RGB"
    img = _picture(rng, width, height, mode, label, photo=fmt == "JPEG")
    buf = io.BytesIO()
    if fmt == "JPEG":
        img.save(buf, "JPEG", quality=int(rng.integers(60, 95)), progressive=bool(rng.random() < 0.15))
    else:
        img.save(buf, "PNG")
    return buf.getvalue(), (width, height, mode, fmt)


# ------------------------------------------------------------------------------------- writers


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)  # mtime 0, owner root: the same bytes on every run
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))


def _write_pairs(out: Path, rng: np.random.Generator, words: list[str], n: int, shapes: list) -> int:
    out.mkdir(parents=True)
    shards = -(-n // PAIRS_PER_SHARD)
    for s in range(shards):
        with tarfile.open(out / f"shard-{s:05d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(s * PAIRS_PER_SHARD, min(n, (s + 1) * PAIRS_PER_SHARD)):
                caption = _caption(rng, words)
                data, shape = _encode(rng, caption.split()[0], png_share=0.0)
                shapes.append(shape)
                _tar_add(tar, f"{i:09d}.jpg", data)
                _tar_add(tar, f"{i:09d}.txt", caption.encode())
    return shards


def _documents(rng: np.random.Generator, text_rng: np.random.Generator, paragraphs: list[str], documents: int,
               text_only: int, shapes: list) -> Iterator[tuple[list, list]]:
    """Rows (texts, images): documents and text-only documents alternating while both last."""
    order = sorted([(2 * i, True) for i in range(documents)] + [(2 * i + 1, False) for i in range(text_only)])
    doc = 0
    for _, has_images in order:
        if not has_images:
            text = "\n\n".join(_passage(text_rng, paragraphs, _length(text_rng, _TEXT_ONLY_WORDS)))
            yield [text], [None]
            continue
        paras = _passage(rng, paragraphs, _length(rng, _DOCUMENT_WORDS))
        # images go between paragraphs: slot j is before paragraph j, slot len(paras) after the last
        first = 0 if doc % 3 == 0 else 1
        slots = sorted(rng.integers(first, len(paras) + 1, _length(rng, _DOCUMENT_IMAGES)).tolist())
        if first == 0:
            slots[0] = 0
        doc += 1
        texts: list = []
        images: list = []
        run: list[str] = []
        for j in range(len(paras) + 1):
            for _ in range(slots.count(j)):
                if run:
                    texts.append("\n\n".join(run))
                    images.append(None)
                    run = []
                data, shape = _encode(rng, paras[min(j, len(paras) - 1)].split()[0], png_share=0.4)
                shapes.append(shape)
                texts.append(None)
                images.append(data)
            if j < len(paras):
                run.append(paras[j])
        if run:
            texts.append("\n\n".join(run))
            images.append(None)
        yield texts, images


def _write_interleaved(out: Path, rng: np.random.Generator, text_rng: np.random.Generator, paragraphs: list[str],
                       documents: int, text_only: int, shapes: list) -> int:
    out.mkdir(parents=True)
    rows = list(_documents(rng, text_rng, paragraphs, documents, text_only, shapes))
    parts = -(-len(rows) // ROWS_PER_PART)
    for p in range(parts):
        chunk = rows[p * ROWS_PER_PART:(p + 1) * ROWS_PER_PART]
        _write_parquet(out / f"part-{p:05d}.parquet", chunk)
    return parts


def _write_parquet(path: Path, rows: list[tuple[list, list]]) -> None:
    table = pa.table({"texts": [r[0] for r in rows], "images": [r[1] for r in rows]}, schema=INTERLEAVED_SCHEMA)
    pq.write_table(table, path, row_group_size=ROWS_PER_GROUP)


def _write_tokenizer(out: Path, paragraphs: list[str]) -> tuple[int, dict[str, int]]:
    """Train the BPE, append the special tokens and write what ``HuggingFaceTokenizer`` reads."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(paragraphs, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS.values()])
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    ids = {role: tok.token_to_id(s) for role, s in SPECIAL_TOKENS.items()}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS["bos"],
        "eos_token": SPECIAL_TOKENS["eos"],
        "pad_token": SPECIAL_TOKENS["pad"],
        "add_bos_token": True,
        "add_eos_token": False,  # TorchTitan's multimodal processor appends the EOS string itself
        "added_tokens_decoder": {
            str(ids[role]): {"content": s, "special": True, "normalized": False, "lstrip": False, "rstrip": False,
                             "single_word": False}
            for role, s in SPECIAL_TOKENS.items()
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok.get_vocab_size(), ids


# ---------------------------------------------------------------------------------- bad inputs

BAD_IMAGES = {
    "truncated.jpg": "a JPEG cut off after half its bytes",
    "not_an_image.jpg": "text bytes under an image name",
    "empty.jpg": "0 bytes",
    "huge.png": "a valid 8000x6000 PNG (one colour, small on disk), over any pixel budget",
}
BAD_ROWS = ("ok", "length_mismatch", "truncated", "not_an_image", "empty", "huge")
"""Row order of ``bad_documents.parquet``: row 1 has 3 texts and 2 images, rows 2-5 one bad image."""
BAD_PAIRS = ("ok", "truncated", "not_an_image", "empty", "huge", "no_image")
"""Keys of ``bad_pairs/shard-00000.tar`` in order; ``huge.jpg`` holds PNG bytes (as mislabelled files
in CC12M do), ``no_image`` has a ``.txt`` and no ``.jpg``."""


def write_bad_images(out: str | Path) -> dict[str, Path]:
    """Damaged inputs for the loaders' error tests, under ``out``: the ``BAD_IMAGES`` files, an
    interleaved ``bad_documents.parquet`` (rows ``BAD_ROWS``) and a webdataset shard
    ``bad_pairs/shard-00000.tar`` (keys ``BAD_PAIRS``). Returns name -> path."""
    out = Path(out)
    (out / "bad_pairs").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    good, _ = _encode(rng, "fine", png_share=0.0)
    buf = io.BytesIO()
    Image.new("L", (8000, 6000), 128).save(buf, "PNG", compress_level=9)
    data = {
        "truncated.jpg": good[: len(good) // 2],
        "not_an_image.jpg": b"this is a caption, not a picture\n",
        "empty.jpg": b"",
        "huge.png": buf.getvalue(),
    }
    paths = {}
    for name, content in data.items():
        (out / name).write_bytes(content)
        paths[name] = out / name
    by_kind = {"ok": good, "truncated": data["truncated.jpg"], "not_an_image": data["not_an_image.jpg"],
               "empty": data["empty.jpg"], "huge": data["huge.png"]}
    rows = [(["A picture:", None], [None, good]), (["One", None, "two"], [None, good])]
    rows += [(["A picture:", None], [None, by_kind[kind]]) for kind in BAD_ROWS[2:]]
    table = pa.table({"texts": [r[0] for r in rows], "images": [r[1] for r in rows]})  # no schema check: row 1
    pq.write_table(table, out / "bad_documents.parquet")
    paths["bad_documents.parquet"] = out / "bad_documents.parquet"
    with tarfile.open(out / "bad_pairs" / "shard-00000.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for kind in BAD_PAIRS:
            if kind in by_kind:
                _tar_add(tar, f"{kind}.jpg", by_kind[kind])
            _tar_add(tar, f"{kind}.txt", f"a caption for the {kind.replace('_', ' ')} sample".encode())
    paths["bad_pairs"] = out / "bad_pairs"
    return paths
