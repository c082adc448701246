"""Image sizing for tests that name only a token count per image."""

import math

from pipetune.data.images import ImageSizing


def square_images(tokens: int) -> ImageSizing:
    """Every image is the standard square of ``tokens`` tokens (one pixel per patch, no merge)."""
    side = math.isqrt(tokens)
    assert side * side == tokens, f"{tokens} tokens is not a square grid"
    return ImageSizing(patch_size=1, merge=1, standard_grid=side, min_pixels=1, max_pixels=tokens)
