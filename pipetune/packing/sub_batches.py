"""Micro-batches' images -> the encoder's units, image sub-microbatches (DIP Sec. 4).

Sub-microbatch ``k`` holds images ``first[k] .. first[k] + images[k] - 1`` of micro-batch
``parent[k]`` (in the micro-batch's image order); sub-microbatches are numbered micro-batch by
micro-batch, so each belongs to exactly one micro-batch.

* co-located layout (``size == 0``): one sub-microbatch per micro-batch, all its images (possibly
  none), run at that size; images at their own resolution are charged in standard images
  (``units``: image tokens over the standard image's);
* separated layout (``size = B``): each micro-batch's ``N`` images split into ``ceil(N / B)``
  sub-microbatches of ``B`` images, the last one holding the rest; the runtime pads it to ``B``
  images so the encoder always runs one shape, so the cost model charges ``B`` for each
  (``charged``). A micro-batch without images has no sub-microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SubBatches:
    parent: np.ndarray
    first: np.ndarray
    images: np.ndarray
    size: int = 0
    units: np.ndarray | None = None

    @classmethod
    def one_per_micro_batch(cls, images_per_mb: np.ndarray, units: np.ndarray | None = None) -> "SubBatches":
        images = np.asarray(images_per_mb, np.int64)
        return cls(np.arange(len(images)), np.zeros(len(images), np.int64), images, 0, units)

    @classmethod
    def split(cls, images_per_mb: np.ndarray, size: int) -> "SubBatches":
        if size < 1:
            raise ValueError(f"an image sub-microbatch needs at least one image, got size {size}")
        images = np.asarray(images_per_mb, np.int64)
        counts = -(-images // size)
        parent = np.repeat(np.arange(len(images)), counts)
        k = np.arange(len(parent)) - np.repeat(np.cumsum(counts) - counts, counts)
        first = k * size
        return cls(parent, first, np.minimum(size, images[parent] - first), size)

    @property
    def count(self) -> int:
        return len(self.parent)

    @property
    def charged(self) -> np.ndarray:
        """Standard images the encoder runs per sub-microbatch (padded to ``size`` when fixed)."""
        if self.size:
            return np.full(self.count, self.size, np.int64)
        return self.images if self.units is None else self.units

    def as_tuples(self) -> tuple[tuple[int, int, int], ...]:
        """``(micro-batch, first image, images)`` per sub-microbatch, as ``IterationPlan.image_ranges`` lists them."""
        return tuple((int(j), int(f), int(n)) for j, f, n in zip(self.parent, self.first, self.images))
