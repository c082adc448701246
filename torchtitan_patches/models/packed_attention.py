"""Attention over packed documents behind TorchTitan's inner-attention interface.

Backends: ``flash`` = TorchTitan's ``VarlenAttention`` (torch's ``varlen_attn``, the FlashAttention
kernel of torch's CUDA build: CUDA only, no CPU kernel); ``sdpa`` = PyTorch SDPA once per
document, which is exact document masking with a backward on CPU (dense block-diagonal masks cost
~3x more on CPU and FlexAttention has no CPU backward; see ``shared/notes``). ``VarlenAttention``
casts q/k/v to bf16, so ``flash`` is taken only where attention is meant to run in reduced
precision: q in bf16/fp16 (fp16 is then computed in bf16) or under autocast. ``auto`` takes it on
an Ampere or newer GPU then, else SDPA (fp32 jobs keep fp32 attention); ``flash`` refuses fp32
outside autocast.

``VarlenAttention.__init__`` is not run: it activates FA3 (Hopper) or FA4 (Blackwell) for the
whole process, which imports the separately built ``flash_attn_interface`` and fails without it.
torch's bundled kernel runs instead, or whichever one the job activated itself
(``torch.nn.attention.activate_flash_attention_impl``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import VarlenAttention, VarlenMetadata
from torchtitan.protocols.module import Module


BACKENDS = ("auto", "flash", "sdpa")


def flash_attn_available(device: torch.device) -> bool:
    """Whether torch's FlashAttention varlen kernel runs on ``device`` (CUDA, Ampere or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def _window(window_size: tuple[int, int]) -> tuple[bool, int | None]:
    """(causal, keys per query or None) from varlen's ``(left, right)`` window."""
    left, right = window_size
    if right == 0 and left >= -1:
        return True, None if left == -1 else left + 1
    if (left, right) == (-1, -1):
        return False, None
    raise ValueError(
        f"packed attention supports causal windows (left, 0) with left >= -1 and full attention (-1, -1); got window_size={window_size}"
    )


class PackedAttention(VarlenAttention):
    """``(B, L, N, H)`` q/k/v -> ``(B, L, N, H)``, attention within the documents of ``VarlenMetadata``.

    Rows of a batch are laid end to end (offsets count across rows, as TorchTitan's
    ``create_varlen_metadata_for_document`` builds them). Without metadata every row is one
    sequence (the ViT's images). Subclassing ``VarlenAttention`` also makes TorchTitan refuse
    context parallelism for it, as it does for varlen.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        causal: bool = True
        backend: str = "auto"

    def __init__(self, config: Config):
        self._setup((-1, 0) if config.causal else (-1, -1), config.backend)

    def _setup(self, window_size: tuple[int, int], backend: str) -> None:
        Module.__init__(self)  # not VarlenAttention.__init__: see the module docstring
        if backend not in BACKENDS:
            raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.causal, self.window = _window(window_size)
        self.window_size = window_size
        self.backend = backend

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, out_transform=None, **kwargs):
        # argument names are varlen's: TorchTitan's sharding configs address inputs by name
        q, k, v = q_BLNH, k_BLNH, v_BLNH
        if attention_masks is None:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=self.causal, scale=scale, enable_gqa=enable_gqa
            )
            return out.transpose(1, 2)
        if not isinstance(attention_masks, VarlenMetadata):
            raise TypeError(f"packed attention needs VarlenMetadata (document boundaries), got {type(attention_masks).__name__}")
        varlen = self.backend == "flash" or (self.backend == "auto" and flash_attn_available(q.device))
        if varlen and q.dtype not in (torch.bfloat16, torch.float16) and not torch.is_autocast_enabled(q.device.type):
            if self.backend == "flash":
                raise ValueError(f"flash attention computes in bf16: give fp16 or bf16 inputs or run under autocast, got {q.dtype}; or use the sdpa backend")
            varlen = False
        B, L = q.shape[:2]
        bounds = attention_masks.cu_seq_q_host  # the varlen kernel never needs the host copy: no device sync
        if bounds is None and not varlen:
            bounds = tuple(attention_masks.cu_seq_q.tolist())
        if bounds is not None and (bounds[0] != 0 or bounds[-1] != B * L):
            raise ValueError(f"document boundaries {bounds[0]}..{bounds[-1]} do not cover the {B} x {L} tokens of the batch")
        if varlen:
            return super().forward(q, k, v, attention_masks=attention_masks, scale=scale, enable_gqa=enable_gqa, out_transform=out_transform)
        if out_transform is not None:
            raise NotImplementedError("the per-document SDPA backend does not return the log-sum-exp that out_transform needs")
        out = self._per_document(*(t.reshape(1, B * L, *t.shape[2:]) for t in (q, k, v)), bounds, scale, enable_gqa)
        return out.reshape(B, L, *out.shape[2:])

    def _per_document(self, q, k, v, bounds, scale, enable_gqa):
        """SDPA per document; a windowed document longer than its window gets a causal band mask."""
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            mask, causal = None, self.causal
            if self.window is not None and b - a > self.window:
                i = torch.arange(b - a, device=q.device)
                back = i[:, None] - i[None, :]
                mask, causal = (back >= 0) & (back < self.window), False
            outs.append(
                F.scaled_dot_product_attention(
                    qt[:, :, a:b], kt[:, :, a:b], vt[:, :, a:b], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=enable_gqa
                )
            )
        return torch.cat(outs, dim=2).transpose(1, 2)


def varlen_metadata(cu_seqlens: torch.Tensor, device: torch.device | str | None = None) -> VarlenMetadata:
    """TorchTitan's document metadata from cumulative lengths. Give ``cu_seqlens`` on the host
    (as the loader builds it) and the compute ``device``: the host copy (for the SDPA loop and
    ``max_seqlen``) then costs no device synchronisation."""
    host = tuple(int(x) for x in cu_seqlens.tolist())
    longest = max(b - a for a, b in zip(host[:-1], host[1:]))
    cu = cu_seqlens.to(device=device if device is not None else cu_seqlens.device, dtype=torch.int32, non_blocking=True)
    return VarlenMetadata(cu_seq_q=cu, cu_seq_k=cu, max_q=longest, max_k=longest, cu_seq_q_host=host)
