"""The index on disk: two ``.npy`` arrays of fixed-size records that open memory-mapped, written
part after part.

``samples.npy``, one 48-byte record per sample: ``id`` (the ``id`` column, else the row number
over the data set), ``loc`` and ``span`` (its location in file number ``file``,
``pipetune.data.index.readers``), ``first_image`` and ``num_images`` (its images' records),
``text_tokens`` (under the index's tokenizer) and ``source`` (a code into the manifest's
``source_names``). ``images.npy``, one 12-byte record per image: its text ``offset`` and pixel
``height`` and ``width`` (0 where pixels are synthesized).

Records, not a file per field: a step reads its batch's samples at random rows, and on a cold
page cache each row of each file it touches is a disk read. A record puts a sample's fields in
one page, so a step reads about a page per sample and one per sample with images, not one per
field (nine files took 3 times the reads).

Writing streams: records are appended as they come and each ``.npy`` header written at the end,
so memory holds one part at a time whatever the corpus size. ``digest`` hashes every metadata
field (what the batch stream and the packing read), so a checkpoint can tell indexes apart.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
from pathlib import Path

import numpy as np

from pipetune.data.index.manifest import MANIFEST, SETTINGS, VERSION, InputSet, StaleIndex, data_root, part_file, write_json

SAMPLE = np.dtype([("id", "<i8"), ("loc", "<i8"), ("span", "<i8"), ("first_image", "<i8"), ("text_tokens", "<i4"),
                   ("num_images", "<i4"), ("file", "<i4"), ("source", "<i2"), ("spare", "<i2")])
IMAGE = np.dtype([("offset", "<i4"), ("height", "<i4"), ("width", "<i4")])
RECORDS = {"samples": SAMPLE, "images": IMAGE}
HASHED = {"samples": ("id", "source", "text_tokens", "num_images"), "images": ("offset", "height", "width")}
_HEADER = 512
SKIPPED = "skipped.jsonl"
_INT32 = 2**31


class RecordWriter:
    """Appends samples to the records in ``out/.records-tmp``; ``close`` moves them into ``out``."""

    def __init__(self, out: Path):
        self.out = out
        self.tmp = out / f".records-tmp-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self._files = {k: (self.tmp / f"{k}.npy").open("wb") for k in RECORDS}
        for fh in self._files.values():
            fh.write(b"\0" * _HEADER)
        self._hash = {(k, f): hashlib.sha256() for k, fields in HASHED.items() for f in fields}
        self.samples = self.images = 0

    def append(self, *, ids, source, text_tokens, num_images, image_offsets, image_sizes, file, loc, span) -> None:
        text_tokens, num_images = np.asarray(text_tokens), np.asarray(num_images, np.int64)
        for name, values in (("text tokens", text_tokens), ("images", num_images), ("image offsets", np.asarray(image_offsets))):
            if len(values) and int(values.max()) >= _INT32:
                raise ValueError(f"a sample of {int(values.max())} {name} is beyond the index's 32-bit field")
        samples = np.zeros(len(text_tokens), SAMPLE)
        samples["first_image"] = self.images + np.cumsum(num_images) - num_images
        for field, values in (("id", ids), ("loc", loc), ("span", span), ("text_tokens", text_tokens), ("num_images", num_images),
                              ("file", file), ("source", source)):
            samples[field] = values
        sizes = np.asarray(image_sizes).reshape(-1, 2)
        images = np.zeros(len(sizes), IMAGE)
        images["offset"], images["height"], images["width"] = image_offsets, sizes[:, 0], sizes[:, 1]
        for name, records in (("samples", samples), ("images", images)):
            self._files[name].write(records.tobytes())
            for field in HASHED[name]:
                self._hash[name, field].update(np.ascontiguousarray(records[field], np.int64).tobytes())
        self.samples += len(samples)
        self.images += len(images)

    def close(self, names: tuple[str, ...]) -> str:
        """Write the headers, move the records into place; returns the digest."""
        for name, fh in self._files.items():
            fh.seek(0)
            fh.write(_npy_header(RECORDS[name], (self.samples if name == "samples" else self.images,)))
            fh.close()
        for name in RECORDS:
            os.replace(self.tmp / f"{name}.npy", self.out / f"{name}.npy")
        shutil.rmtree(self.tmp, ignore_errors=True)
        h = hashlib.sha256("\0".join(names).encode())
        for key in sorted(self._hash):
            h.update(self._hash[key].digest())
        return h.hexdigest()


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """A version 1.0 ``.npy`` header padded to ``_HEADER`` bytes (the space reserved before the data)."""
    text = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}).encode("latin1")
    room = _HEADER - 10
    return b"\x93NUMPY\x01\x00" + room.to_bytes(2, "little") + text.ljust(room - 1) + b"\n"


class MappedRecords:
    """The records memory-mapped for reads at random rows. The kernel reads nothing ahead
    (``MADV_RANDOM``: its default readahead read and mapped megabytes around every row a step
    touched, 786 MB of RSS over 21 steps at 100M samples), and ``gather`` asks for every page a
    batch needs at once (``MADV_WILLNEED``) before reading them, which on this machine's disk took
    a third of the time of faulting them in one by one."""

    def __init__(self, index: Path):
        self.arrays: dict[str, np.ndarray] = {}
        self._maps: dict[str, mmap.mmap | None] = {}
        self._offsets: dict[str, int] = {}
        for name in RECORDS:
            with (index / f"{name}.npy").open("rb") as fh:
                np.lib.format.read_magic(fh)
                (count,), _, dtype = np.lib.format.read_array_header_1_0(fh)
                offset = fh.tell()
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if count else None
            if mm is not None and hasattr(mmap, "MADV_RANDOM"):
                mm.madvise(mmap.MADV_RANDOM)
            self.arrays[name] = np.frombuffer(mm, dtype, count, offset) if mm is not None else np.zeros(0, dtype)
            self._maps[name], self._offsets[name] = mm, offset

    def gather(self, name: str, idx: np.ndarray) -> np.ndarray:
        """``arrays[name][idx]``, its pages requested together first."""
        mm = self._maps[name]
        if mm is not None and len(idx) and hasattr(mmap, "MADV_WILLNEED"):
            first = (self._offsets[name] + idx * self.arrays[name].itemsize) // mmap.PAGESIZE
            last = (self._offsets[name] + (idx + 1) * self.arrays[name].itemsize - 1) // mmap.PAGESIZE
            for page in np.unique(np.concatenate([first, last])).tolist():
                mm.madvise(mmap.MADV_WILLNEED, page * mmap.PAGESIZE, min(mmap.PAGESIZE, len(mm) - page * mmap.PAGESIZE))
        return self.arrays[name][idx]


def assemble(out: Path, sets: list[InputSet], jobs: list, settings: dict, *, progress: bool = True) -> dict:
    """The columns and manifest from every job's part (``pipetune.data.index.build``)."""
    from tqdm import tqdm

    from pipetune.data.formats import RowFormat
    from pipetune.data.metadata import NO_TEXT

    mixed = any(s.name for s in sets)
    data, root = Path(settings["data"]), data_root(settings)
    extras = [json.loads(str(np.load(part_file(out, j.number))["extra"])) for j in jobs]
    set_names: list[list[str]] = [sorted({n for j, e in zip(jobs, extras) if j.set_number == k for n in e["source_names"]})
                                  for k in range(len(sets))]
    names: list[str] = []
    first_code = []
    for s, own in zip(sets, set_names):
        first_code.append(len(names))
        names += [f"{s.name}/{n}" if mixed and len(own) > 1 else s.name if mixed else n for n in own]
    records = []
    for k, s in enumerate(sets):
        ex = [e for j, e in zip(jobs, extras) if j.set_number == k]
        fmt = RowFormat(ex[0]["format"])
        cols = set(jobs[[j.set_number for j in jobs].index(k)].columns)
        records.append({
            "name": s.name, "base": os.path.relpath(s.base, root), "kind": s.kind.value, "format": fmt.value,
            "columns": sorted(cols), "content_seed": int(s.info.get("seed", 0)),
            "has_token_ids": fmt is not RowFormat.PIPETUNE or bool({"input_ids", "text"} & cols),
            "has_image_files": fmt is not RowFormat.PIPETUNE or "images" in cols,
            "raw_text": "input_ids" not in cols and (fmt is not RowFormat.PIPETUNE or "text" in cols),
            "image_markers": max(e["image_markers"] for e in ex), "has_id": ex[0]["has_id"], "files": []})
    if mixed and not all(r["has_token_ids"] for r in records):
        bad = next(s for s, r in zip(sets, records) if not r["has_token_ids"])
        raise ValueError(f"{bad.base}: a directory of data sets needs text or token ids in every data set; this one holds "
                         "lengths only (generated data): index it on its own")
    markers = {r["image_markers"] for r in records}
    if len(markers) > 1:
        raise ValueError(f"{data}: its data sets disagree on vision markers (raw text and pre-tokenized rows); keep one kind")

    writer = RecordWriter(out)
    skipped = []
    row_start = 0
    for job, extra in tqdm(list(zip(jobs, extras)), desc="writing the index", unit=" files", disable=not progress, mininterval=2):
        rec = records[job.set_number]
        with np.load(part_file(out, job.number)) as z:
            part = {k: z[k] for k in z.files if k != "extra"}
        local = np.searchsorted(set_names[job.set_number], np.asarray(extra["source_names"]))
        codes = first_code[job.set_number] + (local[part["source"]] if len(local) else part["source"])
        if mixed:
            ids = writer.samples + np.arange(len(part["ids"]), dtype=np.int64)
        elif rec["has_id"]:
            ids = part["ids"]
        else:
            ids = row_start + part["file_row"]
        writer.append(ids=ids, source=codes, text_tokens=part["text_tokens"], num_images=part["num_images"],
                      image_offsets=part["image_offsets"], image_sizes=part["image_sizes"],
                      file=np.full(len(ids), job.number, np.int32), loc=part["loc"], span=part["span"])
        rel = os.path.relpath(job.file, root)
        rec["files"].append({"path": rel, **extra["file"], "rows": extra["rows"], "samples": len(ids)})
        skipped += [[rel, row, why] for row, why in extra["skipped"]]
        row_start += extra["rows"]
    digest = writer.close(tuple(names))
    if not mixed and records[0]["has_id"]:
        ids = np.load(out / "samples.npy", mmap_mode="r")["id"]
        uniq, counts = np.unique(ids, return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"{data}: sample id {uniq[np.argmax(counts > 1)]} appears more than once; ids must be unique")
    with (out / SKIPPED).open("w") as fh:
        fh.writelines(json.dumps(s) + "\n" for s in skipped)
    ranges = [e["token_range"] for e in extras if e["token_range"][0] is not None]
    manifest = {
        "version": VERSION, "settings": settings, "sets": records, "samples": writer.samples, "images": writer.images,
        "source_names": names, "image_markers": markers.pop(), "digest": digest, "skipped": len(skipped),
        "first_skipped": skipped[0] if skipped else None,
        "bad_image_rows": sum(not why.endswith(NO_TEXT) for _, _, why in skipped),
        "token_range": [min(r[0] for r in ranges), max(r[1] for r in ranges)] if ranges else None,
    }
    if writer.samples == 0:
        raise StaleIndex(f"{data}: no sample is left to index ({len(skipped)} left out; the first: {skipped[0] if skipped else '-'})")
    write_json(out / MANIFEST, manifest)
    return manifest


def write_generated(out: str | Path, tables, *, content_seed: int = 0) -> dict:
    """An index of generated metadata (``SampleTable`` chunks of one set of source names; content
    is synthesized from the ids, as for ``pipetune data make`` data), written without files to
    read: how corpora too large to generate as a data set are made (``benchmarks/corpus_scale.py``)."""
    from pipetune.data.text import BYTE_TOKENIZER

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} is not empty; give a new directory")
    out.mkdir(parents=True, exist_ok=True)
    writer, names = RecordWriter(out), None
    for t in tables:
        if names is not None and t.source_names != names:
            raise ValueError(f"generated chunks disagree on source names: {names} and {t.source_names}")
        names = t.source_names
        n = len(t)
        writer.append(ids=t.ids, source=t.source, text_tokens=t.text_tokens, num_images=t.num_images,
                      image_offsets=t.image_offsets, image_sizes=t.image_sizes, file=np.zeros(n, np.int32),
                      loc=np.zeros(n, np.int64), span=np.zeros(n, np.int64))
    digest = writer.close(names)
    settings = {"data": str(out.resolve()), "tokenizer": BYTE_TOKENIZER.fingerprint, "tokenizer_name": BYTE_TOKENIZER.name,
                "tokenizer_path": None, "bad_images": "error"}
    (out / SKIPPED).write_text("")
    manifest = {
        "version": VERSION, "settings": settings, "samples": writer.samples, "images": writer.images,
        "sets": [{"name": "", "base": ".", "kind": "generated", "format": "pipetune", "columns": ["id", "text_tokens", "num_images"],
                  "content_seed": content_seed, "has_token_ids": False, "has_image_files": False, "raw_text": False,
                  "image_markers": 0, "has_id": True, "files": []}],
        "source_names": list(names), "image_markers": 0, "digest": digest, "skipped": 0, "first_skipped": None, "bad_image_rows": 0,
        "token_range": None,
    }
    write_json(out / SETTINGS, settings)
    write_json(out / MANIFEST, manifest)
    return manifest
