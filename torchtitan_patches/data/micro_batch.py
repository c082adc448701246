"""Tensors of packed micro-batches, built from sample metadata plus content (real or synthesized).

Images are decoded with Pillow (torchvision, which TorchTitan's ``process_image`` uses, does not
load beside the CPU torch build here), resized to their patch grid (``pipetune.data.images``:
aspect kept, pixel budget) with bicubic filtering, normalised to [-1, 1] (TorchTitan's mean and std
of 0.5) and cut into patches in Qwen-VL's layout, which Muse Glimmer's ``conv1`` reads: ``patch_
temporal`` copies of a still image, each patch flattened channel-major, patches in raster order.
A micro-batch holds its images' patches flat, ``(sum of patches, patch_dim)``, images sorted by
grid so that images of one grid form one batched encoder call.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from pipetune.data.image_files import BadImages, describe
from pipetune.data.images import ImageSizing
from pipetune.data.samples import OverlongReport, SampleTable
from pipetune.data.text import BYTE_OFFSET, BYTE_TOKENIZER, TextTokenizer

IGNORE_INDEX = -100
IMAGE_TOKEN_ID = BYTE_TOKENIZER.image
PAD_TOKEN_ID = BYTE_TOKENIZER.pad
"""The image and padding ids of pipetune's byte tokenizer (the default): reserved ids that
generated text never uses. A job's own tokenizer brings its own (``ContentSpec.tokenizer``)."""


class ImageSpan(NamedTuple):
    """One image's run of tokens in a packed sequence, and its patch grid ``(h, w)``."""

    start: int
    length: int
    grid: tuple[int, int]


@dataclass
class PackedMicroBatch:
    """One packed sequence of several documents (batch dimension 1, as varlen attention wants).

    ``pixel_values`` are the images' patches ``(sum of patches, patch_dim)``, image by image in
    the order of ``image_grids`` (patches per side ``(h, w)`` of each, known on the host);
    ``image_token_index`` lists, in the same image order, the positions of each image's tokens in
    the sequence (which hold the tokenizer's image id); stage 0 scatters the projected image
    features there. ``labels`` are next-token targets within each document (``-100`` where nothing
    is to be predicted: where the next token is an image token, a vision marker or padding).
    ``pixel_values`` is empty (no rows) where the batch was built without pixels (a rank that runs
    no encoder); everything else is the same on every rank.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    pixel_values: torch.Tensor
    image_token_index: torch.Tensor
    sample_ids: torch.Tensor
    image_grids: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_images(self) -> int:
        return len(self.image_grids)

    def patch_rows(self, first: int, n: int) -> slice:
        """The rows of ``pixel_values`` that hold images ``first .. first + n - 1``."""
        sizes = [h * w for h, w in self.image_grids]
        start = sum(sizes[:first])
        return slice(start, start + sum(sizes[first:first + n]))

    @property
    def num_label_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def image_spans(self) -> tuple[ImageSpan, ...]:
        """Each image's tokens in the sequence, in feature order: where stage 0 writes the image
        features, read on the host before a step (a device-side search for them, as TorchTitan's
        ``_vision_spans`` does, syncs the device every forward)."""
        idx = self.image_token_index.numpy()
        if not len(idx):
            return ()
        per_token = sum(h * w for h, w in self.image_grids) // len(idx)  # patches per token: the encoder's merge, squared
        spans, at = [], 0
        for h, w in self.image_grids:
            spans.append(ImageSpan(int(idx[at]), h * w // per_token, (h, w)))
            at += h * w // per_token
        return tuple(spans)

    def to(self, device) -> "PackedMicroBatch":
        return PackedMicroBatch(**{f.name: _to(getattr(self, f.name), device) for f in fields(self)})

    def equal(self, other: "PackedMicroBatch") -> bool:
        return all(_same(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


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
    damaged_images: int = 0
    """Images whose data was cut short after a readable header, kept as far as readable
    (``decode_image``, under ``BadImages.SKIP``)."""

    @property
    def sample_ids(self) -> list[list[int]]:
        return [mb.sample_ids.tolist() for mb in self.micro_batches]


@dataclass(frozen=True, kw_only=True)
class ContentSpec:
    """What the tensors need beyond metadata: vocabulary, image sizing and patch layout, where
    content comes from and the tokenizer of raw text and special ids (it must be the one the
    metadata used). ``pixels=False`` builds batches without pixels (ranks that run no encoder)."""

    vocab_size: int
    sizing: ImageSizing | None
    channels: int
    content_seed: int
    patch_temporal: int = 1
    data_dir: Path | None = None
    tokenizer: TextTokenizer = BYTE_TOKENIZER
    seq_multiple: int = 1
    """Every micro-batch's length is a multiple of this (tensor parallelism with sequence
    parallelism splits the sequence over its ranks): a padding document makes up the rest."""
    pixels: bool = True
    bad_images: BadImages = BadImages.ERROR

    @property
    def patch_dim(self) -> int:
        p = self.sizing.patch_size if self.sizing else 1
        return self.channels * self.patch_temporal * p * p


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


def patchify(image: np.ndarray, patch: int, temporal: int) -> np.ndarray:
    """``(C, H, W)`` -> ``(H / patch * W / patch, C * temporal * patch ** 2)`` patches."""
    c, h, w = image.shape
    x = image.reshape(c, h // patch, patch, w // patch, patch).transpose(1, 3, 0, 2, 4)
    x = np.broadcast_to(x[:, :, :, None], (h // patch, w // patch, c, temporal, patch, patch))
    return np.ascontiguousarray(x).reshape(-1, c * temporal * patch * patch)


def decode_image(ref, base: Path, height: int, width: int, channels: int, policy: BadImages) -> tuple[np.ndarray, bool]:
    """Pixels ``(C, height, width)`` in [-1, 1] of an image (file name under ``base``, or bytes),
    and whether its data was damaged. The header was read when the data set was opened; data cut
    short after it is an error naming the image under ``BadImages.ERROR``, else the readable part
    is kept (Pillow fills the rest) and the image counted as damaged: every rank has planned with
    this sample, so leaving it out here would break the plan."""
    import io

    from PIL import Image, ImageFile

    def source():
        return base / ref if isinstance(ref, str) else io.BytesIO(ref)

    damaged = False
    try:
        with Image.open(source()) as im:
            im.draft(None, (width, height))  # a JPEG decodes at the smallest 1/2^k scale still covering the target: far less work
            im.load()
            rgb = im.convert("RGB" if channels == 3 else "L")
    except (OSError, SyntaxError) as e:
        if policy is BadImages.ERROR:
            raise ValueError(f"{describe(ref, base)}: cannot decode the image ({type(e).__name__}: {e}); repair or remove it, "
                             "or keep what can be read of damaged images (bad_images=skip)") from None
        ImageFile.LOAD_TRUNCATED_IMAGES = True
        try:
            with Image.open(source()) as im:
                rgb = im.convert("RGB" if channels == 3 else "L")
        finally:
            ImageFile.LOAD_TRUNCATED_IMAGES = False
        damaged = True
    if rgb.size != (width, height):
        rgb = rgb.resize((width, height), Image.Resampling.BICUBIC, reducing_gap=3.0)  # a box reduction first, then bicubic
    arr = np.asarray(rgb, dtype=np.float32)
    arr *= 1 / 127.5
    arr -= 1.0
    return arr.reshape(height, width, channels).transpose(2, 0, 1), damaged


def sample_content(table: SampleTable, k: int, row: dict, spec: ContentSpec, grids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], int]:
    """Token ids (kept prefix after truncation), the patches of each image of batch row ``k``
    (none when ``spec.pixels`` is False) and how many of its images were damaged; ``grids``: the
    patch grid of every image of ``table`` (``ContentSpec.sizing``)."""
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
    if not spec.pixels or n_img == 0:
        return ids, [], 0
    patch = spec.sizing.patch_size
    grids = grids[table.image_ptr[k]:table.image_ptr[k + 1]]
    if row.get("images"):
        if spec.data_dir is None:
            raise ValueError(f"sample id={sid} refers to image files but the data set has no directory")
        decoded = [decode_image(ref, spec.data_dir, gh * patch, gw * patch, spec.channels, spec.bad_images)
                   for ref, (gh, gw) in zip(row["images"][:n_img], grids.tolist())]
        images, damaged = [im for im, _ in decoded], sum(d for _, d in decoded)
    else:
        side = spec.sizing.standard_grid * patch
        images, damaged = list(synthetic_pixels(spec.content_seed, sid, n_img, spec.channels, side)), 0
    return ids, [patchify(im, patch, spec.patch_temporal) for im in images], damaged


def build_micro_batch(table: SampleTable, group: np.ndarray, contents: list[tuple[np.ndarray, list[np.ndarray]]],
                      spec: ContentSpec, grids: np.ndarray) -> PackedMicroBatch:
    """Concatenate the documents of ``group`` (rows of ``table``), images (with their markers, if
    the table has them) at their text offsets; the images' patches sorted by grid (``grids``: of
    every image of ``table``)."""
    tok = spec.tokenizer
    marked = table.image_markers > 0
    tokens, labels, positions, doc_lens = [], [], [], []
    images = []  # (grid, token positions, patches) per image, in sequence order
    start = 0
    for k, (ids, patches) in zip(group.tolist(), contents):
        lo, hi = table.image_ptr[k], table.image_ptr[k + 1]
        mine = grids[lo:hi].tolist()
        offsets = table.offsets_of(k)
        pieces, is_text = [], []
        prev = before = 0  # text tokens and image positions before the current one
        for j, off in enumerate(offsets.tolist()):
            n = int(table.image_tokens[lo + j])
            block = np.full(n + table.image_markers, tok.image, np.int64)
            if marked:
                block[0], block[-1] = tok.vision_start, tok.vision_end
            pieces.append(ids[prev:off])
            is_text.append(np.ones(off - prev, bool))
            images.append((tuple(mine[j]), start + off + before + int(marked) + np.arange(n), patches[j] if patches else None))
            pieces.append(block)
            is_text.append(np.zeros(len(block), bool))
            prev, before = off, before + len(block)
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
    images.sort(key=lambda im: im[0])  # stable: sequence order within a grid
    patches = [p for _, _, p in images if p is not None]
    return PackedMicroBatch(
        tokens=torch.from_numpy(np.concatenate(tokens)),
        labels=torch.from_numpy(np.concatenate(labels)),
        positions=torch.from_numpy(np.concatenate(positions)),
        cu_seqlens=torch.from_numpy(cu),
        pixel_values=torch.from_numpy(np.concatenate(patches) if patches else np.zeros((0, spec.patch_dim), np.float32)),
        image_token_index=torch.from_numpy(np.concatenate([t for _, t, _ in images]) if images else np.zeros(0, np.int64)),
        sample_ids=torch.from_numpy(table.ids[group].copy()),
        image_grids=tuple(g for g, _, _ in images),
    )
