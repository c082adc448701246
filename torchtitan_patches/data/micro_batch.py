"""Tensors of packed micro-batches, built from sample metadata plus content (real or synthesized)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from pipetune.data.samples import OverlongReport, SampleTable
from pipetune.data.text import BYTE_OFFSET, BYTE_TOKENIZER, TextTokenizer

IGNORE_INDEX = -100
IMAGE_TOKEN_ID = BYTE_TOKENIZER.image
PAD_TOKEN_ID = BYTE_TOKENIZER.pad
"""The image and padding ids of pipetune's byte tokenizer (the default): reserved ids that
generated text never uses. A job's own tokenizer brings its own (``ContentSpec.tokenizer``)."""


@dataclass
class PackedMicroBatch:
    """One packed sequence of several documents (batch dimension 1, as varlen attention wants).

    ``image_token_index`` lists, image by image, the positions of each image's tokens in the
    sequence (which hold the tokenizer's image id); stage 0 scatters the projected image features
    there. ``labels`` are next-token targets within each document (``-100`` where nothing is to be
    predicted: where the next token is an image token, a vision marker or padding).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    pixel_values: torch.Tensor
    image_token_index: torch.Tensor
    sample_ids: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_images(self) -> int:
        return int(self.pixel_values.shape[0])

    @property
    def num_label_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def image_spans(self) -> tuple[tuple[int, int], ...]:
        """``(start, length)`` of every run of consecutive image-token positions, in order: where
        stage 0 writes the image features, read on the host before a step (a device-side search
        for them, as TorchTitan's ``_vision_spans`` does, syncs the device every forward)."""
        idx = self.image_token_index.numpy()
        runs = np.split(idx, np.flatnonzero(np.diff(idx) != 1) + 1) if idx.size else []
        return tuple((int(r[0]), len(r)) for r in runs)

    def to(self, device) -> "PackedMicroBatch":
        return PackedMicroBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def equal(self, other: "PackedMicroBatch") -> bool:
        return all(torch.equal(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))


@dataclass
class GlobalBatch:
    """One training step's data: micro-batches in the packing's order, plus the loss normaliser
    ``num_label_tokens``, the label tokens of the whole global batch. With data parallelism the
    micro-batches are one replica's share and the normaliser still counts every replica's tokens,
    so the replicas' summed gradients are the global batch's (PipeTune App. A.2).

    ``overlong`` says which samples the overlong policy cut or left out of the global batch.
    """

    step: int
    micro_batches: list[PackedMicroBatch]
    num_label_tokens: int
    overlong: OverlongReport

    @property
    def sample_ids(self) -> list[list[int]]:
        return [mb.sample_ids.tolist() for mb in self.micro_batches]


@dataclass(frozen=True, kw_only=True)
class ContentSpec:
    """What the tensors need beyond metadata: vocabulary, image shape, where content comes from and
    the tokenizer of raw text and special ids (it must be the one the metadata used)."""

    vocab_size: int
    image_size: int
    channels: int
    content_seed: int
    data_dir: Path | None = None
    tokenizer: TextTokenizer = BYTE_TOKENIZER
    seq_multiple: int = 1
    """Every micro-batch's length is a multiple of this (tensor parallelism with sequence
    parallelism splits the sequence over its ranks): a padding document makes up the rest."""


def synthetic_tokens(seed: int, sample_id: int, n: int, vocab_size: int) -> np.ndarray:
    """A learnable synthetic text: each token is the previous one + 7 (mod vocab), 10 % random."""
    rng = np.random.default_rng([seed, sample_id, 0])
    span = vocab_size - BYTE_OFFSET
    out = (int(rng.integers(span)) + 7 * np.arange(n, dtype=np.int64)) % span
    noise = rng.random(n) < 0.1
    out[noise] = rng.integers(span, size=int(noise.sum()))
    return out + BYTE_OFFSET


def synthetic_pixels(seed: int, sample_id: int, n: int, channels: int, size: int) -> np.ndarray:
    rng = np.random.default_rng([seed, sample_id, 1])
    return rng.standard_normal((n, channels, size, size), dtype=np.float32)


def _load_image(path: Path, channels: int, size: int) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB" if channels == 3 else "L").resize((size, size))
        arr = np.asarray(im, dtype=np.float32) / 127.5 - 1.0
    return arr.reshape(size, size, channels).transpose(2, 0, 1)


def sample_content(table: SampleTable, k: int, row: dict, spec: ContentSpec) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (kept prefix after truncation) and pixels of batch row ``k``."""
    sid = int(table.ids[k])
    n_text, n_img = int(table.text_tokens[k]), int(table.num_images[k])
    if "input_ids" in row:
        ids = np.asarray(row["input_ids"], dtype=np.int64)[:n_text]
    elif "text" in row:
        ids = np.asarray(spec.tokenizer.split(row["text"]).token_ids, dtype=np.int64)[:n_text]
    else:
        ids = synthetic_tokens(spec.content_seed, sid, n_text, spec.vocab_size)
        image = spec.tokenizer.image
        ids[ids == image] = (image + 1) % spec.vocab_size  # a tokenizer's image id may lie in the synthetic range
    if len(ids) < n_text:
        raise ValueError(f"sample id={sid}: its content has {len(ids)} text tokens, the metadata look-ahead counted {n_text}; "
                         "tokenize the metadata and the content with the same tokenizer")
    if row.get("images"):
        if spec.data_dir is None:
            raise ValueError(f"sample id={sid} refers to image files but the data set has no directory")
        pixels = np.stack([_load_image(spec.data_dir / p, spec.channels, spec.image_size) for p in row["images"][:n_img]])
    else:
        pixels = synthetic_pixels(spec.content_seed, sid, n_img, spec.channels, spec.image_size)
    return ids, pixels


def build_micro_batch(table: SampleTable, group: np.ndarray, contents: list[tuple[np.ndarray, np.ndarray]], spec: ContentSpec) -> PackedMicroBatch:
    """Concatenate the documents of ``group`` (rows of ``table``), images (with their markers, if
    the table has them) at their text offsets."""
    tok = spec.tokenizer
    marked = table.image_markers > 0
    tokens, labels, positions, image_index, pixels, doc_lens = [], [], [], [], [], []
    start = 0
    for k, (ids, pix) in zip(group.tolist(), contents):
        tpi = int(table.tokens_per_image[k])
        block = np.full(tpi + table.image_markers, tok.image, np.int64)
        if marked:
            block[0], block[-1] = tok.vision_start, tok.vision_end
        offsets = table.offsets_of(k)
        pieces, is_text = [], []
        prev = 0
        for j, off in enumerate(offsets.tolist()):
            pieces.append(ids[prev:off])
            is_text.append(np.ones(off - prev, bool))
            # off text tokens and j image blocks precede it
            image_index.append(start + off + j * len(block) + int(marked) + np.arange(tpi))
            pieces.append(block)
            is_text.append(np.zeros(len(block), bool))
            prev = off
        pieces.append(ids[prev:])
        is_text.append(np.ones(len(ids) - prev, bool))
        doc = np.concatenate(pieces)
        text_mask = np.concatenate(is_text)
        lab = np.full(len(doc), IGNORE_INDEX, np.int64)
        nxt_text = text_mask[1:]
        lab[:-1][nxt_text] = doc[1:][nxt_text]
        tokens.append(doc)
        labels.append(lab)
        positions.append(np.arange(len(doc)))
        pixels.append(pix)
        doc_lens.append(len(doc))
        start += len(doc)
    pad = -start % spec.seq_multiple
    if pad:  # its own document (attends to nothing else) without labels: no loss, no gradient
        tokens.append(np.full(pad, tok.pad, np.int64))
        labels.append(np.full(pad, IGNORE_INDEX, np.int64))
        positions.append(np.arange(pad))
        doc_lens.append(pad)
    cu = np.zeros(len(doc_lens) + 1, np.int32)
    np.cumsum(doc_lens, out=cu[1:])
    c, s = spec.channels, spec.image_size
    return PackedMicroBatch(
        tokens=torch.from_numpy(np.concatenate(tokens)),
        labels=torch.from_numpy(np.concatenate(labels)),
        positions=torch.from_numpy(np.concatenate(positions)),
        cu_seqlens=torch.from_numpy(cu),
        pixel_values=torch.from_numpy(np.concatenate(pixels) if pixels else np.zeros((0, c, s, s), np.float32)),
        image_token_index=torch.from_numpy(np.concatenate(image_index) if image_index else np.zeros(0, np.int64)),
        sample_ids=torch.from_numpy(table.ids[group].copy()),
    )
