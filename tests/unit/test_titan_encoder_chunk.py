"""Muse Glimmer's vision encoder as pipetune runs it (``TitanEncoderChunk``: flat patch rows, one
batched call per grid, geometry built per grid) against the encoder's own ``forward`` (images
padded to the largest, as TorchTitan's collator hands them), on images of several grids."""

import numpy as np
import torch
import torch.nn.functional as F

from torchtitan_patches.data.micro_batch import patchify
from torchtitan_patches.models.muse_glimmer.spec import muse_glimmer_spec
from torchtitan_patches.models.muse_glimmer.stages import TitanEncoderChunk

GRIDS = ((4, 4), (4, 4), (2, 6), (6, 2), (2, 2), (4, 4))  # patches per side; a grid repeats after others


def test_chunks_on_images_of_several_grids_equal_the_encoders_own_forward():
    with torch.device("meta"):
        vit = muse_glimmer_spec("debugmodel_mm").model.vision_encoder.build()
    vit.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        vit.init_states(buffer_device=torch.device("cpu"))
    p, temporal, n = vit.patch_size, vit.patch_temporal, len(vit.layers)
    rng = np.random.default_rng(0)
    rows = [torch.from_numpy(patchify(rng.standard_normal((3, h * p, w * p), dtype=np.float32), p, temporal)) for h, w in GRIDS]
    longest = max(len(r) for r in rows)
    theirs = vit(torch.stack([F.pad(r, (0, 0, 0, longest - len(r))) for r in rows]), grid_thw=torch.tensor([[1, h, w] for h, w in GRIDS]))
    whole = TitanEncoderChunk(vit, (0, n), num_layers=n, image_grid=4)
    cut = [TitanEncoderChunk(vit, r, num_layers=n, image_grid=4) for r in ((0, 1), (1, n))]  # DIP's chunks, in turn
    with torch.no_grad():
        ours = whole(torch.cat(rows), GRIDS)
        chained = cut[1](cut[0](torch.cat(rows), GRIDS), GRIDS)
    assert ours.shape == theirs.shape == (sum(h * w for h, w in GRIDS) // 4, vit.output_dim)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(chained, ours, rtol=0, atol=0)
