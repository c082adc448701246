"""The TorchTitan dataloader tokenizes raw text with the job's tokenizer (a HuggingFace tokenizer
built offline here), in the metadata look-ahead and in the tensors alike, with the tokenizer's own
image, vision start/end and BOS/EOS tokens."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from pipetune.config import load_model_config
from torchtitan_patches.data.micro_batch import IGNORE_INDEX
from torchtitan_patches.titan.dataloader import PipeTuneTitanDataLoader
from torchtitan_patches.titan.fixed_shape_loader import FixedShapeDataLoader
from torchtitan_patches.titan.tokenizer import VISION_TOKENS, ByteTokenizer, text_tokenizer

TEXTS = [
    "the cat sat on the mat <image> and the dog ran",
    "a dog <image> saw <image> the cat",
    "the mat was red and the cat was not",
    "<image> a red dog",
    "Look! <image> A cat! <image>",  # "!" is id 0, the old image id
]
SPECIALS = ["<s>", "</s>", *VISION_TOKENS.values()]


def _tokenizer(path, specials=SPECIALS) -> HuggingFaceTokenizer:
    words = sorted({w for t in TEXTS for w in t.replace("<image>", " ").replace("!", " ").split()})
    vocab = {"!": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    path.mkdir(exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"unk_token": "[UNK]", **({"bos_token": "<s>", "eos_token": "</s>"} if "<s>" in specials else {})}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return HuggingFaceTokenizer(tokenizer_path=str(path))


@pytest.fixture()
def hf_tokenizer(tmp_path):
    return _tokenizer(tmp_path / "tok")


@pytest.fixture()
def rows(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps({"id": i, "text": t}) for i, t in enumerate(TEXTS)))
    return data


def _documents(mb) -> dict[int, tuple[int, int]]:
    bounds = mb.cu_seqlens.tolist()
    return {sid: (a, b) for sid, a, b in zip(mb.sample_ids.tolist(), bounds[:-1], bounds[1:])}


def test_raw_text_is_tokenized_with_the_jobs_tokenizer(rows, hf_tokenizer):
    model = load_model_config("tiny")
    loader = PipeTuneTitanDataLoader.Config(dataset_path=str(rows), gbs=len(TEXTS), num_workers=0).build(seq_len=256, tokenizer=hf_tokenizer)
    inner = loader.bind(model, packing_source=None)
    tok = text_tokenizer(hf_tokenizer)
    assert (tok.image, tok.vision_start, tok.vision_end) == tuple(hf_tokenizer.token_to_id(VISION_TOKENS[k]) for k in ("image", "vision_start", "vision_end"))
    assert (tok.bos, tok.eos) == (hf_tokenizer.token_to_id("<s>"), hf_tokenizer.token_to_id("</s>"))
    image = [tok.vision_start] + [tok.image] * model.tokens_per_image + [tok.vision_end]
    expected = {}
    for i, text in enumerate(TEXTS):
        chunks = [tok.encode(c) for c in text.split("<image>")]
        assert 0 < sum(map(len, chunks)) < len(text.encode())  # words, not bytes
        expected[i] = [tok.bos] + [t for k, c in enumerate(chunks) for t in (image if k else []) + c] + [tok.eos]
    table = inner.meta(0).table
    assert dict(zip(table.ids.tolist(), table.lengths.tolist())) == {i: len(d) for i, d in expected.items()}
    seen, batch = {}, next(iter(loader))
    for mb in batch.micro_batches:
        for sid, (a, b) in _documents(mb).items():
            seen[sid] = mb.tokens[a:b].tolist()
    assert seen == expected


def test_every_sample_holds_its_images_tokens_bracketed_and_unlabelled(rows, hf_tokenizer):
    """Image-token count = images x tokens per image, start/end around each run, the image index on
    the image ids, no label on an image token or marker, metadata lengths = content lengths; the
    stock loader hands TorchTitan's forward the same image id (the old id 0 is "!" here)."""
    model = load_model_config("tiny")
    tok, tpi = text_tokenizer(hf_tokenizer), model.tokens_per_image
    loader = PipeTuneTitanDataLoader.Config(dataset_path=str(rows), gbs=len(TEXTS), seed=3, num_workers=0).build(seq_len=256, tokenizer=hf_tokenizer)
    inner = loader.bind(model, packing_source=None)
    table, batch = inner.meta(0).table, next(iter(loader))
    meta = {int(s): (int(n), int(k)) for s, n, k in zip(table.ids, table.lengths, table.num_images)}
    assert sum(k for _, k in meta.values()) == sum(t.count("<image>") for t in TEXTS)
    for mb in batch.micro_batches:
        assert (mb.tokens[mb.image_token_index] == tok.image).all()
        assert not np.isin(mb.labels.numpy(), tok.not_text).any()
        for sid, (a, b) in _documents(mb).items():
            doc, n_img = mb.tokens[a:b].numpy(), meta[sid][1]
            assert b - a == meta[sid][0]
            assert doc[0] == tok.bos and doc[-1] == tok.eos and (doc == 0).sum() == TEXTS[sid].count("!")
            assert (doc == tok.image).sum() == n_img * tpi
            starts, ends = np.flatnonzero(doc == tok.vision_start), np.flatnonzero(doc == tok.vision_end)
            assert len(starts) == len(ends) == n_img and (ends - starts == tpi + 1).all()
            assert all((doc[s + 1 : s + 1 + tpi] == tok.image).all() for s in starts)
    assert sum(mb.num_label_tokens for mb in batch.micro_batches) == int(table.label_tokens.sum())

    stock = FixedShapeDataLoader(FixedShapeDataLoader.Config(dataset_path=str(rows), gbs=len(TEXTS), rows_per_step=1, num_workers=0),
                                 tokenizer=hf_tokenizer, seq_len=256, local_batch_size=1)
    stock.bind(model)
    inputs, labels = next(iter(stock))
    assert inputs["special_tokens"] == {"image_id": tok.image}
    assert int((inputs["input"] == tok.image).sum()) == inputs["grid_thw"].shape[0] * tpi
    assert not torch.isin(labels, torch.tensor(tok.not_text)).any() and (labels[inputs["input"] == tok.pad] == IGNORE_INDEX).all()


def test_a_tokenizer_without_image_tokens_is_refused_at_build(tmp_path, rows):
    plain = _tokenizer(tmp_path / "plain", specials=["<s>", "</s>"])
    with pytest.raises(ValueError, match=r"the tokenizer at '.*plain' has no <\|image_pad\|>, <\|vision_start\|>.*add them as special tokens"):
        text_tokenizer(plain)
    with pytest.raises(ValueError, match=r"has no <\|image_pad\|>"):  # when TorchTitan builds the loader, before the model
        PipeTuneTitanDataLoader.Config(dataset_path=str(rows), gbs=2, num_workers=0).build(seq_len=256, tokenizer=plain)


def test_more_placeholders_than_images_names_the_row(tmp_path, hf_tokenizer):
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps({"id": 7 + i, "text": t, "num_images": 1}) for i, t in enumerate(TEXTS[:2])))
    with pytest.raises(ValueError, match=r"rows\.jsonl: row 1 \(counted from 0\), column 'text': sample id=8 has 2 <image> placeholders but 1 images"):
        PipeTuneTitanDataLoader.Config(dataset_path=str(data), gbs=2, num_workers=0).build(seq_len=256, tokenizer=hf_tokenizer)


def test_text_holding_a_special_token_string_is_named(tmp_path, hf_tokenizer):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"text": "a cat <|image_pad|> a dog"}))
    with pytest.raises(ValueError, match=r"row 0 .*encodes to the image or vision marker id"):
        PipeTuneTitanDataLoader.Config(dataset_path=str(data), gbs=1, num_workers=0).build(seq_len=256, tokenizer=hf_tokenizer)


def test_byte_tokenizer_keeps_pipetunes_reserved_ids():
    tok = text_tokenizer(ByteTokenizer())
    assert (tok.image, tok.pad, tok.vision_start, tok.vision_end, tok.bos, tok.eos) == (0, 1, 2, 3, None, None)
    assert text_tokenizer(None) is tok
    assert ByteTokenizer().decode(ByteTokenizer().encode("héllo")) == "héllo"
    assert np.max(ByteTokenizer().encode("ÿ")) < ByteTokenizer().get_vocab_size()


def test_content_that_disagrees_with_the_metadata_names_the_rows(rows):
    from pipetune.data.text import BYTE_TOKENIZER
    from pipetune.packing import PackingConfig
    from torchtitan_patches.data import DataLoaderConfig

    drift = [0]
    tok = dataclasses.replace(BYTE_TOKENIZER, name="drifting", encode=lambda text: [10] * (len(text) // 4 + 1 + drift[0]))
    cfg = DataLoaderConfig(data=rows, gbs=len(TEXTS), max_seq_len=256, packing=PackingConfig(max_seq_len=256), max_steps=1)
    loader = cfg.build(load_model_config("tiny"), tokenizer=tok)
    drift[0] = -1  # the content's tokenizer now disagrees with the metadata look-ahead's
    with pytest.raises(ValueError, match=r"sample id=\d+: its content has \d+ text tokens, the metadata look-ahead counted \d+"):
        next(iter(loader))
