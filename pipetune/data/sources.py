"""Synthetic stand-ins for the three source corpora of PipeTune Table 1, and for two image-heavy
tails the planners are also measured on (issue #62): interleaved web documents with a long tail of
images per document, and video clips of tens of frames with short text.

Text lengths are log-normal with the median and mean of Table 1 (mu = ln median,
sigma^2 = 2 ln(mean / median)), rounded and clipped to [1, max]. MMC4 image counts are a rounded
log-normal clipped to [1, 15], with (mu, sigma) = (1.21, 0.64) fitted numerically to median 3 and
mean 4.08. Web-document image counts are a rounded log-normal clipped to [1, 64] with (0.81, 0.87)
(median 2, mean 3.3, p99 17); video frame counts one clipped to [1, 64] with (3.54, 0.30) (mean 36,
median 34; 64 frames for about one clip in 70). Only metadata is generated; token ids and pixels are derived later from the sample id.

| source | images / sample (mean, median, max) | text tokens (mean, median, max) |
|--------|-------------------------------------|---------------------------------|
| coyo   | 1, 1, 1                             | 17.24, 13, 1,523                |
| mmc4   | 4.08, 3, 15                         | 408.94, 362, 16,470             |
| flan   | none                                | 154.68, 52, 222,109             |
| webdoc | 3.3, 2, 64 (p99 17)                 | 810, 520, 32,768 (p99 ~4.7k)     |
| video  | 36, 34, 64 (frames, before the text) | 60, 40, 1,024                   |
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class SourceSpec:
    """Length statistics of one corpus (the Table 1 targets) and where its images sit in the text."""

    name: str
    text_mean: float
    text_median: float
    text_max: int
    images_fixed: int | None = None
    images_lognormal: tuple[float, float] | None = None
    images_max: int = 0
    images_interleaved: bool = False

    @property
    def text_lognormal(self) -> tuple[float, float]:
        return float(np.log(self.text_median)), float(np.sqrt(2.0 * np.log(self.text_mean / self.text_median)))


SOURCES: dict[str, SourceSpec] = {
    "coyo": SourceSpec(name="coyo", text_mean=17.24, text_median=13, text_max=1523, images_fixed=1, images_max=1),
    "mmc4": SourceSpec(
        name="mmc4",
        text_mean=408.94,
        text_median=362,
        text_max=16470,
        images_lognormal=(1.21, 0.64),
        images_max=15,
        images_interleaved=True,
    ),
    "flan": SourceSpec(name="flan", text_mean=154.68, text_median=52, text_max=222109, images_fixed=0),
    "webdoc": SourceSpec(name="webdoc", text_mean=810, text_median=520, text_max=32768, images_lognormal=(0.81, 0.87), images_max=64,
                         images_interleaved=True),
    "video": SourceSpec(name="video", text_mean=60, text_median=40, text_max=1024, images_lognormal=(3.54, 0.30), images_max=64),
}


def generate_source(spec: SourceSpec, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draw ``n`` samples: (text_tokens, num_images, flat ascending image offsets per sample).

    Image-text pairs put their image before the caption (offset 0); interleaved documents place
    each image at a uniformly random text position.
    """
    mu, sigma = spec.text_lognormal
    text = np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, spec.text_max).astype(np.int64)
    if spec.images_lognormal is not None:
        imu, isig = spec.images_lognormal
        images = np.clip(np.rint(rng.lognormal(imu, isig, n)), 1, spec.images_max).astype(np.int64)
    else:
        images = np.full(n, spec.images_fixed or 0, dtype=np.int64)
    owner = np.repeat(np.arange(n), images)
    if spec.images_interleaved:
        offsets = np.floor(rng.random(len(owner)) * (text[owner] + 1)).astype(np.int64)
        offsets = offsets[np.lexsort((offsets, owner))]
    else:
        offsets = np.zeros(len(owner), dtype=np.int64)
    return text, images, offsets
