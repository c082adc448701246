"""Document-masked attention behind TorchTitan's inner-attention interface, trainable on CPU.

TorchTitan's language-model backends are ``flex`` (no CPU backward), ``flex_flash`` and ``varlen``
(no CPU kernel), so a TorchTitan model cannot train on CPU. ``DocumentAttention`` takes the same
``VarlenMetadata`` as ``varlen`` (its config subclasses ``VarlenAttention.Config``, so
``Decoder.get_attention_masks``, Muse Glimmer's per-layer window set-up and the trainer's mask
building all treat it as varlen) and is pipetune's ``PackedAttention`` with varlen's sliding
windows: on a GPU TorchTitan's own ``VarlenAttention`` (native windows), on CPU SDPA once per
document, with a banded mask for a document longer than its layer's window.

``VisionMaskAttention`` is the vision encoder's counterpart: TorchTitan's ViT blocks use
FlexAttention with compiled BlockMasks (the mask compilation fails on CPU, and there is no CPU
backward); it takes the dense boolean masks that ``vision.DenseMaskVisionEncoder`` builds.
Dense masks cost ``N * P**2`` booleans per layer kind: meant for CPU and small images.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import VarlenAttention, VarlenMetadata
from torchtitan.protocols.module import Module

from torchtitan_patches.models.packed_attention import PackedAttention


class DocumentAttention(PackedAttention):
    """``(B, L, N, H)`` q/k/v -> ``(B, L, N, H)``, attention within documents only (see ``PackedAttention``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        backend: str = "auto"
        """``auto`` (TorchTitan's varlen on an Ampere+ GPU in bf16/fp16 or under autocast, else
        per-document SDPA), ``flash`` (always varlen) or ``sdpa``: see ``PackedAttention``."""

    def __init__(self, config: Config):
        self._setup(config.window_size, config.backend)

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, **kwargs):
        if not isinstance(attention_masks, VarlenMetadata):  # PackedAttention's dense path is the ViT's
            raise TypeError(f"DocumentAttention needs VarlenMetadata (document boundaries), got {type(attention_masks).__name__}")
        return super().forward(q_BLNH, k_BLNH, v_BLNH, attention_masks=attention_masks, **kwargs)


class VisionMaskAttention(Module):
    """``(N, P, H, Dh)`` q/k/v with an ``(N, P, P)`` boolean mask -> ``(N, P, H, Dh)``.

    A query with no key to attend to (a padding patch) outputs 0, as FlexAttention does.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config):
        super().__init__()

    def forward(self, q, k, v, *, attention_masks, scale=None, enable_gqa=False, **kwargs):
        if not (isinstance(attention_masks, torch.Tensor) and attention_masks.dtype == torch.bool):
            raise TypeError(
                f"VisionMaskAttention needs a dense boolean mask (from DenseMaskVisionEncoder), got {type(attention_masks).__name__}; "
                "build the model with torchtitan_patches.models.model_spec.with_document_attention"
            )
        mask = attention_masks[:, None]
        has_key = mask.any(dim=-1, keepdim=True)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask | ~has_key, scale=scale, enable_gqa=enable_gqa
        )
        return (out * has_key).transpose(1, 2)
