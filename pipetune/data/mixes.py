"""The data mixtures of PipeTune Sec. 5 (MMC4 : COYO : FLAN), the image-heavy tails (web documents,
video; ``pipetune.data.sources``), and their generator."""

from __future__ import annotations

import numpy as np

from pipetune.data.samples import SampleTable
from pipetune.data.sources import SOURCES, generate_source

SOURCE_NAMES: tuple[str, ...] = ("mmc4", "coyo", "flan")  # the sources of a weights spec ``mmc4:coyo:flan``

MIXES: dict[str, dict[str, float]] = {
    "datamix1": {"mmc4": 5, "coyo": 5, "flan": 90},
    "datamix2": {"mmc4": 30, "coyo": 30, "flan": 40},
    "datamix3": {"mmc4": 45, "coyo": 45, "flan": 10},
    "webdocs": {"webdoc": 100},
    "video": {"video": 100},
}


def parse_mix(spec: str) -> dict[str, float]:
    """A preset name or ``mmc4:coyo:flan`` weights such as ``30:30:40``."""
    if spec.lower() in MIXES:
        return MIXES[spec.lower()]
    parts = spec.split(":")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if len(weights) != 3 or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(f"unknown mix {spec!r}: use one of {sorted(MIXES)} or weights 'mmc4:coyo:flan' like 30:30:40")
    return dict(zip(SOURCE_NAMES, weights))


def make_mix(mix: str | dict[str, float], num_samples: int, seed: int = 0) -> SampleTable:
    """Generate ``num_samples`` sample records of the mix's sources (its keys, in order; a dict's
    keys are names in ``SOURCES``); source counts follow the weights exactly (rounded)."""
    weights = parse_mix(mix) if isinstance(mix, str) else mix
    names = tuple(weights)
    unknown = [n for n in names if n not in SOURCES]
    if unknown or not names:
        raise ValueError(f"unknown source(s) {unknown} in mix {weights}: sources are {sorted(SOURCES)}")
    if num_samples <= 0:
        raise ValueError(f"num_samples must be > 0, got {num_samples}")
    rng = np.random.default_rng(seed)
    w = np.array([weights[s] for s in names], dtype=float)
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"mix weights must be >= 0 with a positive sum, got {weights}")
    counts = np.floor(w / w.sum() * num_samples).astype(np.int64)
    counts[np.argmax(w)] += num_samples - counts.sum()
    labels = rng.permutation(np.repeat(np.arange(len(names)), counts))
    text = np.zeros(num_samples, np.int64)
    images = np.zeros(num_samples, np.int64)
    offsets_by_row: list[np.ndarray] = [np.zeros(0, np.int64)] * num_samples
    for code, name in enumerate(names):
        rows = np.flatnonzero(labels == code)
        t, k, flat = generate_source(SOURCES[name], len(rows), rng)
        text[rows], images[rows] = t, k
        for r, offs in zip(rows, np.split(flat, np.cumsum(k)[:-1]) if len(rows) else []):
            offsets_by_row[r] = offs
    return SampleTable.build(
        ids=np.arange(num_samples),
        source=labels,
        source_names=names,
        text_tokens=text,
        num_images=images,
        image_offsets=offsets_by_row,
    )
