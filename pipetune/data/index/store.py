"""An index opened for training: O(1) in samples to open, O(batch) per step.

``open_index`` reads the manifest, checks it against the files and the job's settings, and maps
the records; nothing is read per sample until a batch asks for it. ``IndexedTable`` offers what the
batch stream and ``batch_meta`` use of a ``SampleTable`` (``len`` and ``take``) and nothing that
would touch every sample; ``IndexedStore`` reads a batch's rows from the user's files by location.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from pipetune.data.formats import RowFormat, texts_and_images
from pipetune.data.image_files import BadImages
from pipetune.data.index.disk_format import SKIPPED, MappedRecords
from pipetune.data.index.manifest import StaleIndex, check_fresh, data_root, read_manifest, rebuild_command
from pipetune.data.index.readers import Kind, RowReader
from pipetune.data.samples import SampleTable
from pipetune.data.text import BYTE_TOKENIZER, TextTokenizer


def is_index(path: str | Path) -> bool:
    return (Path(path) / "manifest.json").is_file() or (Path(path) / "build.json").is_file()


@dataclass(frozen=True)
class IndexedTable:
    """The index's sample and image records, memory-mapped; ``take(rows)`` gives the rows' ``SampleTable``.
    Pickled (a loader worker started by spawn) as its path, not its records."""

    index: Path
    source_names: tuple[str, ...]
    image_markers: int
    records: MappedRecords = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.records is None:
            object.__setattr__(self, "records", MappedRecords(self.index))

    def __reduce__(self):
        return IndexedTable, (self.index, self.source_names, self.image_markers)

    def __len__(self) -> int:
        return len(self.records.arrays["samples"])

    def take(self, idx) -> SampleTable:
        idx = np.asarray(idx, dtype=np.int64)
        samples = self.records.gather("samples", idx)
        counts = samples["num_images"].astype(np.int64)
        ptr = np.zeros(len(idx) + 1, np.int64)
        np.cumsum(counts, out=ptr[1:])
        images = self.records.gather("images", np.repeat(samples["first_image"] - ptr[:-1], counts) + np.arange(ptr[-1]))
        return SampleTable(ids=samples["id"].astype(np.int64), source=samples["source"].astype(np.int16),
                           source_names=self.source_names, text_tokens=samples["text_tokens"].astype(np.int64), num_images=counts,
                           image_offsets=images["offset"].astype(np.int64), image_ptr=ptr,
                           image_sizes=np.stack([images["height"], images["width"]], axis=1).astype(np.int64),
                           image_tokens=np.zeros(ptr[-1], np.int64), image_markers=self.image_markers)


@dataclass(frozen=True)
class IndexedStore:
    """A data set opened through its index; the same interface as ``SampleStore`` (``table``,
    ``rows``, ``digest``, ``skipped``, ...). ``path`` is the data root (image file names come
    absolute), ``origin`` the index."""

    table: IndexedTable
    manifest: dict
    path: Path
    origin: Path
    tokenizer: TextTokenizer
    _reader: RowReader = field(default_factory=RowReader, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.table)

    @property
    def digest(self) -> str:
        return f"index:{self.manifest['digest']}:{self.content_seed}"

    @property
    def content_seed(self) -> int:
        return self.manifest["sets"][0]["content_seed"]

    @property
    def has_token_ids(self) -> bool:
        return all(s["has_token_ids"] for s in self.manifest["sets"])

    @property
    def has_image_files(self) -> bool:
        return any(s["has_image_files"] for s in self.manifest["sets"])

    @property
    def has_images(self) -> bool:
        return self.manifest["images"] > 0

    @property
    def raw_text(self) -> bool:
        """Whether text was tokenized by ``tokenizer`` (not stored as token ids)."""
        return any(s["raw_text"] for s in self.manifest["sets"])

    @cached_property
    def skipped(self) -> tuple[tuple[str, str], ...]:
        """Rows left out at indexing: (``file, row N``, reason)."""
        with (self.origin / SKIPPED).open() as fh:
            return tuple((f"{f}, row {r}", why) for f, r, why in map(json.loads, fh))

    @cached_property
    def _files(self) -> list[tuple[Kind, Path, dict, Path]]:
        root = data_root(self.manifest["settings"])
        return [(Kind(s["kind"]), root / f["path"], s, root / s["base"]) for s in self.manifest["sets"] for f in s["files"]]

    def check_token_ids(self, vocab_size: int) -> None:
        """Stored token ids and the tokenizer's ids fit the model (from the manifest: no pass over the rows)."""
        rng = self.manifest["token_range"]
        if rng is not None and (rng[0] < 0 or rng[1] >= vocab_size):
            bad = rng[1] if rng[1] >= vocab_size else rng[0]
            raise ValueError(f"{self.origin}: the data set's `input_ids` hold token id {bad}, outside the model's vocabulary "
                             f"of {vocab_size}; tokenize with the model's tokenizer")
        if self.raw_text and self.tokenizer.vocab_size > vocab_size:
            raise ValueError(f"{self.origin}: raw text is tokenized by {self.tokenizer.name} into ids up to "
                             f"{self.tokenizer.vocab_size - 1}, beyond the model's vocabulary of {vocab_size}; use a tokenizer "
                             "that fits the model or store pre-tokenized `input_ids` instead")

    def rows(self, indices, *, images: bool = True) -> list[dict]:
        """As ``SampleStore.rows``, read from the files by location."""
        indices = np.asarray([int(i) for i in indices], np.int64)
        if not self.has_token_ids:
            return [{} for _ in indices]  # generated metadata: content is synthesized from the ids
        samples = self.table.records.gather("samples", indices)
        files, locs, spans = samples["file"], samples["loc"], samples["span"]
        out: list[dict] = [{} for _ in indices]
        for f in np.unique(files).tolist():
            kind, path, s, base = self._files[f]
            sel = np.flatnonzero(files == f)
            fmt = RowFormat(s["format"])
            if fmt is RowFormat.PIPETUNE:
                want = [c for c in ("input_ids", "text") + (("images",) if images else ()) if c in s["columns"]]
            else:
                want = [c for c in s["columns"] if c in ("texts", "images", "txt") or c == _pair_column(s["columns"])]
            raw = self._reader.read(kind, path, locs[sel], spans[sel], want)
            if fmt is not RowFormat.PIPETUNE:
                texts, refs = texts_and_images(fmt, {c: [r[c] for r in raw] for c in want})
                raw = [{"text": t, **({"images": r} if images else {})} for t, r in zip(texts, refs)]
            for k, row in zip(sel.tolist(), raw):
                if "images" in row:
                    row["images"] = [str(base / r) if isinstance(r, str) else r for r in row["images"]]
                out[k] = row
        return out


def _pair_column(columns) -> str | None:
    from pipetune.data.formats import pair_image_column

    return pair_image_column(columns)


def open_index(index: str | Path, *, tokenizer: TextTokenizer = BYTE_TOKENIZER,
               bad_images: BadImages | str = BadImages.ERROR) -> IndexedStore:
    """Open an index built by ``pipetune data index``; refuse one that is partial, stale, or built
    under another tokenizer (where raw text was tokenized) or a laxer bad-image policy."""
    index = Path(index)
    manifest = read_manifest(index)
    settings = manifest["settings"]
    again = f"`{rebuild_command(settings, index)}` with the job's settings"
    raw_text = any(s["raw_text"] for s in manifest["sets"])
    if raw_text and settings["tokenizer"] != tokenizer.fingerprint:
        raise StaleIndex(f"{index}: built with {settings['tokenizer_name']}, but the job tokenizes with {tokenizer.name} "
                         f"(another fingerprint); build the index again: {again}")
    if manifest["bad_image_rows"] and BadImages(bad_images) is BadImages.ERROR:
        raise StaleIndex(f"{index}: built with bad_images=skip, which left out {manifest['bad_image_rows']} rows with unreadable "
                         f"images (listed in {index / SKIPPED}); the job says bad_images=error: set bad_images=skip, or repair "
                         "the data and build the index again")
    check_fresh(manifest, index)
    table = IndexedTable(index.resolve(), tuple(manifest["source_names"]), manifest["image_markers"])
    return IndexedStore(table=table, manifest=manifest, path=Path(settings["data"]), origin=index.resolve(), tokenizer=tokenizer)
