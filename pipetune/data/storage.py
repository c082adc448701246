"""Data sets on local disk: generated mixes and users' own data, read through one code path.

Accepted inputs for ``--data``: a directory written by ``datasets.Dataset.save_to_disk`` (what
``pipetune data make`` writes), a ``.jsonl``/``.json``/``.parquet`` file, a directory of such
files, a directory of webdataset ``.tar`` shards, or a directory of such data sets (one per
subdirectory, e.g. caption pairs beside interleaved documents: ``MixedStore``). Rows are in
pipetune's own columns (below)
or in one of TorchTitan's multimodal sample formats, interleaved ``texts``/``images`` documents or
``txt``/``jpg`` image-caption pairs (``pipetune.data.formats``). In pipetune's columns one row is
one sample:

| column          | type        | meaning                                                             |
|-----------------|-------------|---------------------------------------------------------------------|
| ``id``          | int         | unique sample id (default: row number)                              |
| ``source``      | str         | corpus name (default ``"user"``)                                    |
| ``input_ids``   | list[int]   | pre-tokenized text (preferred for real data)                        |
| ``text``        | str         | raw text; ``<image>`` marks where each image goes (see below)       |
| ``text_tokens`` | int         | length only; token ids are synthesized from the id (generated data) |
| ``images``      | list        | image files, relative to the data file's directory, or their bytes |
| ``num_images``  | int         | image count when there are no files (pixels are synthesized)        |
| ``image_offsets`` | list[int] | text offset of each image (default: all images before the text)    |

A row needs one of ``input_ids``, ``text`` or ``text_tokens``; all rows of a file have the same columns.
Raw ``text`` is tokenized with the job's tokenizer (default pipetune's byte tokenizer) with its
BOS/EOS, and its images bracketed by its vision start/end tokens (``pipetune.data.text``).
Loading never drops a row silently: a bad row (a missing or null value, a non-integral number
where an integer belongs, a value beyond int64) is an error that names the file, the row (counted
from 0 over the data set's rows) and the column; an unreadable file is an error naming the file.
Image sizes are read from their headers when the data set is opened; a row with an unreadable
image is an error or, under ``BadImages.SKIP``, left out and listed in ``SampleStore.skipped``
(``pipetune.data.image_files``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipetune.data.formats import FormatError, RowFormat, image_ref, pair_image_column, raw_images, texts_and_images
from pipetune.data.image_files import BadImages, image_sizes
from pipetune.data.samples import SampleTable
from pipetune.data.text import BYTE_TOKENIZER, IMAGE_PLACEHOLDER, TextTokenizer

INFO_FILE = "pipetune.json"
TEXT_COLUMNS = ("input_ids", "text", "text_tokens")


@dataclass(frozen=True)
class SampleStore:
    """An opened data set: metadata of every row plus access to the rows' content.

    ``table`` row ``i`` describes data set row ``i`` (with ``tokens_per_image`` unset: it is the
    model's). ``content_seed`` seeds the synthesized token ids and pixels of rows without content.
    ``origin`` is the path it was opened from; ``digest`` fingerprints its metadata and content
    seed (``SampleTable.digest``), so a checkpoint can tell whether it was made on these rows.
    ``skipped`` lists the rows left out for an unreadable image (row of the data set as stored,
    reason); ``dataset`` holds the others, in order.
    """

    table: SampleTable
    dataset: object
    path: Path
    origin: Path
    content_seed: int
    has_token_ids: bool
    has_image_files: bool
    tokenizer: TextTokenizer = BYTE_TOKENIZER
    format: RowFormat = RowFormat.PIPETUNE
    skipped: tuple[tuple[int, str], ...] = ()

    def __len__(self) -> int:
        return len(self.table)

    @property
    def digest(self) -> str:
        return f"{self.table.digest()}:{self.content_seed}"

    def check_token_ids(self, vocab_size: int) -> None:
        """Every stored token id is in ``[0, vocab_size)``: checked once, before any worker reads a row."""
        import pyarrow.compute as pc

        if "input_ids" in self.dataset.column_names:
            col = self.dataset.data.column("input_ids").combine_chunks()
            lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False)
            flat = pc.list_flatten(col).to_numpy(zero_copy_only=False)
            bad = (flat < 0) | (flat >= vocab_size)
            if bad.any():
                k = int(np.argmax(bad))
                row = int(np.searchsorted(np.cumsum(lengths), k, side="right"))
                raise ValueError(
                    f"{self.origin}: row {row} (counted from 0), column 'input_ids': sample id={self.table.ids[row]} has "
                    f"token id {int(flat[k])} outside the vocabulary of {vocab_size}; tokenize with the model's tokenizer"
                )
        elif "text" in self.dataset.column_names and self.tokenizer.vocab_size > vocab_size:
            raise ValueError(
                f"{self.origin}: raw `text` is tokenized by {self.tokenizer.name} into ids up to "
                f"{self.tokenizer.vocab_size - 1}, beyond the model's vocabulary of {vocab_size}; use a tokenizer that "
                "fits the model or store pre-tokenized `input_ids` instead"
            )

    def rows(self, indices, *, images: bool = True) -> list[dict]:
        """Content of the given rows (empty dicts when the data set is metadata-only): ``input_ids``
        or ``text`` (with placeholders), and ``images`` (file names or bytes) unless ``images`` is
        False (a rank that runs no encoder: it opens no image file; TorchTitan's formats embed the
        bytes in the row, which are read with it, as the placeholders' positions need them)."""
        indices = [int(i) for i in indices]
        if self.format is not RowFormat.PIPETUNE:
            texts, refs = texts_and_images(self.format, self.dataset[indices])
            return [{"text": t, **({"images": r} if images else {})} for t, r in zip(texts, refs)]
        cols = [c for c in ("input_ids", "text") + (("images",) if images else ()) if c in self.dataset.column_names]
        if not cols:
            return [{} for _ in indices]
        sub = self.dataset.select_columns(cols)[indices]
        return [{c: sub[c][k] for c in cols} for k in range(len(indices))]


@dataclass(frozen=True)
class MixedStore(SampleStore):
    """A directory of data sets read as one: rows in source order (``parts``), each part's rows
    under its directory's name as the source (``dir/source`` where a part has several). Sample ids
    are row numbers over all parts (parts' own ids may collide). Every part needs content
    (tokens or text): synthesized content has one seed per data set."""

    parts: tuple[SampleStore, ...] = ()

    @classmethod
    def of(cls, path: Path, parts: list[SampleStore]) -> "MixedStore":
        names, codes = [], []
        for part in parts:
            if not part.has_token_ids:
                raise ValueError(f"{part.origin}: a directory of data sets needs text or token ids in every data set; this "
                                 "one holds lengths only (generated data): use it on its own")
            own = part.table.source_names
            mine = [part.path.name if len(own) == 1 else f"{part.path.name}/{n}" for n in own]
            codes.append(np.array([len(names) + k for k in range(len(own))])[part.table.source])
            names += mine
        tables = [p.table for p in parts]
        if len({t.image_markers for t in tables if t.num_images.any()}) > 1:
            raise ValueError(f"{path}: its data sets disagree on vision markers (raw text and pre-tokenized rows); keep one kind")
        table = SampleTable.build(
            ids=np.arange(sum(len(t) for t in tables)), source=np.concatenate(codes), source_names=tuple(names),
            text_tokens=np.concatenate([t.text_tokens for t in tables]), num_images=np.concatenate([t.num_images for t in tables]),
            image_offsets=[t.offsets_of(i) for t in tables for i in range(len(t))],
            image_sizes=np.concatenate([t.image_sizes for t in tables]), image_markers=max(t.image_markers for t in tables),
        )
        first = parts[0]
        return cls(table=table, dataset=None, path=path, origin=path.resolve(), content_seed=first.content_seed, has_token_ids=True,
                   has_image_files=any(p.has_image_files for p in parts), tokenizer=first.tokenizer,
                   skipped=tuple((r, f"{p.path.name}: {why}") for p in parts for r, why in p.skipped), parts=tuple(parts))

    @property
    def digest(self) -> str:
        return ":".join([self.table.digest()] + [p.digest for p in self.parts])

    def check_token_ids(self, vocab_size: int) -> None:
        for part in self.parts:
            part.check_token_ids(vocab_size)

    def rows(self, indices, *, images: bool = True) -> list[dict]:
        """As ``SampleStore.rows``; image file names come absolute (each part has its directory)."""
        ends = np.cumsum([len(p) for p in self.parts])
        indices = np.asarray([int(i) for i in indices], dtype=np.int64)
        owner = np.searchsorted(ends, indices, side="right")
        out: list[dict] = [{} for _ in indices]
        for k, part in enumerate(self.parts):
            mine = np.flatnonzero(owner == k)
            if not len(mine):
                continue
            local = indices[mine] - (ends[k] - len(part))
            for j, row in zip(mine, part.rows(local, images=images)):
                if "images" in row:
                    row["images"] = [str(part.path / r) if isinstance(r, str) else r for r in row["images"]]
                out[j] = row
        return out


def check_new_dir(out: str | Path) -> Path:
    """``out`` may receive a new data set: it does not exist, or is an empty directory."""
    out = Path(out)
    if out.is_file() or out.is_symlink():
        raise ValueError(f"--out {out} is an existing file; give a directory path that does not exist yet")
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"--out {out} is a directory that is not empty; choose a new directory or delete this one first")
    return out


def write_dataset(table: SampleTable, out: str | Path, info: dict) -> Path:
    """Store metadata records as an HF data set on disk, with ``pipetune.json`` beside it.

    The data set is written to a temporary sibling directory and renamed into place, so ``out``
    is either absent or complete. ``out`` must not exist (an empty directory is fine).
    """
    import datasets

    out = check_new_dir(out)
    offsets = [table.offsets_of(i).tolist() for i in range(len(table))]
    ds = datasets.Dataset.from_dict(
        {
            "id": table.ids,
            "source": np.asarray(table.source_names)[table.source].tolist(),
            "text_tokens": table.text_tokens,
            "num_images": table.num_images,
            "image_offsets": offsets,
        },
        features=datasets.Features(
            {
                "id": datasets.Value("int64"),
                "source": datasets.Value("string"),
                "text_tokens": datasets.Value("int64"),
                "num_images": datasets.Value("int64"),
                "image_offsets": datasets.Sequence(datasets.Value("int64")),
            }
        ),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        ds.save_to_disk(str(tmp))
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def open_dataset(path: str | Path, *, tokenizer: TextTokenizer = BYTE_TOKENIZER,
                 bad_images: BadImages | str = BadImages.ERROR) -> SampleStore:
    """Open any accepted input (see module doc) and derive the metadata of every row; raw text is
    tokenized with ``tokenizer``; rows with an unreadable image are handled by ``bad_images``."""
    import pyarrow as pa

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data set {path} does not exist (make one with `pipetune data make`)")
    if sources := _sources(path):
        return MixedStore.of(path, [open_dataset(p, tokenizer=tokenizer, bad_images=bad_images) for p in sources])
    info = _read_info(path)
    ds, files = _load(path)
    if len(ds) == 0:
        raise ValueError(f"{path}: the data set has no rows")
    ds = raw_images(ds)
    fmt = RowFormat.of(ds.column_names)
    base = path if path.is_dir() else path.parent
    cache = None if _names_image_files(ds) else _MetadataCache.of(ds, tokenizer, fmt, BadImages(bad_images))
    if cache is not None and (cached := cache.load()) is not None:
        table, skipped = cached
    else:
        try:
            table, skipped = _metadata(ds, path, base, tokenizer, fmt, BadImages(bad_images))
        except (pa.ArrowException, OSError) as e:  # a damaged file found while reading its columns
            raise ValueError(f"{path}: cannot read the data set's rows ({_first_line(e)}); {_REMAKE}") from None
        if cache is not None:
            cache.save(table, skipped)
    if skipped:
        ds = ds.select(np.setdiff1d(np.arange(len(ds)), [r for r, _ in skipped]))
    return SampleStore(
        table=table,
        dataset=ds,
        path=base,
        origin=path.resolve(),
        content_seed=int(info.get("seed", 0)),
        has_token_ids=fmt is not RowFormat.PIPETUNE or bool({"input_ids", "text"} & set(ds.column_names)),
        has_image_files=fmt is not RowFormat.PIPETUNE or "images" in ds.column_names,
        tokenizer=tokenizer,
        format=fmt,
        skipped=tuple(skipped),
    )


def _names_image_files(ds) -> bool:
    """Whether rows name image files (their sizes are not covered by the rows' fingerprint)."""
    import pyarrow as pa

    if "images" not in ds.column_names:
        return False
    t = ds.data.column("images").type
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and (pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type))


@dataclass(frozen=True)
class _MetadataCache:
    """The metadata of a data set, computed once per data set, tokenizer and policy: tokenizing
    every row and reading every image header take seconds per 100k rows, on every rank, at every
    start. The key is HF ``datasets``' fingerprint of the rows (it follows the files' content and
    modification times), the tokenizer's fingerprint, the format and the bad-image policy. Files
    live under ``$PIPETUNE_CACHE`` (default ``~/.cache/pipetune``); an unwritable cache is skipped.
    Rows that name image files are not cached: the fingerprint does not see the files change."""

    file: Path

    VERSION = 1

    @classmethod
    def of(cls, ds, tokenizer: TextTokenizer, fmt: RowFormat, bad_images: BadImages) -> "_MetadataCache":
        import hashlib

        key = repr((cls.VERSION, ds._fingerprint, tokenizer.fingerprint, fmt.value, bad_images.value))
        root = Path(os.environ.get("PIPETUNE_CACHE") or Path.home() / ".cache" / "pipetune")
        return cls(root / "metadata" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.npz")

    def load(self) -> tuple[SampleTable, list[tuple[int, str]]] | None:
        if not self.file.is_file():
            return None
        try:
            with np.load(self.file, allow_pickle=False) as z:
                extra = json.loads(str(z["extra"]))
                table = SampleTable.build(ids=z["ids"], source=z["source"], source_names=tuple(extra["source_names"]),
                                          text_tokens=z["text_tokens"], num_images=z["num_images"],
                                          image_offsets=np.split(z["image_offsets"], np.cumsum(z["num_images"])[:-1]) if len(z["ids"]) else [],
                                          image_sizes=z["image_sizes"], image_markers=extra["image_markers"])
        except (OSError, ValueError, KeyError):  # a damaged cache file: recompute
            return None
        return table, [tuple(s) for s in extra["skipped"]]

    def save(self, table: SampleTable, skipped: list[tuple[int, str]]) -> None:
        extra = json.dumps({"source_names": list(table.source_names), "image_markers": table.image_markers, "skipped": skipped})
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.file.with_suffix(f".tmp-{os.getpid()}.npz")
            np.savez(tmp, ids=table.ids, source=table.source, text_tokens=table.text_tokens, num_images=table.num_images,
                     image_offsets=table.image_offsets, image_sizes=table.image_sizes, extra=np.array(extra))
            os.replace(tmp, self.file)
        except OSError:
            pass


_REMAKE = "the file may be truncated or corrupt: make the data set again (`pipetune data make`) or repair the file"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _read_info(path: Path) -> dict:
    f = path / INFO_FILE
    if not f.is_file():
        return {}
    try:
        info = json.loads(f.read_text())
    except ValueError as e:
        raise ValueError(f"{f}: not valid JSON ({e}); {_REMAKE}") from None
    if not isinstance(info, dict):
        raise ValueError(f"{f}: expected a JSON object; {_REMAKE}")
    return info


_READERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".tar": "webdataset"}


def _sources(path: Path) -> list[Path]:
    """The data sets of a directory of data sets (its subdirectories), or none when ``path`` is a
    data set itself."""
    if not path.is_dir() or (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        return []
    if any(p.is_file() and p.suffix in _READERS and p.name != INFO_FILE for p in path.iterdir()):
        return []
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


def _load(path: Path):
    """Open the data set with HF ``datasets``; any failure becomes a message naming the file."""
    import datasets

    if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:  # datasets/pyarrow raise many types on a damaged directory
            raise ValueError(f"{path}: cannot open the data set ({_first_line(e)}); {_REMAKE}") from None
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return ds, [path]
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in _READERS and p.name != INFO_FILE
    )
    if not files:
        raise ValueError(f"{path}: no HF data set, .jsonl, .json, .parquet or webdataset .tar files found")
    kinds = {_READERS.get(f.suffix) for f in files}
    if None in kinds:
        raise ValueError(f"{path}: {files[0].name} is none of the accepted inputs (a save_to_disk directory, .jsonl, .json, "
                         ".parquet, or webdataset .tar shards)")
    if len(kinds) > 1:
        raise ValueError(f"{path}: mixes {' and '.join(sorted(kinds))} files; keep one format per directory")
    kind = kinds.pop()
    for f in files:
        if f.stat().st_size == 0:
            raise ValueError(f"{f}: the file is empty; a data set needs at least one row")
    try:
        return datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train"), files
    except Exception as e:  # the JSON/parquet readers raise many types; find the line ourselves
        if kind == "json":
            for f in files:
                _diagnose_json_lines(f)
        raise ValueError(f"cannot read {', '.join(map(str, files))} ({_first_line(e)}); {_REMAKE}") from None


def _diagnose_json_lines(f: Path) -> None:
    """Name the first line of a JSON-lines file that the reader choked on (called on failure only)."""
    first_keys = None
    with f.open(encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                if n == 1 and line.lstrip().startswith("["):
                    return  # a JSON array file, not JSON lines
                raise ValueError(f"{f}, line {n}: not valid JSON ({e}); write one JSON object per line") from None
            if not isinstance(row, dict):
                raise ValueError(f"{f}, line {n}: expected a JSON object with the row's columns, got {type(row).__name__}")
            for k, v in row.items():
                for x in v if isinstance(v, list) else [v]:
                    if isinstance(x, int) and not isinstance(x, bool) and not -(2**63) <= x < 2**63:
                        raise ValueError(f"{f}, line {n}, column {k!r}: {x} does not fit in int64")
            keys = set(row)
            if first_keys is None:
                first_keys, first_n = keys, n
            elif keys != first_keys:
                missing, extra = sorted(first_keys - keys), sorted(keys - first_keys)
                what = f"lacks column(s) {missing} that line {first_n} has" if missing else f"has column(s) {extra} that line {first_n} lacks"
                raise ValueError(f"{f}, line {n}: {what}; every row needs the same columns")
    if first_keys is None:
        raise ValueError(f"{f}: the file has no rows")


def _where(path: Path, row: int, column: str) -> str:
    return f"{path}: row {row} (counted from 0), column {column!r}"


def _null_check(col, path: Path, column: str) -> None:
    if col.null_count:
        col = col.combine_chunks() if hasattr(col, "combine_chunks") else col
        row = int(np.flatnonzero(np.asarray(col.is_null()))[0])
        raise ValueError(f"{_where(path, row, column)}: missing or null; every row needs a value (or drop the column)")


def _ints(values, path: Path, column: str, owner: np.ndarray | None = None) -> np.ndarray:
    """An arrow array of numbers as int64: integral floats pass, anything else names its row."""
    import pyarrow as pa

    def fail(k: int, what: str):
        row = int(owner[k]) if owner is not None else k
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
            fail(k, f"{float(arr[k])!r} is not an integer")
        return arr.astype(np.int64)
    fail(0, f"holds {t} values")


def _int_column(ds, path: Path, column: str) -> np.ndarray:
    col = ds.data.column(column).combine_chunks()
    _null_check(col, path, column)
    return _ints(col, path, column)


def _list_column(ds, path: Path, column: str, *, nullable: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(per-row lengths, flat int64 values) of a list-of-integers column; null rows are empty if ``nullable``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = ds.data.column(column).combine_chunks()
    if not nullable:
        _null_check(col, path, column)
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        raise ValueError(f"{_where(path, 0, column)}: holds {col.type} values; it needs a list of integers")
    lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(col)
    return lengths, _ints(flat, path, column, owner=np.repeat(np.arange(len(lengths)), lengths))


def _image_refs(ds, path: Path, fmt: RowFormat) -> tuple[list[str] | None, list[list]]:
    """Raw text with placeholders (None: pipetune's columns without ``text`` or not in this
    format's view) and every row's image references."""
    import pyarrow as pa

    n = len(ds)
    if fmt is not RowFormat.PIPETUNE:
        texts, refs = [], []
        cols = [c for c in ds.column_names if c in ("texts", "images", "txt") or c == pair_image_column(ds.column_names)]
        for start in range(0, n, 4096):
            try:
                t, r = texts_and_images(fmt, ds.select_columns(cols)[start:start + 4096], start)
            except FormatError as e:
                raise ValueError(f"{_where(path, e.row, e.column)}: {e}") from None
            texts += t
            refs += r
        return texts, refs
    if "images" not in ds.column_names:
        return None, [[] for _ in range(n)]
    image_type = ds.data.column("images").type
    if not (pa.types.is_list(image_type) or pa.types.is_large_list(image_type) or pa.types.is_null(image_type)):
        raise ValueError(f"{_where(path, 0, 'images')}: holds {image_type} values; it needs a list of image file names")
    return None, [[image_ref(v) for v in (x or [])] for x in ds["images"]]


def _metadata(ds, path: Path, base: Path, tokenizer: TextTokenizer, fmt: RowFormat,
              bad_images: BadImages) -> tuple[SampleTable, list[tuple[int, str]]]:
    import pyarrow as pa

    cols = set(ds.column_names)
    n = len(ds)
    if fmt is RowFormat.PIPETUNE and not cols & set(TEXT_COLUMNS):
        raise ValueError(f"{path}: rows need one of the columns {TEXT_COLUMNS}, or TorchTitan's 'texts' and 'images' "
                         f"(interleaved documents) or 'txt' and 'jpg' (image-caption pairs); found {sorted(cols)}")
    ids = _int_column(ds, path, "id") if "id" in cols else np.arange(n, dtype=np.int64)
    if len(np.unique(ids)) != n:
        uniq, counts = np.unique(ids, return_counts=True)
        raise ValueError(f"{path}: sample id {uniq[np.argmax(counts > 1)]} appears more than once; ids must be unique")
    if "source" in cols:
        _null_check(ds.data.column("source"), path, "source")
    sources = ds["source"] if "source" in cols else [fmt.value if fmt is not RowFormat.PIPETUNE else "user"] * n
    names, codes = np.unique(np.asarray(sources, dtype=object).astype(str), return_inverse=True)

    texts, refs = _image_refs(ds, path, fmt)
    text_column = "texts" if fmt is RowFormat.INTERLEAVED else "txt" if fmt is RowFormat.PAIRS else "text"
    if texts is None and "input_ids" not in cols and "text" in cols:
        _null_check(ds.data.column("text"), path, "text")
        text_type = ds.data.column("text").type
        if not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type)):
            raise ValueError(f"{_where(path, 0, 'text')}: holds {text_type} values; it needs strings")
        texts = ds["text"]
    if "input_ids" in cols:
        text_tokens, _ = _list_column(ds, path, "input_ids")
    elif texts is not None:
        pieces = [tokenizer.split(t) for t in texts]
        text_tokens = np.fromiter((p.num_tokens for p in pieces), np.int64, n)
        for i, p in enumerate(pieces):
            if clash := set(tokenizer.not_text).intersection(p.token_ids):
                raise ValueError(
                    f"{_where(path, i, text_column)}: sample id={ids[i]} encodes to the image or vision marker id(s) "
                    f"{sorted(clash)} of {tokenizer.name}, which only the loader writes; remove those special-token "
                    f"strings from the text (mark images with {IMAGE_PLACEHOLDER})"
                )
    else:
        text_tokens = _int_column(ds, path, "text_tokens")

    if fmt is not RowFormat.PIPETUNE or "images" in cols:
        num_images = np.fromiter((len(r) for r in refs), np.int64, n)
    elif "num_images" in cols:
        num_images = _int_column(ds, path, "num_images")
    else:
        num_images = np.zeros(n, np.int64)

    if texts is not None and "input_ids" not in cols:
        placed = np.fromiter((len(p.image_offsets) for p in pieces), np.int64, n)
        mismatch = (placed > 0) & (placed != num_images) & ("images" in cols or "num_images" in cols)
        if mismatch.any():
            i = int(np.argmax(mismatch))
            raise ValueError(
                f"{_where(path, i, text_column)}: sample id={ids[i]} has {placed[i]} {IMAGE_PLACEHOLDER} placeholders but "
                f"{num_images[i]} images; give one {IMAGE_PLACEHOLDER} per image"
            )
        num_images = np.where(placed > 0, placed, num_images)
        first = int(tokenizer.bos is not None)  # images without placeholders open the text, after its BOS
        offsets = [p.image_offsets if p.image_offsets else [first] * int(k) for p, k in zip(pieces, num_images)]
    elif "image_offsets" in cols:
        counts, flat = _list_column(ds, path, "image_offsets", nullable=True)
        bad = counts != num_images
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{path}: sample id={ids[i]} has {counts[i]} image_offsets but {num_images[i]} images")
        offsets = np.split(flat, np.cumsum(counts)[:-1]) if n else []
    else:
        offsets = None

    sizes, unreadable = image_sizes(refs, base)
    skipped: list[tuple[int, str]] = []
    if unreadable:
        row, why = next(iter(unreadable.items()))
        if bad_images is BadImages.ERROR:
            raise ValueError(f"{_where(path, row, 'images' if fmt is not RowFormat.PAIRS else pair_image_column(ds.column_names))}: sample "
                             f"id={ids[row]}: {why} ({len(unreadable)} rows with unreadable images in all); repair or "
                             "remove the image, or skip such rows (bad_images=skip)")
        skipped = sorted(unreadable.items())
    try:
        table = SampleTable.build(
            ids=ids,
            source=codes,
            source_names=tuple(str(x) for x in names),
            text_tokens=text_tokens,
            num_images=num_images,
            image_offsets=offsets,
            image_sizes=sizes if len(sizes) else None,  # None: synthesized pixels at the standard size
            image_markers=tokenizer.image_markers if texts is not None and "input_ids" not in cols else 0,
        )
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    if skipped:
        table = table.take(np.setdiff1d(np.arange(n), [r for r, _ in skipped]))
    return table, skipped
