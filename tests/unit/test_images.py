"""Image sizing (pixel size -> patch grid -> tokens) against TorchTitan's own resize rule."""

import ast
import math
from pathlib import Path

import numpy as np
import pytest
import torchtitan

from pipetune.config import load_model_config
from pipetune.data.images import ImageSizing, elongated


def _torchtitan_resize():
    """TorchTitan's ``resize_to_pixel_budget``, compiled from its installed source alone (its
    module imports torchvision, which does not load beside this CPU torch build)."""
    src = (Path(torchtitan.__file__).parent / "hf_datasets" / "multimodal" / "utils" / "image.py").read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "resize_to_pixel_budget")
    namespace = {"math": math}
    exec(compile(ast.Module([fn], type_ignores=[]), "image.py", "exec"), namespace)
    return namespace["resize_to_pixel_budget"]


@pytest.mark.parametrize("patch,merge,lo,hi", [(14, 2, 784, 3136), (16, 2, 65536, 16777216), (14, 1, 196, 336 * 336)])
def test_grids_follow_torchtitans_pixel_budget(patch, merge, lo, hi):
    resize = _torchtitan_resize()
    rng = np.random.default_rng(0)
    sizes = np.concatenate([rng.integers(1, 5000, (3000, 2)), [[1, 1], [28, 28], [56, 56], [40, 400], [6000, 8000], [13, 2000]]])
    sizes = sizes[~elongated(sizes)]
    sizing = ImageSizing(patch_size=patch, merge=merge, standard_grid=4, min_pixels=lo, max_pixels=hi)
    grids = sizing.grids(sizes)
    want = np.array([resize(int(h), int(w), patch_size=patch, merge_size=merge, min_pixels=lo, max_pixels=hi)[:2] for h, w in sizes])
    assert np.array_equal(grids * patch, want)
    assert (grids % merge == 0).all() and np.array_equal(sizing.tokens(sizes), grids[:, 0] * grids[:, 1] // merge**2)


def test_unknown_sizes_and_square_resizing_take_the_standard_image():
    enc = load_model_config("tiny").encoder  # 32 x 32 pixels of 8 x 8 patches
    sizing = ImageSizing.of(enc)
    assert (sizing.min_pixels, sizing.max_pixels, sizing.standard_tokens) == (64, 1024, 16)
    sizes = np.array([[0, 0], [300, 500], [20, 900]])
    # aspect kept within 1024 pixels; a strip's short side stays one patch, so it may pass the budget (TorchTitan's rule)
    assert sizing.grids(sizes).tolist() == [[4, 4], [3, 5], [1, 26]]
    square = ImageSizing.of(enc, keep_aspect=False)
    assert square.grids(sizes).tolist() == [[4, 4]] * 3


def test_an_empty_budget_is_refused():
    with pytest.raises(ValueError, match="pixel budget .* is empty"):
        ImageSizing(patch_size=14, merge=2, standard_grid=4, min_pixels=5000, max_pixels=3136)
    with pytest.raises(ValueError, match="below one merged patch"):
        ImageSizing(patch_size=14, merge=2, standard_grid=4, min_pixels=10, max_pixels=700)
