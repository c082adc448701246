"""pipetune's byte-level tokenizer (``pipetune.data.text``) as a TorchTitan ``BaseTokenizer``.

A TorchTitan job always builds a tokenizer; the HuggingFace one needs vocabulary files that an
offline machine may not have. pipetune's data path tokenizes raw ``text`` rows byte by byte unless
the job names another tokenizer: ``text_encoder`` gives the dataloader the job's tokenizer (e.g.
TorchTitan's ``HuggingFaceTokenizer``) for raw text, without BOS/EOS (documents are packed, and
their boundaries are kept by the per-document positions). Generated data keeps synthetic ids.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torchtitan.components.tokenizer import BaseTokenizer

from pipetune.data.text import BYTE_OFFSET, BYTE_VOCAB, TextEncoder, byte_encode


class ByteTokenizer(BaseTokenizer):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, **kwargs):
        super().__init__()

    def encode(self, text: str, **kwargs) -> list[int]:
        return byte_encode(text)

    def decode(self, ids, **kwargs) -> str:
        return bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return BYTE_VOCAB


def _encode_plain(tokenizer: BaseTokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_bos=False, add_eos=False)


def text_encoder(tokenizer: BaseTokenizer | None) -> TextEncoder | None:
    """What tokenizes raw text for the job: ``None`` (pipetune's byte tokenizer) or the job's own."""
    if tokenizer is None or isinstance(tokenizer, ByteTokenizer):
        return None
    return functools.partial(_encode_plain, tokenizer)
