"""Real image files and real text through the loader: the fixture corpus (TorchTitan's webdataset
pairs and parquet documents, one directory of data sets) with its own tokenizer, images at their
own resolution, decoding only where the encoder runs, and damaged inputs."""

import dataclasses
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from test_images import _torchtitan_resize
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from pipetune.data.fixture import DATA_DIR, TOKENIZER_DIR, write_bad_images, write_fixture
from pipetune.data.image_files import BadImages
from pipetune.data.storage import open_dataset
from pipetune.packing import PackingConfig
from torchtitan_patches.data import DataLoaderConfig
from torchtitan_patches.data.micro_batch import IGNORE_INDEX
from torchtitan_patches.models.muse_glimmer.spec import muse_glimmer_spec
from torchtitan_patches.models.model_spec import planning_model_config
from torchtitan_patches.titan.tokenizer import text_tokenizer

SEQ = 2048


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus") / "fixture"
    write_fixture(root, seed=1, pairs=40, documents=10, text_only=6)
    return root


@pytest.fixture(scope="module")
def muse():
    return planning_model_config(muse_glimmer_spec(), image_grid=4)  # 56 x 56 pixels, 14-pixel patches, 2 x 2 merge


@pytest.fixture(scope="module")
def tok(corpus):
    return text_tokenizer(HuggingFaceTokenizer(tokenizer_path=str(corpus / TOKENIZER_DIR)))


def _true_images(store):
    """Every row's images decoded in full by Pillow (not through the loader's header reads)."""
    out = []
    for row in store.rows(range(len(store))):
        sizes = []
        for ref in row["images"]:
            with Image.open(io.BytesIO(ref) if isinstance(ref, bytes) else ref) as im:
                im.load()
                sizes.append((im.height, im.width))
        out.append(sizes)
    return out


def test_image_tokens_are_the_sum_of_each_images_grid_for_every_sample(corpus, muse, tok):
    """One epoch of the fixture (both sources, the job's tokenizer): every sample's image tokens in
    the built sequence are the tokens of its images' grids, each grid TorchTitan's resize of the
    image's true size; every image is bracketed and unlabelled, and every image brings its
    patches (grid rows x columns, as its pixels resized)."""
    loader = DataLoaderConfig(data=corpus / DATA_DIR, gbs=14, max_seq_len=SEQ, packing=PackingConfig(mbs=1, max_seq_len=SEQ),
                              max_steps=4).build(muse, tokenizer=tok)  # 56 samples: one epoch
    store, enc = loader.store, muse.encoder
    assert type(store).__name__ == "MixedStore" and store.table.source_names == ("interleaved", "pairs")
    resize = _torchtitan_resize()
    truth = _true_images(store)
    assert len(store) == 56
    seen = {}
    for batch in loader:
        for mb in batch.micro_batches:
            cu = mb.cu_seqlens.numpy()
            patches = 0
            for k, sid in enumerate(mb.sample_ids.tolist()):
                doc = mb.tokens[cu[k]:cu[k + 1]].numpy()
                grids = [tuple(g // enc.patch_size for g in resize(h, w, patch_size=enc.patch_size, merge_size=enc.merge,
                                                                    min_pixels=784, max_pixels=3136)[:2]) for h, w in truth[sid]]
                want = sum(gh * gw // enc.merge**2 for gh, gw in grids)
                assert (doc == tok.image).sum() == want, sid
                assert (doc == tok.vision_start).sum() == (doc == tok.vision_end).sum() == len(grids)
                assert doc[0] == tok.bos and doc[-1] == tok.eos
                patches += sum(gh * gw for gh, gw in grids)
                seen[sid] = seen.get(sid, 0) + 1
            assert mb.pixel_values.shape == (patches, enc.patch_dim)
            assert sorted(mb.image_grids) == list(mb.image_grids)  # sorted by grid: one encoder call per grid
            assert (mb.labels[mb.image_token_index] == IGNORE_INDEX).all()
            assert sum(span.length for span in mb.image_spans) == mb.image_token_index.numel()
    assert seen == {sid: 1 for sid in range(len(store))}  # every sample once
    assert len({g for sizes in truth for g in sizes}) > 10  # the images really vary


def test_ranks_without_the_encoder_get_the_same_batches_without_pixels(corpus, muse, tok):
    cfg = DataLoaderConfig(data=corpus / DATA_DIR, gbs=16, max_seq_len=SEQ, packing=PackingConfig(mbs=2, max_seq_len=SEQ), max_steps=2)
    with_pixels = list(cfg.build(muse, tokenizer=tok))
    without = cfg.build(muse, tokenizer=tok, pixels=False)
    reads = []
    without.dataset._store = _Spy(without.store, reads)  # the workers' view of the data set
    for a, b in zip(with_pixels, without):
        for x, y in zip(a.micro_batches, b.micro_batches):
            assert y.pixel_values.shape[0] == 0 and x.pixel_values.shape[0] > 0 or x.num_images == 0
            for name in ("tokens", "labels", "positions", "cu_seqlens", "image_token_index", "sample_ids"):
                assert torch.equal(getattr(x, name), getattr(y, name)), name
            assert x.image_grids == y.image_grids and x.image_spans == y.image_spans
    assert reads and not any(reads)  # rows were read, never with their images


class _Spy:
    """A store that records whether each ``rows`` call asked for images."""

    def __init__(self, store, reads):
        self._store, self._reads = store, reads

    def rows(self, indices, *, images=True):
        self._reads.append(images)
        return self._store.rows(indices, images=images)


def test_unreadable_images_are_named_or_skipped_and_counted(tmp_path, muse, tok):
    bad = write_bad_images(tmp_path / "bad")
    docs = tmp_path / "docs"
    docs.mkdir()
    table = pq.read_table(bad["bad_documents.parquet"])
    keep = [0, 3, 4, 5]  # ok, not_an_image, empty, huge (row 1, the length mismatch, and row 2, truncated, apart)
    pq.write_table(table.take(keep), docs / "part.parquet")
    with pytest.raises(ValueError, match=r"docs: row 1 \(counted from 0\), column 'images': sample id=1: embedded image "
                                         r"\(33 bytes\): not an image .*2 rows with unreadable images in all.*bad_images=skip"):
        open_dataset(docs, tokenizer=tok)
    store = open_dataset(docs, tokenizer=tok, bad_images="skip")
    assert [r for r, _ in store.skipped] == [1, 2] and "0 bytes" in store.skipped[1][1]
    assert len(store) == 2 and store.table.ids.tolist() == [0, 3]
    loader = DataLoaderConfig(data=docs, gbs=2, max_seq_len=SEQ, packing=PackingConfig(mbs=2, max_seq_len=SEQ), max_steps=1,
                              bad_images=BadImages.SKIP).build(muse, tokenizer=tok)
    (mb,) = next(iter(loader)).micro_batches
    assert sorted(mb.sample_ids.tolist()) == [0, 3]
    # the 8000 x 6000 image is resized into the pixel budget: 56 x 28 pixels, 2 x 4 patches, 2 tokens
    assert (2, 4) in mb.image_grids and all(gh * gw * 14 * 14 <= 3136 for gh, gw in mb.image_grids)


def test_a_truncated_image_is_named_when_decoded_or_kept_and_counted(tmp_path, muse, tok):
    bad = write_bad_images(tmp_path / "bad")
    docs = tmp_path / "docs"
    docs.mkdir()
    pq.write_table(pq.read_table(bad["bad_documents.parquet"]).take([0, 2]), docs / "part.parquet")
    cfg = DataLoaderConfig(data=docs, gbs=2, max_seq_len=SEQ, packing=PackingConfig(mbs=2, max_seq_len=SEQ), max_steps=1)
    with pytest.raises(ValueError, match=r"embedded image \(\d+ bytes\): cannot decode the image .*bad_images=skip"):
        next(iter(cfg.build(muse, tokenizer=tok)))
    batch = next(iter(dataclasses.replace(cfg, bad_images=BadImages.SKIP).build(muse, tokenizer=tok)))
    assert batch.damaged_images == 1 and sorted(batch.sample_ids[0]) == [0, 1]


def test_bad_rows_of_torchtitans_formats_are_named(tmp_path, tok):
    bad = write_bad_images(tmp_path / "bad")
    with pytest.raises(ValueError, match=r"bad_documents.parquet: row 1 \(counted from 0\), column 'texts': has 3 entries but 'images' "
                                         r"has 2"):
        open_dataset(bad["bad_documents.parquet"], tokenizer=tok)
    with pytest.raises(ValueError, match=r"row 5 \(counted from 0\), column 'jpg': has no image; an image-caption pair needs one"):
        open_dataset(bad["bad_pairs"], tokenizer=tok)
    docs = tmp_path / "placeholder"
    docs.mkdir()
    pq.write_table(pa.table({"texts": [["Look <image> here", None]], "images": [[None, b"x"]]}), docs / "p.parquet")
    with pytest.raises(ValueError, match=r"row 0 .*column 'texts': contains the string '<image>'"):
        open_dataset(docs, tokenizer=tok)


def test_missing_image_file_and_a_mix_without_content_are_named(tmp_path, tok):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "a <image> b", "images": ["gone.png"]}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl: row 0 .*column 'images': .*gone.png: no such image file"):
        open_dataset(tmp_path / "d.jsonl", tokenizer=tok)
    from pipetune.data import make_mix, write_dataset

    mix = tmp_path / "mix"
    write_dataset(make_mix("datamix1", 10, seed=0), mix / "generated", {"seed": 0})
    with pytest.raises(ValueError, match="needs text or token ids in every data set"):
        open_dataset(mix, tokenizer=tok)
