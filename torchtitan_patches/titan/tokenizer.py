"""pipetune's byte-level tokenizer (``pipetune.data.text``) as a TorchTitan ``BaseTokenizer``, and
the job's tokenizer as the ``TextTokenizer`` of pipetune's data path.

A TorchTitan job always builds a tokenizer; the HuggingFace one needs vocabulary files that an
offline machine may not have. pipetune's data path tokenizes raw ``text`` rows byte by byte unless
the job names another tokenizer: ``text_tokenizer`` then gives the dataloader the job's tokenizer
(TorchTitan's ``HuggingFaceTokenizer`` or ``MultiModalTokenizer``) with its special ids, found as
TorchTitan's multimodal data path finds them: the image placeholder and vision start/end tokens
(TorchTitan's ``MultiModalTokenizer`` ids, else the Muse Glimmer / Qwen strings of ``VISION_TOKENS``
looked up in the vocabulary), BOS/EOS as the tokenizer defines them. Generated data keeps synthetic
ids. The command line reads the same files without torch (``pipetune.data.tokenizer_files``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torchtitan.components.tokenizer import BaseTokenizer, HuggingFaceTokenizer, MultiModalTokenizer

from pipetune.data.text import (BYTE_OFFSET, BYTE_TOKENIZER, BYTE_VOCAB, VISION_TOKENS, TextTokenizer, byte_encode,
                                vision_token_ids)


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


def _encode_plain(tokenizer: HuggingFaceTokenizer, text: str) -> list[int]:
    # the underlying tokenizer without its post-processor: no BOS per chunk of a document
    return tokenizer.tokenizer.encode(text, add_special_tokens=False).ids


def text_tokenizer(tokenizer: BaseTokenizer | None) -> TextTokenizer:
    """What tokenizes raw text for the job, with its special ids: pipetune's byte tokenizer for
    ``None``/``ByteTokenizer``, else the job's HuggingFace tokenizer. One that lacks an image,
    vision start/end or padding token is refused here, at job build, naming the token."""
    if tokenizer is None or isinstance(tokenizer, ByteTokenizer):
        return BYTE_TOKENIZER
    if not isinstance(tokenizer, HuggingFaceTokenizer):
        raise TypeError(f"pipetune tokenizes raw text with TorchTitan's HuggingFaceTokenizer or its own ByteTokenizer, "
                        f"not {type(tokenizer).__name__}")
    name = f"the tokenizer at {tokenizer.tokenizer_path!r}"
    if isinstance(tokenizer, MultiModalTokenizer):  # TorchTitan checked its configured strings at build
        ids = {k: getattr(tokenizer, f"{k}_id") for k in VISION_TOKENS}
    else:
        ids = vision_token_ids(name, tokenizer.token_to_id, other_way=(
            ", or name the tokens it has with TorchTitan's MultiModalTokenizer.Config (image_token, vision_start_token, "
            "vision_end_token, pad_token) as the job's tokenizer"))
    return TextTokenizer(name=name, encode=functools.partial(_encode_plain, tokenizer), vocab_size=tokenizer.get_vocab_size(),
                         bos=tokenizer.bos_id, eos=tokenizer.eos_id, **ids)
