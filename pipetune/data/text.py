"""How raw ``text`` rows become token ids: the tokenizer plus the ids the loader writes around them.

pipetune's own byte-level tokenizer works offline with no vocabulary file: token id = UTF-8 byte +
``BYTE_OFFSET``; the ids below it are reserved (0 image, 1 padding, 2/3 vision start/end). A job
with its own tokenizer passes a ``TextTokenizer`` built from it (``titan.tokenizer.text_tokenizer``;
the command line reads the same files without torch, ``pipetune.data.tokenizer_files``):
metadata and content are then tokenized with it; image placeholders split the text first, so the
tokenizer never sees them. Data can also be pre-tokenized into ``input_ids`` (taken as stored).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

IMAGE_PLACEHOLDER = "<image>"
_PROBE = "The quick brown fox jumps over the lazy dog; 0123456789, naïve café, 中文, \t tabs and  spaces."
BYTE_OFFSET = 4
BYTE_VOCAB = 256 + BYTE_OFFSET

VISION_TOKENS = {"image": "<|image_pad|>", "vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>",
                 "pad": "<|endoftext|>"}
"""TorchTitan's Muse Glimmer and Qwen3.5 special-token strings (``MUSE_GLIMMER_SPECIAL_TOKENS``): the
strings a HuggingFace tokenizer's image, vision start/end and padding ids are looked up by."""

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


@dataclass(frozen=True, kw_only=True)
class TextTokenizer:
    """A tokenizer for raw text (``encode``: a plain chunk, no special tokens) and its special ids.

    A raw-text document is ``bos, text, eos`` (each of BOS/EOS only if the tokenizer has it, as
    TorchTitan's text loaders add them); an image is ``vision_start, image x tokens_per_image,
    vision_end`` (the markers only if the tokenizer has them, both or neither). ``image`` is the
    id the model finds image positions by; ``pad`` fills the padding document. Pre-tokenized and
    generated rows get no BOS/EOS or markers (their ids are taken as they are).
    """

    name: str
    encode: TextEncoder
    vocab_size: int
    image: int
    pad: int
    vision_start: int | None = None
    vision_end: int | None = None
    bos: int | None = None
    eos: int | None = None

    def __post_init__(self) -> None:
        if (self.vision_start is None) != (self.vision_end is None):
            raise ValueError(f"{self.name}: vision start and end tokens come as a pair; it has only one")

    @property
    def image_markers(self) -> int:
        """Sequence positions an image takes besides its image tokens (its start/end markers)."""
        return 0 if self.vision_start is None else 2

    @property
    def not_text(self) -> tuple[int, ...]:
        """Ids that raw text must not encode to (the loader writes them; a text copy would shift images)."""
        return tuple(i for i in (self.image, self.vision_start, self.vision_end) if i is not None)

    @property
    def fingerprint(self) -> str:
        """Tells tokenizers apart (metadata caches and indexes): vocabulary size, special ids and the
        ids of a probe text (a tokenizer file changed in place changes them). Not the name: the
        command line's loader and the job's tokenizer of the same files name them differently."""
        probe = self.encode(_PROBE)
        ids = (self.image, self.pad, self.vision_start, self.vision_end, self.bos, self.eos)
        return hashlib.sha256(repr((self.vocab_size, ids, probe)).encode()).hexdigest()[:16]

    def split(self, text: str) -> TextPieces:
        """Token ids of ``text`` (with BOS/EOS) chunk by chunk between image placeholders."""
        ids = [] if self.bos is None else [self.bos]
        offsets: list[int] = []
        for k, chunk in enumerate(text.split(IMAGE_PLACEHOLDER)):
            if k:
                offsets.append(len(ids))
            ids.extend(self.encode(chunk))
        if self.eos is not None:
            ids.append(self.eos)
        return TextPieces(ids, offsets)


def vision_token_ids(name: str, token_to_id: Callable[[str], int | None], *, other_way: str = "") -> dict[str, int]:
    """The image, vision start/end and padding ids of a tokenizer, looked up by ``VISION_TOKENS``;
    refused in one line naming the missing strings (``other_way``: a further remedy the caller has)."""
    ids = {k: token_to_id(s) for k, s in VISION_TOKENS.items()}
    if missing := [VISION_TOKENS[k] for k, i in ids.items() if i is None]:
        raise ValueError(
            f"{name} has no {', '.join(missing)} token(s), which pipetune writes for images and padding as "
            f"TorchTitan's Muse Glimmer does; add them as special tokens to the tokenizer (tokenizer_config.json "
            f"added_tokens_decoder){other_way}")
    return ids


BYTE_TOKENIZER = TextTokenizer(name="pipetune's byte tokenizer", encode=byte_encode, vocab_size=BYTE_VOCAB,
                               image=0, pad=1, vision_start=2, vision_end=3)

