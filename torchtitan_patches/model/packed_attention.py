"""Attention over packed documents behind TorchTitan's inner-attention interface.

Backends: ``flash`` = flash-attn's varlen kernel (CUDA, ``pip install .[cuda]``); ``sdpa`` =
PyTorch SDPA once per document, which is exact document masking with a backward on CPU (dense
block-diagonal masks cost ~3x more on CPU and FlexAttention has no CPU backward; see
``shared/notes``). ``auto`` takes flash when it can: on CUDA with flash-attn installed and q/k/v in
fp16 or bf16 (the only dtypes flash-attn accepts); fp32 falls back to SDPA, ``flash`` refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import VarlenMetadata
from torchtitan.protocols.module import Module


def flash_attn_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


class PackedAttention(Module):
    """``(B, L, N, H)`` q/k/v -> ``(B, L, N, H)``; documents given by ``VarlenMetadata`` (B = 1).

    Without metadata every batch row is one sequence (the ViT's images).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        causal: bool = True
        backend: str = "auto"

    def __init__(self, config: Config):
        super().__init__()
        if config.backend not in ("auto", "flash", "sdpa"):
            raise ValueError(f"attention backend must be auto, flash or sdpa, got {config.backend!r}")
        self.causal = config.causal
        self.backend = config.backend

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        if attention_masks is None:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=self.causal, scale=scale, enable_gqa=enable_gqa
            )
            return out.transpose(1, 2)
        if not isinstance(attention_masks, VarlenMetadata):
            raise TypeError(f"PackedAttention needs VarlenMetadata, got {type(attention_masks).__name__}")
        if q.shape[0] != 1:
            raise ValueError(f"packed attention expects batch size 1 (one packed sequence), got {q.shape[0]}")
        half = q.dtype in (torch.float16, torch.bfloat16)
        if self.backend == "flash" and not half:
            raise ValueError(f"flash attention needs fp16 or bf16 inputs, got {q.dtype}: train with a bf16 compute dtype or the sdpa backend")
        use_flash = self.backend == "flash" or (self.backend == "auto" and half and flash_attn_available(q.device))
        if use_flash:
            return self._flash(q, k, v, attention_masks, scale)
        bounds = attention_masks.cu_seq_q_host or tuple(attention_masks.cu_seq_q.tolist())
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        outs = [
            F.scaled_dot_product_attention(
                qt[:, :, a:b], kt[:, :, a:b], vt[:, :, a:b], is_causal=self.causal, scale=scale, enable_gqa=enable_gqa
            )
            for a, b in zip(bounds[:-1], bounds[1:])
        ]
        return torch.cat(outs, dim=2).transpose(1, 2)

    def _flash(self, q, k, v, meta: VarlenMetadata, scale):
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(
            q[0], k[0], v[0], meta.cu_seq_q, meta.cu_seq_k, meta.max_q, meta.max_k, softmax_scale=scale, causal=self.causal
        )
        return out.unsqueeze(0)


def varlen_metadata(cu_seqlens: torch.Tensor, device: torch.device | str | None = None) -> VarlenMetadata:
    """TorchTitan's document metadata from cumulative lengths. Give ``cu_seqlens`` on the host
    (as the loader builds it) and the compute ``device``: the host copy (for the SDPA loop and
    ``max_seqlen``) then costs no device synchronisation."""
    host = tuple(int(x) for x in cu_seqlens.tolist())
    longest = max(b - a for a, b in zip(host[:-1], host[1:]))
    cu = cu_seqlens.to(device=device if device is not None else cu_seqlens.device, dtype=torch.int32, non_blocking=True)
    return VarlenMetadata(cu_seq_q=cu, cu_seq_k=cu, max_q=longest, max_k=longest, cu_seq_q_host=host)
