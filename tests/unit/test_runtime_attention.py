"""Attention backend choice by dtype: flash-attn never gets fp32; lengths come from the host."""

import pytest
import torch

from torchtitan_patches.model.packed_attention import PackedAttention, varlen_metadata


def test_flash_refuses_fp32_with_a_clear_message():
    attn = PackedAttention.Config(causal=True, backend="flash").build()
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        attn(q, q, q, attention_masks=varlen_metadata(torch.tensor([0, 3, 8], dtype=torch.int32)))


def test_auto_with_bf16_on_cpu_is_per_document_sdpa():
    """``auto`` on CPU runs SDPA per document: documents do not see each other."""
    attn = PackedAttention.Config(causal=True, backend="auto").build()
    q, k, v = (torch.randn(1, 8, 2, 4, dtype=torch.bfloat16) for _ in range(3))
    meta = varlen_metadata(torch.tensor([0, 3, 8], dtype=torch.int32), "cpu")
    assert meta.cu_seq_q_host == (0, 3, 8) and meta.max_q == 5
    out = attn(q, k, v, attention_masks=meta)
    second = attn(q[:, 3:], k[:, 3:], v[:, 3:], attention_masks=varlen_metadata(torch.tensor([0, 5], dtype=torch.int32)))
    torch.testing.assert_close(out[:, 3:], second)
