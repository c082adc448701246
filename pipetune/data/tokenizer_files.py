"""The job's HuggingFace tokenizer read from its files without torch, as the ``TextTokenizer`` that
the runtime's ``text_tokenizer(HuggingFaceTokenizer(path))`` gives for the same files: the same
encodings, special ids, vocabulary size and so ``fingerprint``. The command line counts raw text
in the job's tokens with it, and a metadata index it builds is one the job accepts.

It reads what TorchTitan 0.3.0's ``HuggingFaceTokenizer`` reads, and as it does: ``tokenizer.json``,
then the special tokens that ``tokenizer_config.json`` names (its ``*_token`` keys and
``added_tokens_decoder``) added to it; BOS/EOS are the config's ``bos_token``/``eos_token``.
``special_tokens_map.json`` is not read (TorchTitan does not read it). A bare ``tokenizer.json``
reads as a folder holding only that file does for TorchTitan: no config, so no BOS/EOS.
TorchTitan's fallback to ``vocab.json``/``merges.txt`` is not supported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipetune.data.inputs import first_line
from pipetune.data.text import TextTokenizer, vision_token_ids

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
_STANDARD_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")
"""The ``tokenizer_config.json`` keys whose tokens TorchTitan adds as special tokens."""
_WANTED = "give the job's HuggingFace tokenizer folder (tokenizer.json, tokenizer_config.json) or a tokenizer.json"

_LOADED: dict[str, object] = {}
"""``tokenizers.Tokenizer`` by resolved path: ``load_tokenizer`` reads the files afresh, a worker
process that unpickled an encoder reads them once."""


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """The HuggingFace tokenizer at ``path`` (a folder or a ``tokenizer.json``) for raw text; a
    missing or unreadable one, or one without pipetune's image and padding tokens, is refused in one
    line naming the path."""
    name = f"the tokenizer at {str(path)!r}"  # as the runtime names it
    path = Path(path)
    tokenizer, bos, eos = _read(path)
    ids = vision_token_ids(name, tokenizer.token_to_id)
    _LOADED[key := str(path.resolve())] = tokenizer
    return TextTokenizer(name=name, encode=_Encode(key), vocab_size=tokenizer.get_vocab_size(), bos=bos, eos=eos, **ids)


@dataclass(frozen=True)
class _Encode:
    """A plain chunk's ids (no special tokens, as ``titan.tokenizer._encode_plain``): picklable, for
    loader workers, which get the path and read the tokenizer once per process."""

    path: str

    def __call__(self, text: str) -> list[int]:
        if (tokenizer := _LOADED.get(self.path)) is None:
            tokenizer = _LOADED.setdefault(self.path, _read(Path(self.path))[0])
        return tokenizer.encode(text, add_special_tokens=False).ids


def _read(path: Path):
    """``(tokenizers.Tokenizer with the config's special tokens added, bos id, eos id)``."""
    from tokenizers import Tokenizer

    if not path.exists():
        raise ValueError(f"tokenizer {path} does not exist; {_WANTED}")
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"tokenizer {path}: the folder has no {TOKENIZER_FILE}; {_WANTED} (a transformers tokenizer's "
                         "save_pretrained writes one)")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ValueError(f"tokenizer {file} is not a HuggingFace tokenizer.json ({first_line(e)}); {_WANTED}") from None
    config_file = path / CONFIG_FILE
    if not (path.is_dir() and config_file.is_file()):
        return tokenizer, None, None
    try:
        config = json.loads(config_file.read_text())
        bos, eos = _add_special_tokens(tokenizer, config)
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"tokenizer {config_file} is not a tokenizer config TorchTitan reads ({first_line(e)}); "
                         "fix it or remove it") from None
    return tokenizer, bos, eos


def _add_special_tokens(tokenizer, config: dict) -> tuple[int | None, int | None]:
    """TorchTitan's ``HuggingFaceTokenizer._infer_special_tokens``: add the config's special tokens
    to ``tokenizer`` and return the BOS and EOS ids it names."""
    from tokenizers import AddedToken

    def string(key: str) -> str | None:
        token = config.get(key)
        if isinstance(token, dict):
            if "content" not in token:
                raise ValueError(f"could not parse {key}")
            return token["content"]
        if token is not None and not isinstance(token, str):
            raise ValueError(f"could not parse {key}: expected a string or a dict")
        return token

    def added(content: str, entry) -> AddedToken:
        if isinstance(entry, dict) and (entry.get("__type") == "AddedToken" or "content" in entry):
            return AddedToken(content=content, single_word=entry.get("single_word", False), lstrip=entry.get("lstrip", False),
                              rstrip=entry.get("rstrip", False), normalized=entry.get("normalized", True),
                              special=entry.get("special", True))
        return AddedToken(content=content, special=True)

    if not config:
        return None, None
    tokens = [added(string(k), config[k]) for k in _STANDARD_KEYS if config.get(k) is not None]
    tokens += [added(e["content"], e) for e in config.get("added_tokens_decoder", {}).values()
               if isinstance(e, dict) and "content" in e]
    if tokens:
        tokenizer.add_special_tokens(tokens)
    bos, eos = string("bos_token"), string("eos_token")
    return (tokenizer.token_to_id(bos) if bos else None), (tokenizer.token_to_id(eos) if eos else None)
