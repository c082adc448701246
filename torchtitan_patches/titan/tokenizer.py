"""pipetune's byte-level tokenizer (``pipetune.data.text``) as a TorchTitan ``BaseTokenizer``.

A TorchTitan job always builds a tokenizer; the HuggingFace one needs vocabulary files that an
offline machine may not have. pipetune's data path tokenizes raw ``text`` rows byte by byte, so a
job on such data (or on generated data, whose ids are synthetic) names this one. Data tokenized
with another vocabulary belongs in the data set's ``input_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.components.tokenizer import BaseTokenizer

from pipetune.data.text import BYTE_OFFSET, BYTE_VOCAB, split_on_images


class ByteTokenizer(BaseTokenizer):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, **kwargs):
        super().__init__()

    def encode(self, text: str, **kwargs) -> list[int]:
        return split_on_images(text).token_ids

    def decode(self, ids, **kwargs) -> str:
        return bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return BYTE_VOCAB
