"""A data set's rows -> their samples' metadata (``SampleTable``), as both the un-indexed path
(``pipetune.data.storage``) and the index build (``pipetune.data.index``) derive it: raw text
tokenized, image headers read, every value checked, a bad one named by file, row and column.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipetune.data.formats import FormatError, RowFormat, image_ref, pair_image_column, texts_and_images
from pipetune.data.image_files import BadImages, image_sizes
from pipetune.data.samples import SampleTable
from pipetune.data.text import IMAGE_PLACEHOLDER, TextTokenizer

TEXT_COLUMNS = ("input_ids", "text", "text_tokens")
NO_TEXT = "has no text token: nothing to train on"
"""Why a row without text is left out (whatever the bad-image policy)."""
PROGRESS_ROWS = 20_000
"""From this many rows on, deriving the metadata shows progress bars."""


def _where(path: Path, row: int, column: str) -> str:
    return f"{path}: row {row} (counted from 0), column {column!r}"


def _null_check(col, path: Path, column: str, first_row: int = 0) -> None:
    if col.null_count:
        col = col.combine_chunks() if hasattr(col, "combine_chunks") else col
        row = first_row + int(np.flatnonzero(np.asarray(col.is_null()))[0])
        raise ValueError(f"{_where(path, row, column)}: missing or null; every row needs a value (or drop the column)")


def _ints(values, path: Path, column: str, owner: np.ndarray | None = None, first_row: int = 0) -> np.ndarray:
    """An arrow array of numbers as int64: integral floats pass, anything else names its row."""
    import pyarrow as pa

    def fail(k: int, what: str):
        row = first_row + (int(owner[k]) if owner is not None and k < len(owner) else k)
        raise ValueError(f"{_where(path, row, column)}: {what}; it needs whole numbers (integers)")

    if values.null_count:
        fail(int(np.flatnonzero(np.asarray(values.is_null()))[0]), "holds a null")
    if len(values) == 0:
        return np.zeros(0, np.int64)
    t = values.type
    if pa.types.is_integer(t):
        arr = values.to_numpy(zero_copy_only=False)
        if pa.types.is_unsigned_integer(t) and len(arr) and arr.max() >= 2**63:
            fail(int(np.argmax(arr >= 2**63)), f"{int(arr.max())} does not fit in int64")
        return arr.astype(np.int64)
    if pa.types.is_floating(t):
        arr = values.to_numpy(zero_copy_only=False).astype(np.float64)
        bad = ~np.isfinite(arr) | (arr != np.round(arr)) | (np.abs(arr) >= 2.0**63)
        if bad.any():
            k = int(np.argmax(bad))
            x = float(arr[k])
            fail(k, f"{x:g} does not fit in int64" if np.isfinite(x) and x == round(x) else f"{x!r} is not an integer")
        return arr.astype(np.int64)
    if pa.types.is_string(t) or pa.types.is_large_string(t):  # numbers written as text (ids as strings)
        texts = values.to_pylist()
        k = next((i for i, v in enumerate(texts) if not _integral_text(v)), 0)
        fail(k, f"holds the text {texts[k]!r}")
    fail(0, f"holds {t} values")


def _integral_text(v: str) -> bool:
    try:
        int(v)
    except ValueError:
        return False
    return True


def _int_column(ds, path: Path, column: str, first_row: int = 0) -> np.ndarray:
    col = ds.data.column(column).combine_chunks()
    _null_check(col, path, column, first_row)
    return _ints(col, path, column, first_row=first_row)


def _list_column(ds, path: Path, column: str, *, nullable: bool = False, first_row: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(per-row lengths, flat int64 values) of a list-of-integers column; null rows are empty if ``nullable``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = ds.data.column(column).combine_chunks()
    if not nullable:
        _null_check(col, path, column, first_row)
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        raise ValueError(f"{_where(path, first_row, column)}: holds {col.type} values; it needs a list of integers")
    lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(col)
    return lengths, _ints(flat, path, column, owner=np.repeat(np.arange(len(lengths)), lengths), first_row=first_row)


def _image_refs(ds, path: Path, fmt: RowFormat, first_row: int = 0) -> tuple[list[str] | None, list[list]]:
    """Raw text with placeholders (None: pipetune's columns without ``text`` or not in this
    format's view) and every row's image references."""
    import pyarrow as pa

    n = len(ds)
    if fmt is not RowFormat.PIPETUNE:
        texts, refs = [], []
        cols = [c for c in ds.column_names if c in ("texts", "images", "txt") or c == pair_image_column(ds.column_names)]
        for start in range(0, n, 4096):
            try:
                t, r = texts_and_images(fmt, ds.select_columns(cols)[start:start + 4096], first_row + start)
            except FormatError as e:
                raise ValueError(f"{_where(path, e.row, e.column)}: {e}") from None
            texts += t
            refs += r
        return texts, refs
    if "images" not in ds.column_names:
        return None, [[] for _ in range(n)]
    image_type = ds.data.column("images").type
    if not (pa.types.is_list(image_type) or pa.types.is_large_list(image_type) or pa.types.is_null(image_type)):
        raise ValueError(f"{_where(path, first_row, 'images')}: holds {image_type} values; it needs a list of image file names")
    return None, [[image_ref(v) for v in (x or [])] for x in ds["images"]]


def row_metadata(ds, path: Path, base: Path, tokenizer: TextTokenizer, fmt: RowFormat, bad_images: BadImages,
              first_row: int = 0, progress: bool = False) -> tuple[SampleTable, list[tuple[int, str]]]:
    """The metadata of ``ds``'s rows, which are rows ``first_row ..`` of ``path`` (as messages
    name them), and the rows left out: unreadable images under ``BadImages.SKIP``, and always rows
    without a text token (nothing to train on). ``progress`` shows bars over the row loops."""
    import pyarrow as pa
    from tqdm import tqdm

    progress = progress and len(ds) >= PROGRESS_ROWS

    def where(row: int, column: str) -> str:
        return _where(path, first_row + row, column)

    cols = set(ds.column_names)
    n = len(ds)
    if fmt is RowFormat.PIPETUNE and not cols & set(TEXT_COLUMNS):
        raise ValueError(f"{path}: rows need one of the columns {TEXT_COLUMNS}, or TorchTitan's 'texts' and 'images' "
                         f"(interleaved documents) or 'txt' and 'jpg' (image-caption pairs); found {sorted(cols)}")
    ids = _int_column(ds, path, "id", first_row) if "id" in cols else first_row + np.arange(n, dtype=np.int64)
    if len(np.unique(ids)) != n:
        uniq, counts = np.unique(ids, return_counts=True)
        raise ValueError(f"{path}: sample id {uniq[np.argmax(counts > 1)]} appears more than once; ids must be unique")
    if "source" in cols:
        _null_check(ds.data.column("source"), path, "source", first_row)
    sources = ds["source"] if "source" in cols else [fmt.value if fmt is not RowFormat.PIPETUNE else "user"] * n
    names, codes = np.unique(np.asarray(sources, dtype=object).astype(str), return_inverse=True)

    texts, refs = _image_refs(ds, path, fmt, first_row)
    text_column = "texts" if fmt is RowFormat.INTERLEAVED else "txt" if fmt is RowFormat.PAIRS else "text"
    if texts is None and "input_ids" not in cols and "text" in cols:
        _null_check(ds.data.column("text"), path, "text", first_row)
        text_type = ds.data.column("text").type
        if not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type)):
            raise ValueError(f"{where(0, 'text')}: holds {text_type} values; it needs strings")
        texts = ds["text"]
    if "input_ids" in cols:
        text_tokens, _ = _list_column(ds, path, "input_ids", first_row=first_row)
    elif texts is not None:
        pieces = [tokenizer.split(t) for t in tqdm(texts, desc=f"tokenizing {path.name}", unit=" rows", disable=not progress,
                                                   mininterval=2)]
        text_tokens = np.fromiter((p.num_tokens for p in pieces), np.int64, n)
        for i, p in enumerate(pieces):
            if clash := set(tokenizer.not_text).intersection(p.token_ids):
                raise ValueError(
                    f"{where(i, text_column)}: sample id={ids[i]} encodes to the image or vision marker id(s) "
                    f"{sorted(clash)} of {tokenizer.name}, which only the loader writes; remove those special-token "
                    f"strings from the text (mark images with {IMAGE_PLACEHOLDER})"
                )
    else:
        text_tokens = _int_column(ds, path, "text_tokens", first_row)

    if fmt is not RowFormat.PIPETUNE or "images" in cols:
        num_images = np.fromiter((len(r) for r in refs), np.int64, n)
    elif "num_images" in cols:
        num_images = _int_column(ds, path, "num_images", first_row)
    else:
        num_images = np.zeros(n, np.int64)

    if texts is not None and "input_ids" not in cols:
        placed = np.fromiter((len(p.image_offsets) for p in pieces), np.int64, n)
        mismatch = (placed > 0) & (placed != num_images) & ("images" in cols or "num_images" in cols)
        if mismatch.any():
            i = int(np.argmax(mismatch))
            raise ValueError(
                f"{where(i, text_column)}: sample id={ids[i]} has {placed[i]} {IMAGE_PLACEHOLDER} placeholders but "
                f"{num_images[i]} images; give one {IMAGE_PLACEHOLDER} per image"
            )
        num_images = np.where(placed > 0, placed, num_images)
        first = int(tokenizer.bos is not None)  # images without placeholders open the text, after its BOS
        offsets = [p.image_offsets if p.image_offsets else [first] * int(k) for p, k in zip(pieces, num_images)]
    elif "image_offsets" in cols:
        counts, flat = _list_column(ds, path, "image_offsets", nullable=True, first_row=first_row)
        bad = counts != num_images
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{where(i, 'image_offsets')}: sample id={ids[i]} has {counts[i]} image_offsets but {num_images[i]} images")
        offsets = np.split(flat, np.cumsum(counts)[:-1]) if n else []
    else:
        offsets = None

    sizes, unreadable = image_sizes(refs, base, progress=progress)
    if unreadable and bad_images is BadImages.ERROR:
        row, why = next(iter(unreadable.items()))
        raise ValueError(f"{where(row, 'images' if fmt is not RowFormat.PAIRS else pair_image_column(ds.column_names))}: sample "
                         f"id={ids[row]}: {why} ({len(unreadable)} rows with unreadable images in all); repair or "
                         "remove the image, or skip such rows (bad_images=skip)")
    left_out = dict(unreadable)
    for row in np.flatnonzero(text_tokens == 0).tolist():
        left_out.setdefault(row, f"sample id={ids[row]} {NO_TEXT}")
    keep = np.setdiff1d(np.arange(n), np.fromiter(left_out, np.int64, len(left_out)))
    kept_images = np.isin(np.repeat(np.arange(n), [len(r) for r in refs]), keep)
    try:
        table = SampleTable.build(
            ids=ids[keep],
            source=codes[keep],
            source_names=tuple(str(x) for x in names),
            text_tokens=text_tokens[keep],
            num_images=num_images[keep],
            image_offsets=None if offsets is None else [offsets[i] for i in keep],
            image_sizes=sizes[kept_images] if len(sizes) else None,  # None: synthesized pixels at the standard size
            image_markers=tokenizer.image_markers if texts is not None and "input_ids" not in cols else 0,
        )
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return table, sorted((first_row + r, why) for r, why in left_out.items())
