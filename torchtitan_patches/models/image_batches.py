"""Images of a packed micro-batch as the models take them: collated as TorchTitan's collator hands
them (``collated_images``), and run one grid at a time (``per_grid``). Shared by the model folders
and the stock loader."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from torchtitan_patches.data.micro_batch import PackedMicroBatch

Grid = tuple[int, int]


def collated_images(mb: PackedMicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``mb``'s images as TorchTitan's collator hands them to the unsplit model's own forward (the
    stock loader's batches, the tests' reference): in sequence order (the model scatters features
    over the image tokens in order), patches zero-padded to the largest image ``(N, P, patch_dim)``,
    and ``grid_thw`` ``(N, 3)`` on the host."""
    sizes = [h * w for h, w in mb.image_grids]
    order = np.argsort([span.start for span in mb.image_spans], kind="stable")
    rows = torch.split(mb.pixel_values, sizes)
    longest = max(sizes)
    patches = torch.stack([F.pad(rows[i], (0, 0, 0, longest - sizes[i])) for i in order])
    return patches, torch.tensor([[1, *mb.image_grids[i]] for i in order], dtype=torch.long)


def per_grid(x: torch.Tensor, grids: tuple[Grid, ...], run) -> torch.Tensor:
    """``run(images, grid)`` on every run of consecutive images of one grid, ``images`` their rows
    of ``x`` as ``(n, h * w, width)``; the runs' flat outputs concatenated in order."""
    out, at, k = [], 0, 0
    while k < len(grids):
        n = next((j for j in range(k, len(grids)) if grids[j] != grids[k]), len(grids)) - k
        (gh, gw), rows = grids[k], n * grids[k][0] * grids[k][1]
        out.append(run(x[at:at + rows].view(n, gh * gw, -1), (gh, gw)))
        at, k = at + rows, k + n
    return out[0] if len(out) == 1 else torch.cat(out)
