"""Data sets on local disk: generated mixes and users' own data, read through one code path.

Accepted inputs for ``--data``: a directory written by ``datasets.Dataset.save_to_disk`` (what
``pipetune data make`` writes), a ``.jsonl``/``.json``/``.parquet`` file, or a directory of such
files. One row is one sample:

| column          | type        | meaning                                                             |
|-----------------|-------------|---------------------------------------------------------------------|
| ``id``          | int         | unique sample id (default: row number)                              |
| ``source``      | str         | corpus name (default ``"user"``)                                    |
| ``input_ids``   | list[int]   | pre-tokenized text (preferred for real data)                        |
| ``text``        | str         | raw text; ``<image>`` marks where each image goes; byte-tokenized   |
| ``text_tokens`` | int         | length only; token ids are synthesized from the id (generated data) |
| ``images``      | list[str]   | image files, relative to the data file's directory                  |
| ``num_images``  | int         | image count when there are no files (pixels are synthesized)        |
| ``image_offsets`` | list[int] | text offset of each image (default: all images before the text)    |

A row needs one of ``input_ids``, ``text`` or ``text_tokens``; all rows of a file have the same columns.
Loading never drops a row: a bad row
is an error that names it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipetune.data.samples import SampleTable
from pipetune.data.text import IMAGE_PLACEHOLDER, split_on_images

INFO_FILE = "pipetune.json"
TEXT_COLUMNS = ("input_ids", "text", "text_tokens")


@dataclass(frozen=True)
class SampleStore:
    """An opened data set: metadata of every row plus access to the rows' content.

    ``table`` row ``i`` describes data set row ``i`` (with ``tokens_per_image`` unset: it is the
    model's). ``content_seed`` seeds the synthesized token ids and pixels of rows without content.
    """

    table: SampleTable
    dataset: object
    path: Path
    content_seed: int
    has_token_ids: bool
    has_image_files: bool

    def __len__(self) -> int:
        return len(self.table)

    def rows(self, indices) -> list[dict]:
        """Content columns of the given rows (empty dicts when the data set is metadata-only)."""
        cols = [c for c in ("input_ids", "text", "images") if c in self.dataset.column_names]
        if not cols:
            return [{} for _ in indices]
        sub = self.dataset.select_columns(cols)[list(int(i) for i in indices)]
        return [{c: sub[c][k] for c in cols} for k in range(len(indices))]


def write_dataset(table: SampleTable, out: str | Path, info: dict) -> Path:
    """Store metadata records as an HF data set on disk, with ``pipetune.json`` beside it."""
    import datasets

    out = Path(out)
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
    ds.save_to_disk(str(out))
    (out / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
    return out


def open_dataset(path: str | Path) -> SampleStore:
    """Open any accepted input (see module doc) and derive the metadata of every row."""
    import datasets

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data set {path} does not exist (make one with `pipetune data make`)")
    info = json.loads((path / INFO_FILE).read_text()) if (path / INFO_FILE).is_file() else {}
    if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    else:
        files = [path] if path.is_file() else sorted(
            p for p in path.iterdir() if p.suffix in (".jsonl", ".json", ".parquet") and p.name != INFO_FILE
        )
        if not files:
            raise ValueError(f"{path}: no HF data set, .jsonl, .json or .parquet files found")
        kinds = {"parquet" if f.suffix == ".parquet" else "json" for f in files}
        if len(kinds) > 1:
            raise ValueError(f"{path}: mixes parquet and json files; keep one format per directory")
        ds = datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train")
    if len(ds) == 0:
        raise ValueError(f"{path}: the data set has no rows")
    return SampleStore(
        table=_metadata(ds, path),
        dataset=ds,
        path=path if path.is_dir() else path.parent,
        content_seed=int(info.get("seed", 0)),
        has_token_ids=bool({"input_ids", "text"} & set(ds.column_names)),
        has_image_files="images" in ds.column_names,
    )


def _metadata(ds, path: Path) -> SampleTable:
    cols = set(ds.column_names)
    n = len(ds)
    if not cols & set(TEXT_COLUMNS):
        raise ValueError(f"{path}: rows need one of the columns {TEXT_COLUMNS}; found {sorted(cols)}")
    ids = np.asarray(ds["id"], dtype=np.int64) if "id" in cols else np.arange(n, dtype=np.int64)
    if len(np.unique(ids)) != n:
        uniq, counts = np.unique(ids, return_counts=True)
        raise ValueError(f"{path}: sample id {uniq[np.argmax(counts > 1)]} appears more than once; ids must be unique")
    sources = ds["source"] if "source" in cols else ["user"] * n
    names, codes = np.unique(np.asarray(sources, dtype=object).astype(str), return_inverse=True)

    if "input_ids" in cols:
        text_tokens = np.fromiter((len(x) for x in ds["input_ids"]), np.int64, n)
    elif "text" in cols:
        pieces = [split_on_images(t) for t in ds["text"]]
        text_tokens = np.fromiter((p.num_tokens for p in pieces), np.int64, n)
    else:
        text_tokens = np.asarray(ds["text_tokens"], dtype=np.int64)

    if "images" in cols:
        num_images = np.fromiter((len(x or []) for x in ds["images"]), np.int64, n)
    elif "num_images" in cols:
        num_images = np.asarray(ds["num_images"], dtype=np.int64)
    else:
        num_images = np.zeros(n, np.int64)

    if "text" in cols and "input_ids" not in cols:
        placed = np.fromiter((len(p.image_offsets) for p in pieces), np.int64, n)
        mismatch = (placed > 0) & (placed != num_images) & ("images" in cols or "num_images" in cols)
        if mismatch.any():
            i = int(np.argmax(mismatch))
            raise ValueError(
                f"{path}: sample id={ids[i]} has {placed[i]} {IMAGE_PLACEHOLDER} placeholders but {num_images[i]} images"
            )
        num_images = np.where(placed > 0, placed, num_images)
        offsets = [p.image_offsets if p.image_offsets else [0] * int(k) for p, k in zip(pieces, num_images)]
    elif "image_offsets" in cols:
        offsets = [list(o or []) for o in ds["image_offsets"]]
        bad = np.fromiter((len(o) for o in offsets), np.int64, n) != num_images
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{path}: sample id={ids[i]} has {len(offsets[i])} image_offsets but {num_images[i]} images")
    else:
        offsets = None
    try:
        return SampleTable.build(
            ids=ids,
            source=codes,
            source_names=tuple(str(x) for x in names),
            text_tokens=text_tokens,
            num_images=num_images,
            image_offsets=offsets,
        )
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
