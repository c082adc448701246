"""The user's files read in place: in chunks for the index build, and row by row by location.

A sample's location is ``(file, loc, span)``: for parquet and ``save_to_disk`` Arrow files the
row within the file (``span`` 0); for JSON lines the byte offset and length of its line; for a
webdataset shard the byte offset of its first member's header and the bytes up to the end of its
last member. Rows come out as the column values HF ``datasets`` gives for the same files (image
columns left encoded, as ``pipetune.data.formats.raw_images`` leaves them; webdataset members
decoded by extension as HF's webdataset reader does), so the indexed and the un-indexed paths
build the same tensors.

HF ``datasets`` is not used to read: ``load_dataset`` copies parquet and webdataset inputs into an
Arrow cache (a 100 TB corpus cannot be copied per machine) and has no way to read one row by
location. Random access to parquet decodes the row group holding the row (the last few are kept
per process): write parquet for training with small row groups (a few thousand rows).
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np

from pipetune.data.inputs import first_line

CHUNK_ROWS = 8192
"""Rows per chunk of the index build (JSON lines, Arrow files)."""


class Kind(str, Enum):
    ARROW = "arrow"  # a ``save_to_disk`` directory's Arrow files
    PARQUET = "parquet"
    JSONL = "jsonl"
    WEBDATASET = "webdataset"
    GENERATED = "generated"  # no files: metadata written directly, content synthesized from the ids


@dataclass(frozen=True)
class Chunk:
    """Rows ``first_row ..`` of a file as an Arrow table, with each row's location."""

    first_row: int
    table: object  # pyarrow.Table
    loc: np.ndarray
    span: np.ndarray


class ReadError(ValueError):
    """A file that cannot be read as its kind; the message names it and what to do."""


def no_rows(file: Path) -> ReadError:
    """A file without rows, refused on both paths (the un-indexed one checks before HF ``datasets``
    reads the files, ``pipetune.data.storage``: HF fails on it naming no file, or reads no rows)."""
    return ReadError(f"{file}: the file holds no rows; remove it from the data set or write it again with its rows")


def same_columns(file: Path, columns, first_file: Path, first_columns) -> None:
    """Every file of a data set has the columns of its first file."""
    if set(columns) != set(first_columns):
        raise ReadError(f"{file}: has columns {sorted(columns)}, {first_file} has {sorted(first_columns)}; every file of a "
                        "data set needs the same columns")


# ---------------------------------------------------------------- the build's chunks


def chunks(kind: Kind, file: Path) -> Iterator[Chunk]:
    """Every row of ``file`` once, in order, in chunks; a file with no rows is an error."""
    produced = False
    for chunk in _CHUNKERS[kind](file):
        produced = produced or chunk.table.num_rows > 0
        yield chunk
    if not produced:
        raise no_rows(file)


def columns_of(kind: Kind, file: Path) -> list[str]:
    """Column names of ``file`` (of its first row where rows carry their own: JSON lines, shards);
    every file of a data set must have the same. Reads a footer, a schema or one row."""
    if kind is Kind.PARQUET:
        return parquet_file(file).schema_arrow.names
    if kind is Kind.ARROW:
        return _arrow_table(file).column_names
    with file.open("rb") as fh:
        if kind is Kind.JSONL:
            line = next((x for x in fh if x.strip()), None)
            return list(json.loads(line)) if line is not None and line.lstrip()[:1] == b"{" else []
        try:
            return list(next(_tar_samples(file, fh), ({},))[0])
        except (tarfile.TarError, EOFError):
            return []  # the file's own chunks name the error


def parquet_file(file: Path):
    """``file`` opened as a ``pyarrow.parquet.ParquetFile`` (its footer read), or a message naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(file)
    except (pa.ArrowException, OSError) as e:
        raise _unreadable_parquet(file, e) from None


def _unreadable_parquet(file: Path, e: BaseException) -> ReadError:
    return ReadError(f"{file}: cannot read the parquet file ({first_line(e)}); the file may be truncated or corrupt: write it again")


def _parquet_chunks(file: Path) -> Iterator[Chunk]:
    import pyarrow as pa

    pf = parquet_file(file)
    try:
        first = 0
        for g in range(pf.num_row_groups):
            t = pf.read_row_group(g)
            rows = np.arange(first, first + t.num_rows, dtype=np.int64)
            yield Chunk(first, t, rows, np.zeros(len(rows), np.int64))
            first += t.num_rows
    except (pa.ArrowException, OSError) as e:
        raise _unreadable_parquet(file, e) from None


def _arrow_chunks(file: Path) -> Iterator[Chunk]:
    import pyarrow as pa

    try:
        table = _arrow_table(file)
    except (pa.ArrowException, OSError) as e:
        raise ReadError(f"{file}: cannot read the Arrow file ({first_line(e)}); the file may be truncated or corrupt: "
                        "save the data set again") from None
    for first in range(0, max(table.num_rows, 1), CHUNK_ROWS):
        t = table.slice(first, CHUNK_ROWS)
        rows = np.arange(first, first + t.num_rows, dtype=np.int64)
        yield Chunk(first, t, rows, np.zeros(len(rows), np.int64))


def _jsonl_chunks(file: Path) -> Iterator[Chunk]:
    """JSON lines, blank lines skipped (row ``k`` is the ``k``-th non-blank line); a bad line is
    named by its line number."""
    import pyarrow as pa

    def chunk() -> Chunk:
        try:
            table = pa.Table.from_pylist(rows)
        except (pa.ArrowException, TypeError, OverflowError):
            _name_type_clash(file, rows, first_keys, numbers)
            raise
        return Chunk(first, table, np.asarray(locs, np.int64), np.asarray(spans, np.int64))

    with file.open("rb") as fh:
        if fh.read(4096).lstrip()[:1] == b"[":
            raise ReadError(f"{file}: a JSON array; the index reads JSON lines (one object per line): write it as .jsonl")
        fh.seek(0)
        rows, locs, spans, numbers = [], [], [], []
        first_keys = first_line = None
        first = offset = 0
        for n, line in enumerate(fh, 1):
            at, offset = offset, offset + len(line)
            body = line.rstrip(b"\r\n")
            if not body.strip():
                continue
            row = _json_row(file, n, body)
            if first_keys is None:
                first_keys, first_line = list(row), n
            elif set(row) != set(first_keys):
                missing, extra = sorted(set(first_keys) - set(row)), sorted(set(row) - set(first_keys))
                what = f"lacks column(s) {missing} that line {first_line} has" if missing else f"has column(s) {extra} that line {first_line} lacks"
                raise ReadError(f"{file}, line {n}: {what}; every row needs the same columns")
            rows.append(row)
            locs.append(at)
            spans.append(len(body))
            numbers.append(n)
            if len(rows) == CHUNK_ROWS:
                yield chunk()
                first += len(rows)
                rows, locs, spans, numbers = [], [], [], []
        if rows:
            yield chunk()


def _json_row(file: Path, n: int, line: bytes) -> dict:
    try:
        row = json.loads(line)
    except ValueError as e:
        raise ReadError(f"{file}, line {n}: not valid JSON ({e}); write one JSON object per line") from None
    if not isinstance(row, dict):
        raise ReadError(f"{file}, line {n}: expected a JSON object with the row's columns, got {type(row).__name__}")
    for k, v in row.items():
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, int) and not isinstance(x, bool) and not -(2**63) <= x < 2**63:
                raise ReadError(f"{file}, line {n}, column {k!r}: {x} does not fit in int64")
    return row


def _kind_of(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, list):
        inner = {_kind_of(x) for x in value} - {"null"}
        return f"list of {'/'.join(sorted(inner)) or 'nothing'}"
    return type(value).__name__


def _name_type_clash(file: Path, rows: list[dict], keys, line_numbers: list[int]) -> None:
    """Raise naming the first line whose value's type differs from the column's first (called on failure)."""
    for k in keys:
        seen = None
        for row, n in zip(rows, line_numbers):
            kind = _kind_of(row[k])
            if kind in ("null", "list of nothing"):
                continue
            if seen is None:
                seen, seen_at = kind, n
            elif kind != seen and not {kind, seen} <= {"list of number", "list of nothing"}:
                raise ReadError(f"{file}, line {n}, column {k!r}: holds a {kind} where line {seen_at} holds a {seen}; a "
                                "column needs one type in every row")


_MEMBER = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
"""A webdataset member name: ``key.field`` (webdataset's and HF's ``base_plus_ext``)."""

_TEXT_FIELDS = {"txt", "text", "transcript"}
_INT_FIELDS = {"cls", "cls2", "index", "inx", "id"}
_JSON_FIELDS = {"json", "jsn"}


def _decode_member(field: str, data: bytes):
    ext = field.rsplit(".", 1)[-1].lower()
    if ext in _TEXT_FIELDS:
        return data.decode("utf-8")
    if ext in _INT_FIELDS:
        return int(data)
    if ext in _JSON_FIELDS:
        return json.loads(data)
    return data  # images and anything else stay encoded


def _tar_samples(file: Path, fh) -> Iterator[tuple[dict, int, int]]:
    """``(row, loc, span)`` of every sample of an open shard: consecutive members sharing a key."""
    current: dict = {}
    key = start = end = None
    with tarfile.open(fileobj=fh, mode="r:") as tar:
        for m in tar:
            if not m.isfile():
                continue
            match = _MEMBER.match(m.name)
            if not match:
                continue
            k, field = match.group(1), match.group(2)
            if current and k != key:
                yield current, start, end - start
                current = {}
            if not current:
                key, start = k, m.offset
            f = tar.extractfile(m)
            current[field] = _decode_member(field, f.read())
            end = m.offset_data + -(-m.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
        if current:
            yield current, start, end - start
        _check_tar_end(file, fh, tar.offset)


def check_shard(file: Path) -> None:
    """The shard's member headers read, and it ends in tar's end-of-archive blocks: a shard cut at
    a member boundary is otherwise a valid, shorter archive whose missing rows nobody notices. Reads
    the headers only (the un-indexed path checks every shard with it before HF ``datasets`` reads it)."""
    with file.open("rb") as fh:
        try:
            with tarfile.open(fileobj=fh, mode="r:") as tar:
                for _ in tar:
                    pass
                end = tar.offset
        except (tarfile.TarError, EOFError) as e:
            raise _unreadable_shard(file, e) from None
        _check_tar_end(file, fh, end)


def _check_tar_end(file: Path, fh, end: int) -> None:
    """Two zero blocks at ``end``, where tar stopped reading headers (the end of its last member)."""
    fh.seek(0, io.SEEK_END)
    size = fh.tell()
    fh.seek(end)
    if size < end + 2 * tarfile.BLOCKSIZE or fh.read(2 * tarfile.BLOCKSIZE).strip(b"\0"):
        raise ReadError(f"{file}: the shard ends at byte {size} without tar's end-of-archive blocks: it was cut short (a "
                        "copy or download that stopped); copy or write the shard again")


def _unreadable_shard(file: Path, e: BaseException) -> ReadError:
    return ReadError(f"{file}: not a readable tar shard ({first_line(e)}); the shard may be truncated or corrupt: copy or "
                     "write it again")


def _webdataset_chunks(file: Path) -> Iterator[Chunk]:
    import pyarrow as pa

    try:
        with file.open("rb") as fh:
            rows, locs, spans, first = [], [], [], 0
            for row, loc, span in _tar_samples(file, fh):
                rows.append(row)
                locs.append(loc)
                spans.append(span)
                if len(rows) == CHUNK_ROWS:
                    yield Chunk(first, pa.Table.from_pylist(rows), np.asarray(locs, np.int64), np.asarray(spans, np.int64))
                    first += len(rows)
                    rows, locs, spans = [], [], []
            if rows:
                yield Chunk(first, pa.Table.from_pylist(rows), np.asarray(locs, np.int64), np.asarray(spans, np.int64))
    except (tarfile.TarError, EOFError) as e:
        raise _unreadable_shard(file, e) from None


_CHUNKERS = {Kind.PARQUET: _parquet_chunks, Kind.ARROW: _arrow_chunks, Kind.JSONL: _jsonl_chunks,
             Kind.WEBDATASET: _webdataset_chunks}


# ---------------------------------------------------------------- rows by location


class RowReader:
    """Reads rows by location; keeps per process the files' handles and the last row groups
    decoded (a loader worker reads the batches of many steps)."""

    def __init__(self, cache_groups: int = 4):
        self._groups: OrderedDict = OrderedDict()
        self._cache_groups = cache_groups
        self._meta: dict = {}

    def __reduce__(self):  # another process starts with its own caches
        return RowReader, (self._cache_groups,)

    def read(self, kind: Kind, file: Path, loc: np.ndarray, span: np.ndarray, columns: list[str]) -> list[dict]:
        """The rows at ``loc``/``span`` of ``file``, as dicts of ``columns``."""
        if kind is Kind.JSONL:
            with file.open("rb") as fh:
                return [{c: r.get(c) for c in columns} for r in (json.loads(_read_at(fh, lo, n)) for lo, n in zip(loc.tolist(), span.tolist()))]
        if kind is Kind.WEBDATASET:
            with file.open("rb") as fh:
                out = []
                for lo, n in zip(loc.tolist(), span.tolist()):
                    piece = io.BytesIO(_read_at(fh, lo, n) + b"\0" * (2 * tarfile.BLOCKSIZE))
                    row = next(_tar_samples(file, piece))[0]
                    out.append({c: row.get(c) for c in columns})
                return out
        if kind is Kind.ARROW:
            table = self._cached(("arrow", file), lambda: _arrow_table(file))
            return table.select(columns).take(loc).to_pylist()
        return self._parquet_rows(file, loc, columns)

    def _parquet_rows(self, file: Path, loc: np.ndarray, columns: list[str]) -> list[dict]:
        import pyarrow.parquet as pq

        pf, ends = self._meta.get(file) or self._meta.setdefault(file, _parquet_meta(pq.ParquetFile(file)))
        group = np.searchsorted(ends, loc, side="right")
        out: list[dict | None] = [None] * len(loc)
        for g in np.unique(group).tolist():
            sel = np.flatnonzero(group == g)
            t = self._cached(("parquet", file, g, tuple(columns)), lambda: pf.read_row_group(g, columns=columns))
            start = ends[g - 1] if g else 0
            for k, row in zip(sel.tolist(), t.take(loc[sel] - start).to_pylist()):
                out[k] = row
        return out

    def _cached(self, key, make):
        if key in self._groups:
            self._groups.move_to_end(key)
            return self._groups[key]
        value = self._groups[key] = make()
        while len(self._groups) > self._cache_groups:
            self._groups.popitem(last=False)
        return value


def _parquet_meta(pf) -> tuple:
    return pf, np.cumsum([pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)])


def _read_at(fh, offset: int, n: int) -> bytes:
    fh.seek(offset)
    return fh.read(n)


def _arrow_table(file: Path):
    """A ``save_to_disk`` Arrow file, memory-mapped (its pages are read on access, not copied)."""
    import pyarrow as pa

    source = pa.memory_map(str(file))
    try:
        return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        return pa.ipc.open_file(source).read_all()
