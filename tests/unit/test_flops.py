"""The FLOPs model against torch's FlopCounterMode on real TorchTitan layers."""

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pipetune.packing import FlopsModel
from torchtitan_patches.model.blocks import decoder_layer_config, no_rope, vit_layer_config
from torchtitan_patches.model.packed_attention import varlen_metadata


def counted(fn):
    """FLOPs of fn() forward and forward+backward; the math SDPA backend so attention is counted."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        out = fn()
        fwd = fc.get_total_flops()
        out.float().pow(2).sum().backward()
    return fwd, fc.get_total_flops()


@pytest.mark.parametrize("lengths", [[100, 150, 50, 200], [511], [3, 7, 1, 64, 300]])
def test_decoder_layer_flops_match_flop_counter(tiny, lengths):
    torch.manual_seed(0)
    layer = decoder_layer_config(tiny.backbone, max_seq_len=1024, attention_backend="sdpa").build()
    layer.init_states()
    cu = torch.tensor([0, *np.cumsum(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    x = torch.randn(1, sum(lengths), tiny.backbone.dim, requires_grad=True)
    fwd, total = counted(lambda: layer(x, varlen_metadata(cu), pos))
    # FlopCounterMode counts SDPA densely (no causal discount), so compare the dense convention.
    model = FlopsModel(tiny, causal=False).layer_forward(lengths).sum()
    assert abs(fwd - model) <= 0.05 * fwd
    assert abs(total - 3 * model) <= 0.05 * total


def test_vit_layer_flops_match_flop_counter(tiny):
    enc = tiny.encoder
    layer = vit_layer_config(enc).build()
    layer.init_states()
    x = torch.randn(5, enc.tokens_per_image, enc.dim, requires_grad=True)
    fwd, _ = counted(lambda: layer(x, rope_cache=torch.zeros(1), rope_apply=no_rope, attention_mask=None))
    p = enc.tokens_per_image
    per_image_layer = 2 * p * enc.layer_params + 4 * enc.dim * p * p
    assert abs(fwd - 5 * per_image_layer) <= 0.05 * fwd


def test_causal_pairs_are_the_block_diagonal_lower_triangle(tiny):
    lengths = [5, 1, 12, 7]
    mask = torch.block_diag(*[torch.ones(n, n).tril() for n in lengths])
    f_causal = FlopsModel(tiny, causal=True)
    f_full = FlopsModel(tiny, causal=False)
    attn_causal = f_causal.layer_forward(lengths).sum() - f_causal.linear_per_token * sum(lengths)
    attn_full = f_full.layer_forward(lengths).sum() - f_full.linear_per_token * sum(lengths)
    assert attn_causal == pytest.approx(f_causal.attention_per_pair * mask.sum().item())
    assert attn_full == pytest.approx(f_full.attention_per_pair * sum(n * n for n in lengths))


def test_micro_batch_flops_are_additive_over_documents(model13b):
    f = FlopsModel(model13b)
    docs = np.array([100, 2000, 37])
    joint = f.sequence_flops(docs).sum()
    assert joint == pytest.approx(sum(f.sequence_flops([d])[0] for d in docs))
    assert f.sequence_flops([4000])[0] > 2 * f.sequence_flops([2000])[0]  # attention is superlinear


def test_frozen_encoder_is_forward_only(tiny):
    f = FlopsModel(tiny)
    assert f.encoder_flops(3) == pytest.approx(3 * f.vit_forward_per_image())
    assert f.encoder_flops(3, backward=True) == pytest.approx(9 * f.vit_forward_per_image())
