"""What a data set path holds: one data set or a directory of them, and its ``pipetune.json``.

Shared by opening a data set (``pipetune.data.storage``) and indexing one (``pipetune.data.index``).
"""

from __future__ import annotations

import json
from pathlib import Path

INFO_FILE = "pipetune.json"

REMAKE = "the file may be truncated or corrupt: make the data set again (`pipetune data make`) or repair the file"


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def read_info(path: Path) -> dict:
    f = path / INFO_FILE
    if not f.is_file():
        return {}
    try:
        info = json.loads(f.read_text())
    except ValueError as e:
        raise ValueError(f"{f}: not valid JSON ({e}); {REMAKE}") from None
    if not isinstance(info, dict):
        raise ValueError(f"{f}: expected a JSON object; {REMAKE}")
    return info


SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".tar": "webdataset"}


def data_set_dirs(path: Path) -> list[Path]:
    """The data sets of a directory of data sets (its subdirectories), or none when ``path`` is a
    data set itself."""
    if not path.is_dir() or (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        return []
    if any(p.is_file() and p.suffix in SUFFIXES and p.name != INFO_FILE for p in path.iterdir()):
        return []
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


def data_files(path: Path) -> tuple[list[Path], str]:
    """The files of a data set that is a file or a directory of files (not ``save_to_disk``), and
    the HF ``datasets`` reader of their one format; refused in one line naming what is wrong."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and p.name != INFO_FILE)
    if not files:
        raise ValueError(f"{path}: no HF data set, .jsonl, .json, .parquet or webdataset .tar files found")
    kinds = {SUFFIXES.get(f.suffix) for f in files}
    if None in kinds:
        raise ValueError(f"{path}: {files[0].name} is none of the accepted inputs (a save_to_disk directory, .jsonl, .json, "
                         ".parquet, or webdataset .tar shards)")
    if len(kinds) > 1:
        raise ValueError(f"{path}: mixes {' and '.join(sorted(kinds))} files; keep one format per directory")
    for f in files:
        if f.stat().st_size == 0:
            raise ValueError(f"{f}: the file is empty; a data set needs at least one row")
    return files, kinds.pop()
