"""TorchTitan's Muse Glimmer (``debugmodel_mm``) trains on CPU with pipetune's document attention.

* packed documents (text and images) give the same logits and gradients as each document run
  alone: nothing leaks between documents;
* with two rows and sliding windows shorter than some documents, the result equals dense SDPA under
  TorchTitan's own mask definitions (causal + packed document + sliding window, ``create_mask``);
* the dense-mask vision encoder equals TorchTitan's FlexAttention encoder (eager, forward only:
  FlexAttention has no CPU backward) on images of different sizes.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import and_masks, create_mask

from torchtitan.models.common.attention import get_causal_mask_mod, get_document_mask_mod, get_sliding_window_mask_mod
from torchtitan_patches.models.packed_attention import varlen_metadata
from torchtitan_patches.models.document_attention import DocumentAttention
from torchtitan_patches.models.muse_glimmer.spec import muse_glimmer_spec

PATCH_DIM = 2 * 3 * 14 * 14
IMAGE_ID = 0
VOCAB = 2048


def build(config, seed=0):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
        for name, p in model.named_parameters():  # gain norms start at 0: perturb so their gradients matter
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(autouse=True)
def no_spmd_types(monkeypatch):
    """Outside TorchTitan's trainer there is no SPMD mesh: use the plain-tensor backend."""
    import torchtitan.distributed.utils as dist_utils

    monkeypatch.setattr(dist_utils, "_spmd_backend", "partial_dtensor")


@pytest.fixture(scope="module")
def spec():
    return muse_glimmer_spec("debugmodel_mm")


@pytest.fixture(scope="module")
def model(spec):
    return build(spec.model)


def document(gen, text_before, grid=None, text_after=0):
    """(tokens, labels, images) of one document: text, optional image placeholders, text."""
    n_img = grid[0] * grid[1] // 4 if grid else 0
    toks = torch.cat([torch.randint(1, VOCAB, (text_before,), generator=gen), torch.full((n_img,), IMAGE_ID), torch.randint(1, VOCAB, (text_after,), generator=gen)])
    text = toks != IMAGE_ID
    labels = torch.full_like(toks, -100)
    labels[:-1] = torch.where(text[1:], toks[1:], -100)
    images = [(torch.randn(grid[0] * grid[1], PATCH_DIM, generator=gen), grid)] if grid else []
    return toks, labels, images


def forward_loss(model, docs):
    """Sum cross-entropy of ``docs`` packed into one row; returns (logits, loss)."""
    toks = torch.cat([d[0] for d in docs])[None]
    labels = torch.cat([d[1] for d in docs])[None]
    positions = torch.cat([torch.arange(len(d[0])) for d in docs])[None]
    images = [im for d in docs for im in d[2]]
    kwargs = {}
    if images:
        p = max(x.shape[0] for x, _ in images)
        kwargs = dict(
            pixel_values=torch.stack([F.pad(x, (0, 0, 0, p - x.shape[0])) for x, _ in images]),
            grid_thw=torch.tensor([[1, *g] for _, g in images]),
            special_tokens={"image_id": IMAGE_ID},
        )
    logits = model(toks, positions=positions, attention_masks=model.get_attention_masks(positions), **kwargs)
    return logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict, expected: dict):
    """fp32 agreement per tensor: |diff| <= 1e-4 * (|expected| + max |expected|) (summation order differs)."""
    assert got.keys() == expected.keys()
    for name, g in got.items():
        scale = expected[name].abs().max().item()
        torch.testing.assert_close(g, expected[name], rtol=1e-4, atol=1e-4 * scale, msg=name)


def test_packed_documents_equal_documents_run_alone(model):
    gen = torch.Generator().manual_seed(1)
    docs = [document(gen, 150), document(gen, 10, (4, 4), 20), document(gen, 0, (2, 4), 30), document(gen, 5, (2, 2), 1)]
    model.zero_grad()
    packed_logits, loss = forward_loss(model, docs)
    loss.backward()
    packed = grads(model)
    model.zero_grad()
    alone_logits = []
    for d in docs:
        logits, loss = forward_loss(model, [d])
        loss.backward()
        alone_logits.append(logits[0])
    alone = grads(model)
    torch.testing.assert_close(packed_logits[0], torch.cat(alone_logits), rtol=1e-5, atol=1e-5)
    assert any(k.startswith("vision_encoder.") for k in packed)
    assert_grads_close(packed, alone)


class DenseMaskReference(torch.nn.Module):
    """Dense SDPA under TorchTitan's own mask_mods (independent of DocumentAttention's code)."""

    def __init__(self, positions, window):
        super().__init__()
        mods = [get_causal_mask_mod(), get_document_mask_mod(positions)] + ([get_sliding_window_mask_mod(window)] if window else [])
        B, L = positions.shape
        self.mask = create_mask(and_masks(*mods), B, None, L, L, device="cpu")

    def forward(self, q, k, v, *, attention_masks, scale=None, enable_gqa=False, **kwargs):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=self.mask, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def test_two_rows_and_sliding_windows_equal_dense_masks(model):
    gen = torch.Generator().manual_seed(2)
    rows = [[150, 42], [60, 132]]  # windows are 128 tokens on 6 of the 8 layers
    toks = torch.stack([torch.randint(1, VOCAB, (sum(r),), generator=gen) for r in rows])
    positions = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])
    ref = copy.deepcopy(model)
    windows = [layer.attention.inner_attention.window for layer in model.layers.values()]
    assert sorted(set(windows), key=str) == [128, None]
    for layer, w in zip(ref.layers.values(), windows):
        layer.attention.inner_attention = DenseMaskReference(positions, w)
    out = {}
    for name, m in (("ours", model), ("ref", ref)):
        m.zero_grad()
        logits = m(toks, positions=positions, attention_masks=model.get_attention_masks(positions))
        (logits.float().square().mean()).backward()
        out[name] = (logits.detach(), grads(m))
    torch.testing.assert_close(out["ours"][0], out["ref"][0], rtol=1e-5, atol=1e-5)
    assert_grads_close(out["ours"][1], out["ref"][1])


def test_windowed_layer_differs_from_unwindowed_on_long_documents():
    """The band matters: a 150-token document under a 128-token window is not plain causal."""
    q, k, v = (torch.randn(1, 150, 2, 8) for _ in range(3))
    meta = varlen_metadata(torch.tensor([0, 150], dtype=torch.int32))
    windowed = DocumentAttention.Config(window_size=(127, 0)).build()(q, k, v, attention_masks=meta)
    causal = DocumentAttention.Config(window_size=(-1, 0)).build()(q, k, v, attention_masks=meta)
    torch.testing.assert_close(windowed[:, :128], causal[:, :128])
    assert (windowed[:, 128:] - causal[:, 128:]).abs().max() > 1e-3


def test_vision_encoder_equals_torchtitans_flex_encoder(spec, monkeypatch):
    import torchtitan.models.muse_glimmer.vision_encoder as ve
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.muse_glimmer import model_registry

    # TorchTitan compiles both; the compiled mask builder fails on CPU, eager runs forward only
    monkeypatch.setattr(ve, "compiled_create_block_mask", create_block_mask)
    monkeypatch.setattr(FlexAttention, "_compiled_flex_attn", flex_attention)
    ours = build(spec.model.vision_encoder)
    stock = build(model_registry("debugmodel_mm", attn_backend="flex").model.vision_encoder)
    stock.load_state_dict(ours.state_dict())
    gen = torch.Generator().manual_seed(3)
    pixels, grid = torch.randn(3, 16, PATCH_DIM, generator=gen), torch.tensor([[1, 4, 4], [1, 2, 4], [1, 2, 2]])
    with torch.no_grad():
        expected = stock(pixels, grid_thw=grid)
    got = ours(pixels, grid_thw=grid)
    assert got.shape == (4 + 2 + 1, 256)
    torch.testing.assert_close(got.detach(), expected, rtol=1e-5, atol=1e-5)


def test_wrong_mask_kind_is_a_clear_error():
    attn = DocumentAttention.Config().build()
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(TypeError, match="needs VarlenMetadata"):
        attn(q, q, q, attention_masks=None)
    with pytest.raises(ValueError, match="causal windows"):
        DocumentAttention.Config(window_size=(3, 2)).build()
