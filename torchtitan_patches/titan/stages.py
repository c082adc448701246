"""TorchTitan model parts as the pipeline stages ``PlanExecutor`` runs.

TorchTitan's pipelining split (``ModelSpec.pipelining_fn``) gives each rank its model parts: the
whole model class with the modules of other stages set to ``None``, so ``forward`` runs only what
the part holds. ``TitanStage`` calls that forward with pipetune's packed micro-batch (tokens or the
received hidden state, per-document positions, varlen document metadata).

Encoder pre-computation (the plan's ``E`` actions) needs the vision encoder apart from stage 0's
forward, which TorchTitan's Muse Glimmer model runs inside ``forward`` (``_get_vision_features``:
encoder, then adapter). ``TitanEncoder`` runs the encoder alone (without gradients when it is
frozen, as PipeTune assumes); stage 0's forward then gets those outputs through an instance-level
``_get_vision_features`` for the duration of the call, which applies the (trained) adapter, as the
model's own method does, so projector gradients are unchanged. Images arrive as pixels ``(N, C, H,
W)`` and are cut into the encoder's patches here: ``patch_temporal`` copies of a still image, each
patch flattened channel-major, patches in raster order (Qwen-VL's layout, which Muse Glimmer's
``conv1`` reads), with ``grid_thw = (1, H / patch, W / patch)``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from torchtitan_patches.data.micro_batch import IMAGE_TOKEN_ID


@dataclass
class EncodedImages:
    """Encoder outputs of one micro-batch's images, and their patch grids."""

    features: torch.Tensor
    grid_thw: torch.Tensor


def patchify(pixels: torch.Tensor, patch_size: int, temporal: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N, C, H, W)`` -> ``(N, P, C * temporal * patch**2)`` patches and ``(N, 3)`` grids."""
    n, c, h, w = pixels.shape
    gh, gw = h // patch_size, w // patch_size
    x = pixels.reshape(n, c, gh, patch_size, gw, patch_size).permute(0, 2, 4, 1, 3, 5)
    x = x[:, :, :, :, None].expand(n, gh, gw, c, temporal, patch_size, patch_size)
    grid = torch.tensor([[1, gh, gw]] * n, dtype=torch.long, device=pixels.device)
    return x.reshape(n, gh * gw, c * temporal * patch_size * patch_size), grid


class TitanEncoder(nn.Module):
    """Stage 0's vision encoder, runnable as the plan's ``E`` action."""

    def __init__(self, part: nn.Module):
        super().__init__()
        self.part = part
        enc = part.vision_encoder
        self.patch_size, self.temporal = enc.patch_size, enc.patch_temporal

    @property
    def trained(self) -> bool:
        return any(p.requires_grad for p in self.part.vision_encoder.parameters())

    def forward(self, pixels: torch.Tensor) -> EncodedImages:
        patches, grid = patchify(pixels, self.patch_size, self.temporal)
        return EncodedImages(self.part.vision_encoder(patches, grid_thw=grid), grid)


class TitanStage(nn.Module):
    """One TorchTitan model part with the executor's stage interface."""

    def __init__(self, part: nn.Module, *, is_first: bool, is_last: bool):
        super().__init__()
        self.part = part
        self.is_first, self.is_last = is_first, is_last

    def forward(self, x, *, positions, masks, image_features: EncodedImages | None = None, image_token_index=None):
        if image_features is None:
            return self.part(x, positions, masks)
        with self._encoded(image_features):
            return self.part(x, positions, masks, pixel_values=image_features.features, grid_thw=image_features.grid_thw,
                             special_tokens={"image_id": IMAGE_TOKEN_ID})

    @contextmanager
    def _encoded(self, images: EncodedImages):
        part = self.part
        part._get_vision_features = lambda pixel_values, grid_thw: part.vision_adapter(images.features).unsqueeze(0)
        try:
            yield
        finally:
            del part._get_vision_features
