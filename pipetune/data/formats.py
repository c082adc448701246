"""The sample formats a data set's rows may come in, read into one view: text with ``<image>``
placeholders, and the row's images (file names or encoded bytes).

- ``PIPETUNE``: pipetune's own columns (``pipetune.data.storage``): ``input_ids`` / ``text`` /
  ``text_tokens``, ``images`` (file names relative to the data set, or encoded bytes) or
  ``num_images``.
- ``INTERLEAVED``: TorchTitan's OBELICS-style documents: ``texts`` and ``images``, lists of one
  length per row; position ``i`` is an image where ``images[i]`` is set (its text, if any, is
  ignored, as TorchTitan's ``_process_mm_sample`` does), else the text ``texts[i]`` (``None`` is
  nothing). The parts are joined without separator, as ``insert_vision_placeholders`` joins them.
- ``PAIRS``: TorchTitan's CC12M-style image-caption pairs (webdataset keys ``txt`` and ``jpg``;
  also ``jpeg``, ``png`` or ``webp``): the image, then its caption.

Images are kept encoded: header reads give sizes for the metadata, and only loader workers on
ranks that run the encoder decode them.
"""

from __future__ import annotations

from enum import Enum

from pipetune.data.text import IMAGE_PLACEHOLDER

PAIR_IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")


class RowFormat(Enum):
    PIPETUNE = "pipetune"
    INTERLEAVED = "interleaved"
    PAIRS = "pairs"

    @classmethod
    def of(cls, columns) -> "RowFormat":
        cols = set(columns)
        if {"texts", "images"} <= cols:
            return cls.INTERLEAVED
        if "txt" in cols and cols & set(PAIR_IMAGE_KEYS):
            return cls.PAIRS
        return cls.PIPETUNE


def pair_image_column(columns) -> str | None:
    """The image column of image-caption pairs (None: there is none)."""
    return next((k for k in PAIR_IMAGE_KEYS if k in set(columns)), None)


def raw_images(ds):
    """``ds`` with image columns left encoded (HF ``Image`` features decode to PIL on access):
    values become ``{"bytes", "path"}`` dicts, which ``image_ref`` reads."""
    import datasets

    for name, feature in ds.features.items():
        if isinstance(feature, datasets.Image) and feature.decode:
            ds = ds.cast_column(name, datasets.Image(decode=False))
        elif isinstance(feature, datasets.List) and isinstance(feature.feature, datasets.Image) and feature.feature.decode:
            ds = ds.cast_column(name, datasets.List(datasets.Image(decode=False)))
    return ds


def image_ref(value):
    """An image value as stored: a file name (str), encoded bytes, or an HF ``{"bytes", "path"}``
    dict; returns the file name or the bytes (None for no image)."""
    if isinstance(value, dict):
        return value.get("bytes") or value.get("path")
    return value


class FormatError(ValueError):
    """A row that does not follow its format; ``row`` is counted from 0 over the data set."""

    def __init__(self, row: int, column: str, what: str):
        super().__init__(what)
        self.row, self.column = row, column


def texts_and_images(fmt: RowFormat, columns: dict[str, list], first_row: int = 0) -> tuple[list[str], list[list]]:
    """Per row of ``columns`` (column -> values, rows ``first_row ..``) in format ``fmt`` (not
    ``PIPETUNE``): its text with a placeholder per image, and its images (``image_ref``s)."""
    texts, images = [], []
    if fmt is RowFormat.PAIRS:
        key = pair_image_column(columns)
        for k, (caption, image) in enumerate(zip(columns["txt"], columns[key])):
            if image_ref(image) is None:
                raise FormatError(first_row + k, key, "has no image; an image-caption pair needs one")
            texts.append(IMAGE_PLACEHOLDER + (caption or ""))
            images.append([image_ref(image)])
        return texts, images
    for k, (parts, imgs) in enumerate(zip(columns["texts"], columns["images"])):
        parts, imgs = parts or [], imgs or []
        if len(parts) != len(imgs):
            raise FormatError(first_row + k, "texts", f"has {len(parts)} entries but 'images' has {len(imgs)}; the two lists "
                                                      "must have one entry per position (None where the other one is set)")
        out, refs = [], []
        for t, im in zip(parts, imgs):
            ref = image_ref(im)
            if ref is not None:
                out.append(IMAGE_PLACEHOLDER)
                refs.append(ref)
            elif t is not None:
                if IMAGE_PLACEHOLDER in t:
                    raise FormatError(first_row + k, "texts", f"contains the string {IMAGE_PLACEHOLDER!r}, which would be read as an "
                                                              "image; images go in 'images' at their position")
                out.append(t)
        texts.append("".join(out))
        images.append(refs)
    return texts, images
