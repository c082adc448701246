"""A byte-level tokenizer for raw text rows, so user text works offline with no vocabulary file.

Token id = UTF-8 byte + ``BYTE_OFFSET`` (ids below it are reserved). Real training data should be
pre-tokenized into ``input_ids`` with the model's own tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

IMAGE_PLACEHOLDER = "<image>"
BYTE_OFFSET = 4
BYTE_VOCAB = 256 + BYTE_OFFSET


@dataclass(frozen=True)
class TextPieces:
    """Token ids of a text with its ``<image>`` placeholders removed, and where they were."""

    token_ids: list[int]
    image_offsets: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def split_on_images(text: str) -> TextPieces:
    ids: list[int] = []
    offsets: list[int] = []
    for k, chunk in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if k:
            offsets.append(len(ids))
        ids.extend(b + BYTE_OFFSET for b in chunk.encode("utf-8"))
    return TextPieces(ids, offsets)
