"""Image sizes from file headers (no decode), and what to do with images that cannot be read.

Metadata look-ahead needs every image's pixel size (its token count follows from it) but not its
pixels: Pillow's ``Image.open`` reads only the header. An image whose header cannot be read (a
missing or empty file, a remote URL, bytes that are no image format Pillow knows, a zero or absurd
size, more pixels than Pillow's decompression-bomb limit) is found here, when the data set is
opened, before any batch is planned. ``BadImages`` says what happens then: ``error`` stops with
the file (or row) and the reason; ``skip`` leaves the whole sample out of the data set and counts
it (``SampleStore.skipped``).

A file whose header is fine but whose data is cut short is only found when a loader worker
decodes it (a full decode of every image at open would cost as much as an epoch of decoding):
see ``torchtitan_patches.data.micro_batch.decode_image``.
"""

from __future__ import annotations

import io
import re
from enum import Enum
from pathlib import Path

import numpy as np

from pipetune.data.images import MAX_ASPECT

_REMOTE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
"""A URL (``https://``, ``s3://``, ...): pipetune reads local files and embedded bytes only."""


class BadImages(str, Enum):
    ERROR = "error"
    SKIP = "skip"


class UnreadableImage(ValueError):
    """An image whose header cannot be read; the message says why."""


def describe(ref, base: Path) -> str:
    """How a message names an image: its file, or its size in bytes when embedded."""
    return str(base / ref) if isinstance(ref, str) else f"embedded image ({len(ref)} bytes)"


def header_size(ref, base: Path) -> tuple[int, int]:
    """``(height, width)`` of an image (a file name relative to ``base``, or encoded bytes)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(ref, str) and _REMOTE.match(ref):
        raise UnreadableImage(f"{ref}: remote images are not read; download them and name the local files (or embed "
                              "their bytes) in the data set")
    try:
        if isinstance(ref, str):
            f = base / ref
            if not f.is_file():
                raise UnreadableImage(f"{f}: no such image file")
            if f.stat().st_size == 0:
                raise UnreadableImage(f"{f}: the image file is empty (0 bytes)")
            with Image.open(f) as im:
                w, h = im.size
        else:
            if len(ref) == 0:
                raise UnreadableImage("an embedded image has 0 bytes")
            with Image.open(io.BytesIO(ref)) as im:
                w, h = im.size
    except Image.DecompressionBombError as e:
        raise UnreadableImage(f"{describe(ref, base)}: {e} Shrink the image, or raise PIL.Image.MAX_IMAGE_PIXELS where the "
                              "data set is opened and decoded if it is trusted") from None
    except UnidentifiedImageError:
        raise UnreadableImage(f"{describe(ref, base)}: not an image (no format Pillow reads)") from None
    except (OSError, SyntaxError) as e:
        raise UnreadableImage(f"{describe(ref, base)}: not a readable image ({type(e).__name__}: {e})") from None
    if w <= 0 or h <= 0:
        raise UnreadableImage(f"{describe(ref, base)}: the image is {w} x {h} pixels")
    if max(w, h) > MAX_ASPECT * min(w, h):
        raise UnreadableImage(f"{describe(ref, base)}: the image is {w} x {h} pixels, more elongated than {MAX_ASPECT}:1")
    return h, w


def image_sizes(images: list[list], base: Path, *, progress: bool = False) -> tuple[np.ndarray, dict[int, str]]:
    """Flat ``(n, 2)`` sizes of every row's images (rows in order) and, per row with an unreadable
    image, the first reason (its images' sizes are 0); ``progress`` shows a bar over the rows."""
    from tqdm import tqdm

    sizes = np.zeros((sum(len(r) for r in images), 2), np.int64)
    bad: dict[int, str] = {}
    k = 0
    for row, refs in enumerate(tqdm(images, desc="reading image headers", unit=" rows", mininterval=2,
                                    disable=not progress or not len(sizes))):
        for ref in refs:
            try:
                sizes[k] = header_size(ref, base)
            except UnreadableImage as e:
                bad.setdefault(row, str(e))
            k += 1
    return sizes, bad
