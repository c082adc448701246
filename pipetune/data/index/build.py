"""``pipetune data index``: one pass over the user's files in place, spread over processes and machines.

Each input file becomes one part (``parts/NNNNNNNN.npz``: its samples' metadata and locations,
derived exactly as the un-indexed path derives them, ``pipetune.data.metadata.row_metadata``), written
atomically and keyed by the file's size and modification time. A build that stops resumes from
the parts it finished; ``--part I/N`` builds every N-th file, so machines sharing the output
directory split the work. Whoever finds every part present assembles the records
(``pipetune.data.index.disk_format``) and writes ``manifest.json`` last. The same files and settings
give the same bytes, however the work was split or interrupted.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipetune.data.image_files import BadImages
from pipetune.data.index.disk_format import assemble
from pipetune.data.index.manifest import SETTINGS, InputSet, StaleIndex, file_record, input_sets, part_file, rebuild_command, write_json
from pipetune.data.index.readers import chunks, columns_of, same_columns
from pipetune.data.text import BYTE_TOKENIZER, TextTokenizer

@dataclass(frozen=True)
class Job:
    """One file to index."""

    number: int
    set_number: int
    file: Path
    base: Path
    kind: object
    columns: tuple[str, ...]
    first_file: Path


def build_index(data: str | Path, out: str | Path, *, tokenizer: TextTokenizer = BYTE_TOKENIZER,
                tokenizer_path: str | None = None, bad_images: BadImages | str = BadImages.ERROR, workers: int = 1,
                part: tuple[int, int] = (0, 1), progress: bool = True) -> dict | None:
    """Index ``data`` into ``out``; returns the manifest, or None while other parts are missing."""
    data, out = Path(data).resolve(), Path(out)
    bad_images = BadImages(bad_images)
    settings = {"data": str(data), "tokenizer": tokenizer.fingerprint, "tokenizer_name": tokenizer.name,
                "tokenizer_path": str(Path(tokenizer_path).resolve()) if tokenizer_path else None, "bad_images": bad_images.value}
    _claim(out, settings)
    sets = input_sets(data)
    jobs = _jobs(sets)
    mine = [j for j in jobs if j.number % part[1] == part[0] and not _done(out, j)]
    _run(mine, out, tokenizer, bad_images, workers, progress)
    if not all(_done(out, j) for j in jobs):
        missing = sum(not _done(out, j) for j in jobs)
        print(f"part {part[0]}/{part[1]} done; {missing} of {len(jobs)} files still to index by the other parts; the last "
              f"part to finish writes the index (or run `{rebuild_command(settings, out)}` once they have)")
        return None
    return assemble(out, sets, jobs, settings, progress=progress)


def _claim(out: Path, settings: dict) -> None:
    """``out`` holds nothing, or a build of the same settings (which this one resumes)."""
    f = out / SETTINGS
    if f.is_file():
        saved = json.loads(f.read_text())
        diff = [f"{k}: built with {saved.get(k)!r}, now {v!r}" for k, v in settings.items() if k != "tokenizer_name" and saved.get(k) != v]
        if diff:
            raise StaleIndex(f"{out} holds an index of other settings ({'; '.join(diff)}); give a new --out or delete it")
        return
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and holds no index; give a new directory or delete this one first")
    part_file(out, 0).parent.mkdir(parents=True, exist_ok=True)
    write_json(f, settings)


def _jobs(sets: list[InputSet]) -> list[Job]:
    jobs = []
    for k, s in enumerate(sets):
        try:
            columns = tuple(columns_of(s.kind, s.files[0]))
        except ValueError:  # an unreadable first file: its own job names the error
            columns = ()
        jobs += [Job(len(jobs) + i, k, f, s.base, s.kind, columns, s.files[0]) for i, f in enumerate(s.files)]
    return jobs


def _done(out: Path, job: Job) -> bool:
    """The part exists and was made from the file as it is now."""
    f = part_file(out, job.number)
    if not f.is_file():
        return False
    try:
        with np.load(f) as z:
            extra = json.loads(str(z["extra"]))
    except (OSError, ValueError, KeyError):
        return False
    return extra["file"] == file_record(job.file)


def _run(jobs: list[Job], out: Path, tokenizer: TextTokenizer, bad_images: BadImages, workers: int, progress: bool) -> None:
    from tqdm import tqdm

    total = sum(j.file.stat().st_size for j in jobs)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="indexing", disable=not progress or not jobs, mininterval=1)
    count = {"files": 0, "samples": 0}

    def done(n: int, job: Job) -> None:
        count["files"] += 1
        count["samples"] += n
        bar.update(job.file.stat().st_size)
        bar.set_postfix(files=f"{count['files']}/{len(jobs)}", samples=count["samples"], refresh=False)

    try:
        if workers <= 1 or len(jobs) <= 1:
            for job in jobs:
                done(_index_file(job, out, tokenizer, bad_images), job)
            return
        with ProcessPoolExecutor(min(workers, len(jobs))) as pool:
            futures = [(pool.submit(_index_file, job, out, tokenizer, bad_images), job) for job in jobs]
            try:
                for future, job in futures:
                    done(future.result(), job)
            except BaseException:
                pool.shutdown(cancel_futures=True)  # a bad file stops the build now, not after every other file
                raise
    finally:
        bar.close()


def _index_file(job: Job, out: Path, tokenizer: TextTokenizer, bad_images: BadImages) -> int:
    """Index one file into its part; returns its sample count."""
    import datasets
    import pyarrow.compute as pc

    from pipetune.data.formats import RowFormat, raw_images
    from pipetune.data.metadata import row_metadata

    datasets.disable_progress_bars()
    record = file_record(job.file)
    pieces, skipped, rows, token_range = [], [], 0, [None, None]
    fmt = None
    for chunk in chunks(job.kind, job.file):
        if job.columns:
            same_columns(job.file, chunk.table.column_names, job.first_file, job.columns)
        ds = raw_images(datasets.Dataset(chunk.table))
        fmt = RowFormat.of(ds.column_names)
        table, left_out = row_metadata(ds, job.file, job.base, tokenizer, fmt, bad_images, first_row=chunk.first_row)
        keep = np.setdiff1d(np.arange(chunk.table.num_rows), np.asarray([r - chunk.first_row for r, _ in left_out], np.int64))
        if "input_ids" in ds.column_names:
            lo, hi = pc.min_max(pc.list_flatten(chunk.table.column("input_ids"))).values()
            token_range = [v if w is None else (w if v is None else op(v, w)) for v, w, op in
                           zip(token_range, (lo.as_py(), hi.as_py()), (min, max))]
        pieces.append((table, chunk.first_row + keep, chunk.loc[keep], chunk.span[keep]))
        skipped += left_out
        rows = chunk.first_row + chunk.table.num_rows
    tables = [p[0] for p in pieces]
    cat = lambda name: np.concatenate([getattr(t, name) for t in tables])  # noqa: E731
    names = sorted({n for t in tables for n in t.source_names})
    codes = np.concatenate([np.searchsorted(names, np.asarray(t.source_names, dtype=object)[t.source].astype(str)) for t in tables])
    extra = {"file": record, "rows": rows, "source_names": names, "format": fmt.value, "skipped": skipped,
             "image_markers": max(t.image_markers for t in tables), "token_range": token_range,
             "has_id": "id" in job.columns}
    target = part_file(out, job.number)
    tmp = target.with_name(f".{target.stem}.tmp-{os.getpid()}.npz")
    np.savez(tmp, ids=cat("ids"), file_row=np.concatenate([p[1] for p in pieces]), source=codes.astype(np.int16),
             text_tokens=cat("text_tokens"), num_images=cat("num_images"), image_offsets=cat("image_offsets"),
             image_sizes=np.concatenate([t.image_sizes for t in tables]).reshape(-1, 2), loc=np.concatenate([p[2] for p in pieces]),
             span=np.concatenate([p[3] for p in pieces]), extra=np.array(json.dumps(extra)))
    os.replace(tmp, target)
    return sum(len(t) for t in tables)
