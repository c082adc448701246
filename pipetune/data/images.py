"""Images at their own resolution: pixel size -> patch grid -> image tokens.

An image is resized before the encoder sees it, keeping its aspect ratio, so that its pixel count
lies in ``[min_pixels, max_pixels]`` and both sides are multiples of ``patch_size * merge``: the
rule of TorchTitan's ``resize_to_pixel_budget`` (Qwen-VL's ``smart_resize``), computed here for
all images at once. TorchTitan's function cannot be imported on machines where torchvision does
not load beside the CPU torch build (its module imports torchvision), so this is a vectorised
copy; ``tests/unit/test_images.py`` checks it against TorchTitan's own source.

The grid is ``(H / patch, W / patch)`` patches; the encoder's pixel shuffle merges ``merge x
merge`` patches into one token, so an image costs ``H W / (patch * merge)^2`` tokens in the
sequence. Images whose size is unknown (generated data: pixels are synthesized) take the model's
standard image (``EncoderConfig.image_size`` square). ``keep_aspect=False`` resizes every image to
that square instead (the separated layout, whose encoder messages have one shape, needs it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetune.config.model import EncoderConfig, ModelConfig

MAX_ASPECT = 200
"""Images more elongated than this are refused (TorchTitan's limit)."""


def elongated(sizes: np.ndarray) -> np.ndarray:
    """Which of ``(n, 2)`` positive pixel sizes are more elongated than ``MAX_ASPECT``:1."""
    sizes = np.asarray(sizes, dtype=np.float64).reshape(-1, 2)
    return sizes.max(axis=1) > MAX_ASPECT * sizes.min(axis=1)


@dataclass(frozen=True, kw_only=True)
class ImageSizing:
    """How images of given pixel sizes become patch grids for one encoder."""

    patch_size: int
    merge: int
    standard_grid: int
    min_pixels: int
    max_pixels: int
    keep_aspect: bool = True

    def __post_init__(self) -> None:
        factor = self.patch_size * self.merge
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"image pixel budget [{self.min_pixels}, {self.max_pixels}] is empty; need 0 < min_pixels <= max_pixels")
        if self.max_pixels < factor * factor:
            raise ValueError(f"max_pixels={self.max_pixels} is below one merged patch ({factor} x {factor} = {factor * factor} "
                             "pixels); raise max_pixels")

    @classmethod
    def of(cls, encoder: EncoderConfig, *, min_pixels: int | None = None, max_pixels: int | None = None,
           keep_aspect: bool = True) -> "ImageSizing":
        """The encoder's sizing; the budget defaults to [one merged patch, the standard image]."""
        factor = encoder.patch_size * encoder.merge
        return cls(patch_size=encoder.patch_size, merge=encoder.merge, standard_grid=encoder.image_size // encoder.patch_size,
                   min_pixels=min_pixels or factor * factor, max_pixels=max_pixels or encoder.image_size**2,
                   keep_aspect=keep_aspect)

    @classmethod
    def for_model(cls, model: ModelConfig) -> "ImageSizing | None":
        """Default sizing of ``model``'s encoder (None for a text-only model)."""
        return cls.of(model.encoder) if model.encoder is not None else None

    @property
    def standard_tokens(self) -> int:
        """Tokens of the model's standard image: the unit the latency table's encoder curve counts."""
        return (self.standard_grid // self.merge) ** 2

    def grids(self, sizes: np.ndarray) -> np.ndarray:
        """``(n, 2)`` pixel sizes ``(height, width)`` (0: unknown) -> ``(n, 2)`` patch grids."""
        sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
        out = np.full(sizes.shape, self.standard_grid, np.int64)
        known = (sizes > 0).all(axis=1)
        if self.keep_aspect and known.any():
            out[known] = self._budget(sizes[known].astype(np.float64)) // self.patch_size
        return out

    def tokens(self, sizes: np.ndarray) -> np.ndarray:
        """Image tokens in the sequence for each of ``(n, 2)`` pixel sizes."""
        g = self.grids(sizes)
        return g[:, 0] * g[:, 1] // self.merge**2

    def _budget(self, hw: np.ndarray) -> np.ndarray:
        """Resized pixel sizes (TorchTitan's ``resize_to_pixel_budget``, element-wise)."""
        factor = self.patch_size * self.merge
        h, w = hw[:, 0].copy(), hw[:, 1].copy()
        small = (h < factor) | (w < factor)
        scale = np.maximum(factor / w, factor / h)
        h[small] = np.trunc(h[small] * scale[small])
        w[small] = np.trunc(w[small] * scale[small])
        if elongated(np.stack([h, w], axis=1)).any():
            k = int(np.argmax(elongated(np.stack([h, w], axis=1))))
            raise ValueError(f"an image of {int(hw[k, 1])} x {int(hw[k, 0])} pixels is more elongated than {MAX_ASPECT}:1")
        hb = np.maximum(np.round(h / factor) * factor, factor)
        wb = np.maximum(np.round(w / factor) * factor, factor)
        over = hb * wb > self.max_pixels
        under = ~over & (hb * wb < self.min_pixels)
        beta = np.sqrt(h * w / self.max_pixels)
        hb[over] = np.maximum(np.floor(h[over] / beta[over] / factor) * factor, factor)
        wb[over] = np.maximum(np.floor(w[over] / beta[over] / factor) * factor, factor)
        beta = np.sqrt(self.min_pixels / (h * w))
        hb[under] = np.ceil(h[under] * beta[under] / factor) * factor
        wb[under] = np.ceil(w[under] * beta[under] / factor) * factor
        return np.stack([hb, wb], axis=1).astype(np.int64)
