"""Muse Glimmer's vision encoder with dense attention masks, so it runs (and trains) on CPU.

TorchTitan's ``MuseGlimmerVisionEncoder`` builds its per-image masks with a ``torch.compile``d
``create_block_mask``, which fails to compile on CPU (inductor C++ error in torch 2.13), and
FlexAttention has no CPU backward. This subclass overrides only the mask builder: the same two
masks (per-image block-diagonal, and the same-window mask of the sparse layers) as dense
booleans, consumed by ``attention.VisionMaskAttention``. The forward pass is TorchTitan's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.models.muse_glimmer.vision_encoder import MuseGlimmerVisionEncoder


class DenseMaskVisionEncoder(MuseGlimmerVisionEncoder):
    @dataclass(kw_only=True, slots=True)
    class Config(MuseGlimmerVisionEncoder.Config):
        pass

    def _build_padded_masks(self, num_patch, win_id, max_num_patch, device):
        """``(N, P, P)`` masks: query and key are real patches of the image (and share a window)."""
        idx = torch.arange(max_num_patch, device=device)
        valid = idx[None, :] < num_patch.to(device)[:, None]
        full = valid[:, :, None] & valid[:, None, :]
        sparse = full & (win_id[:, :, None] == win_id[:, None, :]) if self.sparse_attention_factor > 1 else None
        return full, sparse
