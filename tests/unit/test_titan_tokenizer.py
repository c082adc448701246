"""The TorchTitan dataloader tokenizes raw text with the job's tokenizer (a HuggingFace tokenizer
built offline here), in the metadata look-ahead and in the tensors alike."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from pipetune.config import load_model_config
from torchtitan_patches.data.micro_batch import IMAGE_TOKEN_ID
from torchtitan_patches.titan.dataloader import PipeTuneTitanDataLoader
from torchtitan_patches.titan.tokenizer import ByteTokenizer, text_encoder

TEXTS = [
    "the cat sat on the mat <image> and the dog ran",
    "a dog <image> saw <image> the cat",
    "the mat was red and the cat was not",
    "<image> a red dog",
]


@pytest.fixture()
def hf_tokenizer(tmp_path):
    words = sorted({w for t in TEXTS for w in t.replace("<image>", " ").split()})
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"unk_token": "[UNK]"}))
    return HuggingFaceTokenizer(tokenizer_path=str(tmp_path))


def test_raw_text_is_tokenized_with_the_jobs_tokenizer(tmp_path, hf_tokenizer):
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps({"id": i, "text": t}) for i, t in enumerate(TEXTS)))
    model = load_model_config("tiny")
    loader = PipeTuneTitanDataLoader.Config(dataset_path=str(data), gbs=4).build(seq_len=256, tokenizer=hf_tokenizer)
    inner = loader.bind(model, packing_source=None)
    encode = text_encoder(hf_tokenizer)
    expected = {}
    for i, text in enumerate(TEXTS):
        chunks = [encode(c) for c in text.split("<image>")]
        doc = chunks[0]
        for c in chunks[1:]:
            doc = doc + [IMAGE_TOKEN_ID] * model.tokens_per_image + c
        expected[i] = doc
        assert 0 < len(chunks[0]) + sum(map(len, chunks[1:])) < len(text.encode())  # words, not bytes
    meta = inner.meta(0)
    for k, sid in enumerate(meta.table.ids.tolist()):
        assert meta.table.text_tokens[k] == sum(len(encode(c)) for c in TEXTS[sid].split("<image>"))
    batch = next(iter(loader))
    seen = {}
    for mb in batch.micro_batches:
        bounds = mb.cu_seqlens.tolist()
        for sid, a, b in zip(mb.sample_ids.tolist(), bounds[:-1], bounds[1:]):
            seen[sid] = mb.tokens[a:b].tolist()
    assert seen == expected


def test_byte_tokenizer_keeps_pipetunes_byte_ids():
    assert text_encoder(ByteTokenizer()) is None
    assert ByteTokenizer().decode(ByteTokenizer().encode("héllo")) == "héllo"
    assert np.max(ByteTokenizer().encode("ÿ")) < ByteTokenizer().get_vocab_size()
