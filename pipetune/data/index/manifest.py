"""What an index covers: the input's data sets and files, and the checks that refuse a stale index.

``manifest.json`` is written last, so a directory without it is a partial index. It records each
file's size, modification time and sample count, the tokenizer's fingerprint, the formats and the
bad-image policy; ``check_fresh`` compares them with the files on disk at every open (a ``stat``
per file and a listing per directory: cost grows with files, not samples).
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from pipetune.data.index.readers import Kind
from pipetune.data.inputs import SUFFIXES, data_files, data_set_dirs, read_info

MANIFEST = "manifest.json"
SETTINGS = "build.json"
VERSION = 2  # 2: sample and image records instead of a file per field


class StaleIndex(ValueError):
    """The index does not describe the files on disk (or the job's settings): rebuild it."""


@dataclass(frozen=True)
class InputSet:
    """One data set of the input: its files (sorted), read as ``kind``; ``name`` is its
    subdirectory in a directory of data sets ('' for a lone data set); image file names are
    relative to ``base``."""

    name: str
    base: Path
    kind: Kind
    files: tuple[Path, ...]
    info: dict


def input_sets(path: Path) -> list[InputSet]:
    """The data sets of an accepted input (``pipetune.data.storage``'s module doc)."""
    if not path.exists():
        raise FileNotFoundError(f"data set {path} does not exist")
    if sources := data_set_dirs(path):
        return [s for p in sources for s in _one_set(p, p.name, read_info(p))]
    return _one_set(path, "", read_info(path))


_KINDS = {"json": Kind.JSONL, "parquet": Kind.PARQUET, "webdataset": Kind.WEBDATASET}
"""The index's reader of each HF ``datasets`` reader's files."""


def _one_set(path: Path, name: str, info: dict) -> list[InputSet]:
    if path.is_dir() and (path / "state.json").is_file():
        state = json.loads((path / "state.json").read_text())
        if state.get("_indices_data_files"):
            raise ValueError(f"{path}: a data set saved with an indices mapping; save it after `flatten_indices()`")
        files = tuple(path / f["filename"] for f in state.get("_data_files", []))
        return [InputSet(name, path, Kind.ARROW, files, info)]
    if path.is_dir() and (path / "dataset_dict.json").is_file():
        split = "train" if (path / "train").is_dir() else json.loads((path / "dataset_dict.json").read_text())["splits"][0]
        return _one_set(path / split, name, info)
    files, reader = data_files(path)
    return [InputSet(name, path if path.is_dir() else path.parent, _KINDS[reader], tuple(files), info)]


def data_root(settings: dict) -> Path:
    """The directory the manifest's paths are relative to (the input, or a lone file's folder)."""
    data = Path(settings["data"])
    return data.parent if data.is_file() or data.suffix in SUFFIXES else data


def part_file(out: Path, number: int) -> Path:
    """Where the build keeps file ``number``'s metadata (``pipetune.data.index.build``)."""
    return out / "parts" / f"{number:08d}.npz"


def file_record(f: Path) -> dict:
    st = f.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def rebuild_command(settings: dict, out: Path) -> str:
    """The command that builds this index again (named by every refusal)."""
    words = ["pipetune", "data", "index", settings["data"], "--out", str(out)]
    if settings.get("tokenizer_path"):
        words += ["--tokenizer", settings["tokenizer_path"]]
    if settings.get("bad_images") != "error":
        words += ["--bad-images", settings["bad_images"]]
    return shlex.join(words)


def read_manifest(index: Path) -> dict:
    f = index / MANIFEST
    if not f.is_file():
        if (index / SETTINGS).is_file():
            settings = json.loads((index / SETTINGS).read_text())
            raise StaleIndex(f"{index}: a partial index (its build was interrupted or is still running); finish it with "
                             f"`{rebuild_command(settings, index)}`")
        raise FileNotFoundError(f"{index}: not a pipetune index (no {MANIFEST})")
    try:
        manifest = json.loads(f.read_text())
    except ValueError as e:
        raise StaleIndex(f"{f}: not valid JSON ({e}); build the index again") from None
    if manifest.get("version") != VERSION:
        raise StaleIndex(f"{index}: an index of format {manifest.get('version')}, this pipetune reads {VERSION}; build it "
                         f"again with `{rebuild_command(manifest['settings'], index)}`")
    return manifest


def check_fresh(manifest: dict, index: Path) -> None:
    """Every indexed file is on disk as it was indexed, and no file was added beside them."""
    again = f"rebuild the index with `{rebuild_command(manifest['settings'], index)}`"
    data, root = Path(manifest["settings"]["data"]), data_root(manifest["settings"])
    for s in manifest["sets"]:
        for rec in s["files"]:
            f = root / rec["path"]
            try:
                now = file_record(f)
            except OSError:
                raise StaleIndex(f"{f}: indexed in {index} but missing now; {again}") from None
            if now != {"size": rec["size"], "mtime_ns": rec["mtime_ns"]}:
                what = "size" if now["size"] != rec["size"] else "modification time"
                raise StaleIndex(f"{f}: its {what} changed since it was indexed in {index}; {again}")
    if all(s["kind"] == Kind.GENERATED.value for s in manifest["sets"]):
        return
    try:
        sets = input_sets(data)
    except (OSError, ValueError) as e:
        raise StaleIndex(f"{data}: {e}; {again}") from None
    indexed = {str(root / r["path"]) for s in manifest["sets"] for r in s["files"]}
    extra = sorted(str(f) for s in sets for f in s.files if str(f) not in indexed)
    if extra:
        raise StaleIndex(f"{extra[0]}: added after {index} was built ({len(extra)} new files); {again}")


def write_json(path: Path, obj: dict) -> None:
    """Atomically (a reader sees the old file or the new one)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)
