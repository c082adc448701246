"""A byte-level tokenizer for raw text rows, so user text works offline with no vocabulary file.

Token id = UTF-8 byte + ``BYTE_OFFSET`` (ids below it are reserved). A job with its own tokenizer
passes its ``encode`` (a ``TextEncoder``) instead: metadata and content are then tokenized with it,
image placeholders still split the text first, so the tokenizer never sees them. Data can also be
pre-tokenized into ``input_ids``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

IMAGE_PLACEHOLDER = "<image>"
BYTE_OFFSET = 4
BYTE_VOCAB = 256 + BYTE_OFFSET

TextEncoder = Callable[[str], list[int]]


@dataclass(frozen=True)
class TextPieces:
    """Token ids of a text with its ``<image>`` placeholders removed, and where they were."""

    token_ids: list[int]
    image_offsets: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def byte_encode(text: str) -> list[int]:
    return [b + BYTE_OFFSET for b in text.encode("utf-8")]


def split_on_images(text: str, encode: TextEncoder | None = None) -> TextPieces:
    """Token ids of ``text`` (``encode``, default bytes) chunk by chunk between image placeholders."""
    encode = encode or byte_encode
    ids: list[int] = []
    offsets: list[int] = []
    for k, chunk in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if k:
            offsets.append(len(ids))
        ids.extend(encode(chunk))
    return TextPieces(ids, offsets)
