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
from 0 over the data set's rows) and the column; an unreadable file (a parquet file or JSON-lines
file without rows, files of one data set with different columns, a webdataset shard without tar's
end-of-archive blocks, i.e. cut short) is an error naming the file. Blank lines of JSON lines are
not rows. Image sizes are read from their headers when the data set is opened; a row with an
unreadable image (a remote URL included) is an error or, under ``BadImages.SKIP``, left out and
listed in ``SampleStore.skipped`` (``pipetune.data.image_files``). A row without a text token (a
document of images only) has nothing to train on: it is always left out and listed there; a data
set left without rows is an error (``pipetune.data.metadata`` derives and checks the rows).

Opening a data set derives every row's metadata: seconds per 100k rows, on every rank at every
start. ``open_dataset`` also opens a metadata index (``pipetune data index``,
``pipetune.data.index``), which serves the same samples in O(1) per open and O(batch) per step.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipetune.data.formats import RowFormat, raw_images, texts_and_images
from pipetune.data.image_files import BadImages
from pipetune.data.inputs import INFO_FILE, REMAKE, data_files, data_set_dirs, first_line, read_info
from pipetune.data.metadata import row_metadata
from pipetune.data.samples import SampleTable
from pipetune.data.text import BYTE_TOKENIZER, TextTokenizer

INDEX_HINT_ROWS = 1_000_000
"""Above this many rows, opening a data set without an index prints how to index it."""


@dataclass(frozen=True)
class SampleStore:
    """An opened data set: metadata of every row plus access to the rows' content.

    ``table`` row ``i`` describes data set row ``i`` (with ``tokens_per_image`` unset: it is the
    model's). ``content_seed`` seeds the synthesized token ids and pixels of rows without content.
    ``origin`` is the path it was opened from; ``digest`` fingerprints its metadata and content
    seed (``SampleTable.digest``), so a checkpoint can tell whether it was made on these rows.
    ``skipped`` lists the rows left out, for an unreadable image or no text token (row of the data
    set as stored, reason); ``dataset`` holds the others, in order.
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

    @property
    def has_images(self) -> bool:
        return bool(self.table.num_images.any())

    @property
    def raw_text(self) -> bool:
        """Whether text was tokenized by ``tokenizer`` (not stored as token ids)."""
        cols = set(self.dataset.column_names)
        return "input_ids" not in cols and (self.format is not RowFormat.PIPETUNE or "text" in cols)

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
                stored = np.delete(np.arange(len(lengths) + len(self.skipped)), [r for r, _ in self.skipped])[row]  # as messages count
                raise ValueError(
                    f"{self.origin}: row {stored} (counted from 0), column 'input_ids': sample id={self.table.ids[row]} has "
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

    @property
    def raw_text(self) -> bool:
        return any(p.raw_text for p in self.parts)

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

    from pipetune.data.index.store import is_index, open_index

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data set {path} does not exist (make one with `pipetune data make`)")
    if is_index(path):
        return open_index(path, tokenizer=tokenizer, bad_images=bad_images)
    if sources := data_set_dirs(path):
        return MixedStore.of(path, [open_dataset(p, tokenizer=tokenizer, bad_images=bad_images) for p in sources])
    info = read_info(path)
    ds, files = _load(path)
    if len(ds) == 0:
        raise ValueError(f"{path}: the data set has no rows")
    if len(ds) > INDEX_HINT_ROWS:
        print(f"note: {path} has {len(ds):,} rows, derived again at every start on every rank; index it once with "
              f"`pipetune data index {path} --out INDEX` and give INDEX as the data set", file=sys.stderr)
    ds = raw_images(ds)
    fmt = RowFormat.of(ds.column_names)
    base = path if path.is_dir() else path.parent
    cache = None if _names_image_files(ds) else _MetadataCache.of(ds, tokenizer, fmt, BadImages(bad_images))
    if cache is not None and (cached := cache.load()) is not None:
        table, skipped = cached
    else:
        try:
            table, skipped = row_metadata(ds, path, base, tokenizer, fmt, BadImages(bad_images), progress=True)
        except (pa.ArrowException, OSError) as e:  # a damaged file found while reading its columns
            raise ValueError(f"{path}: cannot read the data set's rows ({first_line(e)}); {REMAKE}") from None
        if cache is not None:
            cache.save(table, skipped)
    if not len(table):
        row, why = skipped[0]
        raise ValueError(f"{path}: no row is left: all {len(skipped)} are left out (row {row}: {why}); give rows with text "
                         "and readable images")
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

    VERSION = 2  # 2: rows without a text token are left out

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


def _load(path: Path):
    """Open the data set with HF ``datasets``; any failure becomes a message naming the file."""
    import datasets

    if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:  # datasets/pyarrow raise many types on a damaged directory
            raise ValueError(f"{path}: cannot open the data set ({first_line(e)}); {REMAKE}") from None
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return ds, [path]
    files, kind = data_files(path)
    _CHECKS[kind](files)
    from datasets.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(hf_logging.CRITICAL)  # its failure lines name no row; ours below do
    try:
        return datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train", **_LOAD_OPTIONS.get(kind, {})), files
    except Exception as e:  # the JSON/parquet readers raise many types; find the line ourselves
        if kind in _DIAGNOSES:
            _DIAGNOSES[kind](files)
        raise ValueError(f"cannot read {', '.join(map(str, files))} ({first_line(e)}); {REMAKE}") from None
    finally:
        hf_logging.set_verbosity(level)


_LOAD_OPTIONS = {"json": {"on_mixed_types": None}}
"""HF's default for JSON lines (``use_json``) parses the first 10 MB line by line itself, failing on
blank lines, and reads a column whose rows mix types as JSON text, which an error then names at
the wrong row; plain pyarrow skips blank lines (they are not rows) and fails on a mixed column,
whose line ``_diagnose_json_lines`` names, as the index's reader does."""


def _check_parquet(files: list[Path]) -> None:
    """Every parquet file holds rows and the first file's columns, read from the footers before HF
    ``datasets`` reads them (it fails on either naming neither the file nor the cause)."""
    from pipetune.data.index.readers import no_rows, parquet_file, same_columns

    first = None
    for f in files:
        pf = parquet_file(f)
        if pf.metadata.num_rows == 0:
            raise no_rows(f)
        first = first or (f, pf.schema_arrow.names)
        same_columns(f, pf.schema_arrow.names, *first)


def _check_json_lines(files: list[Path]) -> None:
    """Every JSON-lines file holds a row, with the first file's columns (its first row's keys),
    before HF ``datasets`` reads them: it reads a file without rows as none and fills the columns
    one file lacks with nulls. A first line that does not parse is left to the reader."""
    from pipetune.data.index.readers import no_rows, same_columns

    first = None
    for f in files:
        with f.open("rb") as fh:
            line = next((x for x in fh if x.strip()), None)
        if line is None:
            raise no_rows(f)
        if line.lstrip()[:1] == b"[":
            continue  # a JSON array file, not JSON lines
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            first = first or (f, list(row))
            same_columns(f, list(row), *first)


def _check_shards(files: list[Path]) -> None:
    """Every shard ends in tar's end-of-archive blocks (HF ``datasets`` reads a cut one as shorter)."""
    from pipetune.data.index.readers import check_shard

    for f in files:
        check_shard(f)


def _diagnose_parquet_types(files: list[Path]) -> None:
    """Name a column whose type differs between parquet files (called on failure only)."""
    from pipetune.data.index.readers import parquet_file

    first = parquet_file(files[0]).schema_arrow
    for f in files[1:]:
        for field in parquet_file(f).schema_arrow:
            if field.type != first.field(field.name).type:
                raise ValueError(f"{f}: column {field.name!r} holds {field.type} values, {files[0]} holds "
                                 f"{first.field(field.name).type}; every file of a data set needs the same column types")


def _diagnose_json_lines(files: list[Path]) -> None:
    """Name the first line of JSON-lines files that the reader choked on, with the index's reader's
    checks and messages (called on failure only: it parses every line in Python)."""
    import pyarrow as pa

    from pipetune.data.index.readers import Kind, chunks

    for f in files:
        with f.open("rb") as fh:
            if fh.read(4096).lstrip()[:1] == b"[":
                continue  # a JSON array file, not JSON lines
        try:
            for _ in chunks(Kind.JSONL, f):
                pass
        except (pa.ArrowException, TypeError, OverflowError):
            return  # rows pyarrow cannot hold but no line to blame: the caller names the files


_CHECKS = {"json": _check_json_lines, "parquet": _check_parquet, "webdataset": _check_shards}
"""What each reader's files are checked for before HF ``datasets`` reads them (cheap: first lines,
footers, tar headers)."""
_DIAGNOSES = {"json": _diagnose_json_lines, "parquet": _diagnose_parquet_types}
"""What names the cause when HF ``datasets`` fails on a reader's files (costly: called on failure only)."""


