"""Document-masked attention behind TorchTitan's inner-attention interface, trainable on CPU.

TorchTitan's language-model backends are ``flex`` (no CPU backward), ``flex_flash`` and ``varlen``
(no CPU kernel), so a TorchTitan model cannot train on CPU. ``DocumentAttention`` takes the same
``VarlenMetadata`` as ``varlen`` (its config subclasses ``VarlenAttention.Config``, so
``Decoder.get_attention_masks``, Muse Glimmer's per-layer window set-up and the trainer's mask
building all treat it as varlen) and computes it with pipetune's ``PackedAttention`` (SDPA once
per document; flash-attn's varlen kernel on CUDA). ``PackedAttention`` has no sliding window, so
a windowed layer whose documents are longer than the window runs a banded mask per long document
here instead.

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

from torchtitan_patches.model.packed_attention import PackedAttention


def _window(window_size: tuple[int, int]) -> tuple[bool, int | None]:
    """(causal, keys per query or None) from varlen's ``(left, right)`` window."""
    left, right = window_size
    if right == 0 and (left == -1 or left >= 0):
        return True, None if left == -1 else left + 1
    if (left, right) == (-1, -1):
        return False, None
    raise ValueError(
        f"DocumentAttention supports causal windows (left, 0) with left >= -1 and full attention (-1, -1); "
        f"got window_size={window_size}"
    )


class DocumentAttention(Module):
    """``(B, L, N, H)`` q/k/v -> ``(B, L, N, H)``, attention within documents only.

    Rows of a batch are laid end to end (``VarlenMetadata`` offsets count across rows, as
    ``create_varlen_metadata_for_document`` builds them).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        backend: str = "auto"
        """``PackedAttention``'s backend: ``auto`` (flash-attn on CUDA in fp16/bf16, else SDPA), ``flash`` or ``sdpa``."""

    def __init__(self, config: Config):
        super().__init__()
        self.causal, self.window = _window(config.window_size)
        self.packed = PackedAttention(PackedAttention.Config(causal=self.causal, backend=config.backend))

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None, enable_gqa=False, out_transform=None, **kwargs):
        # argument names are varlen's: TorchTitan's sharding configs address inputs by name
        q, k, v = q_BLNH, k_BLNH, v_BLNH
        if not isinstance(attention_masks, VarlenMetadata):
            raise TypeError(f"DocumentAttention needs VarlenMetadata (document boundaries), got {type(attention_masks).__name__}")
        if out_transform is not None:
            raise NotImplementedError("DocumentAttention does not return the log-sum-exp that out_transform needs")
        B, L = q.shape[:2]
        bounds = attention_masks.cu_seq_q_host or tuple(int(x) for x in attention_masks.cu_seq_q.tolist())
        if bounds[0] != 0 or bounds[-1] != B * L:
            raise ValueError(f"document boundaries {bounds[0]}..{bounds[-1]} do not cover the {B} x {L} tokens of the batch")
        q, k, v = (t.reshape(1, B * L, *t.shape[2:]) for t in (q, k, v))
        longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        if self.window is None or longest <= self.window:
            out = self.packed(q, k, v, attention_masks=attention_masks._replace(cu_seq_q_host=bounds), scale=scale, enable_gqa=enable_gqa)
        else:
            out = self._windowed(q, k, v, bounds, scale, enable_gqa)
        return out.reshape(B, L, *out.shape[2:])

    def _windowed(self, q, k, v, bounds, scale, enable_gqa):
        """Per document: causal SDPA when it fits the window, a causal band mask when it does not."""
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b - a <= self.window:
                mask, causal = None, True
            else:
                i = torch.arange(b - a, device=q.device)
                back = i[:, None] - i[None, :]
                mask, causal = (back >= 0) & (back < self.window), False
            outs.append(
                F.scaled_dot_product_attention(
                    qt[:, :, a:b], kt[:, :, a:b], vt[:, :, a:b], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=enable_gqa
                )
            )
        return torch.cat(outs, dim=2).transpose(1, 2)


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
                "build the model with torchtitan_patches.titan.model_spec.with_document_attention"
            )
        mask = attention_masks[:, None]
        has_key = mask.any(dim=-1, keepdim=True)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask | ~has_key, scale=scale, enable_gqa=enable_gqa
        )
        return (out * has_key).transpose(1, 2)
