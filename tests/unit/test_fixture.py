"""The offline fixture (``pipetune.data.fixture``): the same bytes from the same seed, TorchTitan's
multimodal sample formats as ``datasets`` reads them, real images of varied sizes, and a tokenizer
that TorchTitan's tokenizers load with every special id pipetune needs."""

import io
import json
import tarfile
from pathlib import Path

import datasets
import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image, UnidentifiedImageError
from torchtitan.components.tokenizer import HuggingFaceTokenizer, MultiModalTokenizer
from torchtitan.models.muse_glimmer.config_registry import MUSE_GLIMMER_SPECIAL_TOKENS

from pipetune.cli.main import main
from pipetune.data.fixture import (BAD_IMAGES, BAD_PAIRS, BAD_ROWS, INFO_FILE, INTERLEAVED_DIR, PAIRS_DIR, SPECIAL_TOKENS,
                                   write_bad_images, write_fixture)
from torchtitan_patches.models.muse_glimmer.spec import muse_glimmer_spec
from torchtitan_patches.models.model_spec import planning_model_config
from torchtitan_patches.titan.tokenizer import text_tokenizer

COUNTS = {"pairs": 70, "documents": 8, "text_only": 5}  # 2 shards: 64 pairs per shard


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fixture") / "fx"
    write_fixture(out, seed=3, **COUNTS)
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _pairs(root: Path) -> list[tuple[str, bytes, str]]:
    """(key, jpg bytes, caption) of every pair, in shard order."""
    out = []
    for shard in sorted((root / PAIRS_DIR).glob("*.tar")):
        with tarfile.open(shard) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar}
        keys = sorted({name.split(".")[0] for name in members})
        out += [(k, members[f"{k}.jpg"], members[f"{k}.txt"].decode()) for k in keys]
    return out


def _rows(root: Path) -> list[tuple[list, list]]:
    rows = []
    for part in sorted((root / INTERLEAVED_DIR).glob("*.parquet")):
        t = pq.read_table(part)
        rows += list(zip(t.column("texts").to_pylist(), t.column("images").to_pylist()))
    return rows


def test_same_seed_same_bytes(fixture_dir, tmp_path):
    write_fixture(tmp_path / "again", seed=3, **COUNTS)
    assert _files(tmp_path / "again") == _files(fixture_dir)
    write_fixture(tmp_path / "other", seed=4, **COUNTS)
    assert _pairs(tmp_path / "other")[0][1] != _pairs(fixture_dir)[0][1]


def test_pairs_read_back_as_webdataset(fixture_dir, tmp_path):
    shards = sorted(str(p) for p in (fixture_dir / PAIRS_DIR).glob("shard-*.tar"))
    assert len(shards) == 2
    ds = datasets.load_dataset("webdataset", data_files={"train": shards}, split="train", cache_dir=str(tmp_path))
    assert len(ds) == COUNTS["pairs"] and {"__key__", "jpg", "txt"} <= set(ds.column_names)
    assert isinstance(ds.features["jpg"], datasets.Image)  # decoded to a PIL image on access
    row = ds[0]
    assert isinstance(row["jpg"], Image.Image) and row["jpg"].format == "JPEG"
    assert all(5 <= len(t.split()) <= 40 for t in ds["txt"])


def test_interleaved_documents_read_back_and_round_trip(fixture_dir, tmp_path):
    parts = sorted(str(p) for p in (fixture_dir / INTERLEAVED_DIR).glob("part-*.parquet"))
    ds = datasets.load_dataset("parquet", data_files={"train": parts}, split="train", cache_dir=str(tmp_path / "c"))
    assert ds.features == datasets.Features({"texts": datasets.List(datasets.Value("string")),
                                             "images": datasets.List(datasets.Value("binary"))})
    assert len(ds) == COUNTS["documents"] + COUNTS["text_only"]
    counts, firsts = [], set()
    for texts, images in zip(ds["texts"], ds["images"]):
        assert len(texts) == len(images) and all((t is None) != (i is None) for t, i in zip(texts, images))
        k = sum(i is not None for i in images)
        if k:
            counts.append(k)
            firsts.add(images[0] is not None)
        else:
            assert len(texts) == 1  # text-only (FLAN-like): one text
    assert len(counts) == COUNTS["documents"] and min(counts) >= 1 and max(counts) <= 8 and len(set(counts)) > 1
    assert firsts == {True, False}  # some documents start with an image, some with text
    ds.save_to_disk(str(tmp_path / "saved"))
    again = datasets.load_from_disk(str(tmp_path / "saved"))
    assert again.features == ds.features and again.data.table.equals(ds.data.table)


def test_every_image_decodes_and_sizes_vary(fixture_dir):
    files = [jpg for _, jpg, _ in _pairs(fixture_dir)]
    files += [i for _, images in _rows(fixture_dir) for i in images if i is not None]
    info = json.loads((fixture_dir / INFO_FILE).read_text())
    assert len(files) == info["images"]["count"]
    sizes, formats, modes = set(), set(), set()
    for data in files:
        img = Image.open(io.BytesIO(data))
        img.load()
        assert np.asarray(img).std() > 0  # not one colour
        sizes.add(img.size)
        formats.add(img.format)
        modes.add(img.mode)
    assert len(sizes) >= 10 and len(sizes) == info["images"]["distinct_sizes"]
    aspects = [w / h for w, h in sizes]
    assert min(aspects) < 1 < max(aspects)
    assert formats == {"JPEG", "PNG"} and modes == {"RGB", "L", "RGBA"}


def test_tokenizer_loads_through_torchtitan(fixture_dir):
    info = json.loads((fixture_dir / INFO_FILE).read_text())["tokenizer"]
    hf = HuggingFaceTokenizer(tokenizer_path=str(fixture_dir / "tokenizer"))
    debugmodel_mm = planning_model_config(muse_glimmer_spec(), image_grid=4)
    assert hf.get_vocab_size() == info["vocab_size"] <= debugmodel_mm.backbone.vocab_size
    ids = info["special_ids"]
    tt = text_tokenizer(hf)
    assert (tt.image, tt.vision_start, tt.vision_end, tt.pad, tt.bos, tt.eos) == tuple(
        ids[k] for k in ("image", "vision_start", "vision_end", "pad", "bos", "eos"))
    assert min(ids.values()) > 0  # special ids are the last ones: id 0 is text
    mm = MultiModalTokenizer(MultiModalTokenizer.Config(**MUSE_GLIMMER_SPECIAL_TOKENS),
                             tokenizer_path=str(fixture_dir / "tokenizer"))
    assert (mm.image_id, mm.video_id, mm.pad_id) == (ids["image"], ids["video"], ids["pad"])
    for _, _, caption in _pairs(fixture_dir):
        encoded = hf.encode(caption)
        assert encoded[0] == ids["bos"] and not set(encoded[1:]) & set(ids.values())
        assert hf.decode(encoded, skip_special_tokens=True) == caption
    marked = "".join(SPECIAL_TOKENS[k] for k in ("vision_start", "image", "image", "vision_end"))
    assert hf.encode(marked, add_bos=False) == [ids["vision_start"], ids["image"], ids["image"], ids["vision_end"]]


def test_cli_writes_a_fixture(tmp_path, capsys):
    out = tmp_path / "fx"
    assert main(["data", "fixture", "--out", str(out), "--pairs", "3", "--documents", "2", "--text-only", "1"]) == 0
    info = json.loads((out / INFO_FILE).read_text())
    assert info["pairs"]["samples"] == 3 and info["interleaved"] == {"documents": 2, "text_only": 1, "parts": 1}
    assert "wrote 3 caption pairs" in capsys.readouterr().out
    assert main(["data", "fixture", "--out", str(out)]) == 2  # not empty
    assert main(["data", "fixture", "--out", str(tmp_path / "fx2"), "--pairs", "0"]) == 2
    assert "--pairs >= 1" in capsys.readouterr().err and not (tmp_path / "fx2").exists()


def test_bad_images_are_what_they_say(tmp_path):
    paths = write_bad_images(tmp_path)
    assert set(BAD_IMAGES) <= set(paths)
    with pytest.raises(OSError):
        Image.open(paths["truncated.jpg"]).load()
    with pytest.raises(UnidentifiedImageError):
        Image.open(paths["not_an_image.jpg"])
    assert paths["empty.jpg"].stat().st_size == 0
    assert Image.open(paths["huge.png"]).size == (8000, 6000) and paths["huge.png"].stat().st_size < 100_000
    rows = pq.read_table(paths["bad_documents.parquet"]).to_pylist()
    assert [len(r["texts"]) == len(r["images"]) for r in rows] == [kind != "length_mismatch" for kind in BAD_ROWS]
    with tarfile.open(paths["bad_pairs"] / "shard-00000.tar") as tar:
        names = tar.getnames()
    assert [n.split(".")[0] for n in names if n.endswith(".txt")] == list(BAD_PAIRS)
    assert "no_image.jpg" not in names and all(f"{k}.jpg" in names for k in BAD_PAIRS if k != "no_image")
