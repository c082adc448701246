"""Packed attention's backends.

* backend choice by dtype: the varlen kernel (which computes in bf16) never gets fp32 outside
  autocast; lengths come from the host;
* the GPU path is TorchTitan's ``VarlenAttention`` fed with pipetune's metadata. torch's varlen
  kernel has no CPU kernel, so on CPU it is replaced by an exact reference of varlen semantics
  that reads only the arguments it is given (offsets, max length, window, scale, GQA): the path
  must then equal the per-document SDPA path in output and gradients;
* on a GPU, the real kernel against the SDPA path in bf16.
"""

import random

import pytest
import torch

import torchtitan.models.common.attention as titan_attention
import torchtitan_patches.models.packed_attention as packed_attention
from torchtitan_patches.models.packed_attention import PackedAttention, varlen_metadata
from torchtitan_patches.models.document_attention import DocumentAttention


def test_flash_refuses_fp32_with_a_clear_message():
    attn = PackedAttention.Config(causal=True, backend="flash").build()
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        attn(q, q, q, attention_masks=varlen_metadata(torch.tensor([0, 3, 8], dtype=torch.int32)))


def test_unknown_backend_is_refused_at_construction():
    with pytest.raises(ValueError, match="auto, flash, sdpa"):
        DocumentAttention.Config(backend="varlen").build()


def test_auto_with_bf16_on_cpu_is_per_document_sdpa():
    """``auto`` on CPU runs SDPA per document: documents do not see each other."""
    attn = PackedAttention.Config(causal=True, backend="auto").build()
    q, k, v = (torch.randn(1, 8, 2, 4, dtype=torch.bfloat16) for _ in range(3))
    meta = varlen_metadata(torch.tensor([0, 3, 8], dtype=torch.int32), "cpu")
    assert meta.cu_seq_q_host == (0, 3, 8) and meta.max_q == 5
    out = attn(q, k, v, attention_masks=meta)
    second = attn(q[:, 3:], k[:, 3:], v[:, 3:], attention_masks=varlen_metadata(torch.tensor([0, 5], dtype=torch.int32)))
    torch.testing.assert_close(out[:, 3:], second)


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False, **kwargs):
    """torch's ``varlen_attn`` semantics, exact: in sequence ``s`` query ``i`` sees key ``j`` iff
    ``i - left <= j <= i + right`` (-1: unbounded). Returns fp32 (the kernel returns bf16) so the
    comparison stays exact in the forward."""
    assert query.dtype == torch.bfloat16 and cu_seq_q.dtype == torch.int32 and cu_seq_k is cu_seq_q
    bounds = cu_seq_q.tolist()
    assert bounds[-1] == query.shape[0] and max_q == max_k == max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    reference_varlen_attn.calls += 1
    left, right = window_size
    with torch.autocast("cpu", enabled=False):
        q, k, v = query.float(), key.float(), value.float()
        if enable_gqa:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        assert k.shape[1] == q.shape[1]
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            i = torch.arange(b - a)
            back = i[:, None] - i[None, :]  # query index - key index
            seen = ((back <= left) | (left == -1)) & ((-back <= right) | (right == -1))
            s = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * (scale if scale is not None else q.shape[-1] ** -0.5)
            outs.append(torch.einsum("hqk,khd->qhd", s.masked_fill(~seen, float("-inf")).softmax(-1), v[a:b]))
        return torch.cat(outs)


def random_packing(gen: random.Random, rows: int, row_len: int) -> tuple[int, ...]:
    """Offsets of documents of 1..15 tokens filling ``rows`` rows laid end to end."""
    bounds = [0]
    for r in range(rows):
        end = (r + 1) * row_len
        while bounds[-1] < end:
            bounds.append(min(end, bounds[-1] + gen.randint(1, 15)))
    return tuple(bounds)


def qkv_grads(attn, q, k, v, meta, scale, autocast):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = attn(q, k, v, attention_masks=meta, scale=scale, enable_gqa=k.shape[2] != q.shape[2])
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("window_size", [(-1, 0), (-1, -1), (4, 0), (0, 0)])
def test_varlen_path_equals_per_document_sdpa(monkeypatch, window_size, gqa):
    """TorchTitan's VarlenAttention gets the right offsets, max length, window, scale and GQA.

    fp32 inputs that bf16 represents exactly, under autocast (so ``flash`` accepts them):
    VarlenAttention's bf16 cast is then lossless in the forward, and gradients are bf16-rounded.
    """
    reference_varlen_attn.calls = 0
    monkeypatch.setattr(titan_attention, "varlen_attn", reference_varlen_attn)
    flash, sdpa = (DocumentAttention.Config(window_size=window_size, backend=b).build() for b in ("flash", "sdpa"))
    gen, rows, row_len = random.Random(window_size[0] * 7 + gqa), 2, 24
    for packing in range(3):
        meta = varlen_metadata(torch.tensor(random_packing(gen, rows, row_len), dtype=torch.int32))
        torch.manual_seed(packing)
        q = torch.randn(rows, row_len, 4, 8).bfloat16().float()
        k, v = (torch.randn(rows, row_len, 2 if gqa else 4, 8).bfloat16().float() for _ in range(2))
        scale = 0.3 if packing == 1 else None
        got = qkv_grads(flash, q, k, v, meta, scale, autocast=True)
        expected = qkv_grads(sdpa, q, k, v, meta, scale, autocast=False)
        torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
        for g, e in zip(got[1:], expected[1:]):  # (0, 0): q and k get no gradient, up to rounding
            torch.testing.assert_close(g, e, rtol=1e-2, atol=1e-5 + 1e-2 * e.abs().max().item())
    assert reference_varlen_attn.calls == 3


def test_auto_takes_varlen_only_in_reduced_precision(monkeypatch):
    """``auto`` on a capable GPU: bf16 or autocast go to varlen, plain fp32 stays exact SDPA."""
    reference_varlen_attn.calls = 0
    monkeypatch.setattr(titan_attention, "varlen_attn", reference_varlen_attn)
    monkeypatch.setattr(packed_attention, "flash_attn_available", lambda device: True)
    attn = DocumentAttention.Config(backend="auto").build()
    meta = varlen_metadata(torch.tensor([0, 3, 8], dtype=torch.int32))
    q = torch.randn(1, 8, 2, 8)
    attn(q, q, q, attention_masks=meta)
    assert reference_varlen_attn.calls == 0
    attn(q.bfloat16(), q.bfloat16(), q.bfloat16(), attention_masks=meta)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attn(q, q, q, attention_masks=meta)
    assert reference_varlen_attn.calls == 2


@pytest.mark.skipif(
    not (torch.cuda.is_available() and packed_attention.flash_attn_available(torch.device("cuda"))),
    reason="torch's varlen kernel needs an Ampere or newer GPU",
)
@pytest.mark.parametrize("window_size", [(-1, 0), (31, 0)])
def test_cuda_varlen_kernel_equals_per_document_sdpa(window_size):
    """The real kernel in bf16 (causal and a 32-token window shorter than most documents, GQA)
    against the CPU SDPA path in fp32 on the same values: bf16 tolerance."""
    rows, row_len = 2, 256
    bounds = torch.tensor([0, 100, 101, 256, 300, 512], dtype=torch.int32)
    meta_cpu, meta_gpu = varlen_metadata(bounds), varlen_metadata(bounds, "cuda")
    torch.manual_seed(5)
    q = torch.randn(rows, row_len, 8, 64).bfloat16()
    k, v = (torch.randn(rows, row_len, 2, 64).bfloat16() for _ in range(2))
    flash = DocumentAttention.Config(window_size=window_size, backend="flash").build()
    sdpa = DocumentAttention.Config(window_size=window_size, backend="sdpa").build()

    def run(attn, meta, device, dtype):
        x = [t.to(device, dtype, copy=True).requires_grad_() for t in (q, k, v)]
        out = attn(*x, attention_masks=meta, enable_gqa=True)
        (out.float() * torch.linspace(-1, 1, out.numel(), device=device).view_as(out)).sum().backward()
        return [t.detach().float().cpu() for t in (out, *(y.grad for y in x))]

    got = run(flash, meta_gpu, "cuda", torch.bfloat16)
    expected = run(sdpa, meta_cpu, "cpu", torch.float32)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-2 * e.abs().max().item())
