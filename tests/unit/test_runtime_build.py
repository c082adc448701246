"""Only local stages are built: a rank of a 4-stage 13B pipeline, on the meta device, holds exactly
its own stages' parameters (counted from the model's shapes), and nothing is materialised."""

import pytest
import torch

from pipetune.config import load_model_config
from pipetune.cost import StageLayout
from torchtitan_patches.models.reference.vlm import build_stages, build_vlm
from torchtitan_patches.runtime.reference import whole_model_names


def analytic_params(model, lo: int, hi: int, *, first: bool, last: bool) -> int:
    """Parameters of decoder layers [lo, hi) plus what the first / last stage adds, from the
    model's shapes: matmuls (``layer_params``) and the two RMSNorm weights per layer; embedding,
    projector (two biased linears) and SigLIP encoder (biased projections, LayerNorms, patch
    convolution, learned positions) on the first stage; final norm and head on the last."""
    b, e = model.backbone, model.encoder
    n = (hi - lo) * (b.layer_params + 2 * b.dim)
    if first:
        n += b.vocab_size * b.dim
        n += e.dim * b.dim + b.dim + b.dim * b.dim + b.dim
        vit_layer = e.layer_params + 4 * e.dim + e.ffn_dim + e.dim + 2 * 2 * e.dim
        n += e.n_layers * vit_layer + e.channels * e.patch_size**2 * e.dim + e.dim + e.tokens_per_image * e.dim + 2 * e.dim
    if last:
        n += b.dim + b.dim * b.vocab_size
    return n


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_a_rank_of_a_4_stage_13b_model_holds_only_its_stage(rank):
    model = load_model_config("13b")
    ranges = list(StageLayout.even(model.backbone.n_layers, 4).layer_ranges)
    encoder, stages = build_stages(model, ranges, [rank], max_seq_len=8192, device="meta")
    params = [p for m in (encoder, *stages.values()) if m is not None for p in m.parameters()]
    assert params and all(p.is_meta for p in params)  # no weight materialised
    lo, hi = ranges[rank]
    expected = analytic_params(model, lo, hi, first=rank == 0, last=rank == 3)
    got = sum(p.numel() * p.element_size() for p in params)  # meta tensors count by shape
    assert got == 4 * expected  # fp32 master weights
    assert (encoder is not None) == (rank == 0)
    whole = sum(analytic_params(model, a, b, first=k == 0, last=k == 3) for k, (a, b) in enumerate(ranges))
    assert got < 0.4 * 4 * whole
    print(f"13B, 4 stages: rank {rank} holds {got / 2**30:.2f} GiB of fp32 parameters (whole model {4 * whole / 2**30:.2f} GiB)")


def test_stages_built_alone_equal_the_whole_model():
    """Per-piece seeding: a stage built on its own holds the same weights as the reference's layers."""
    model = load_model_config("tiny")
    enc_a, whole = build_vlm(model, max_seq_len=256, seed=7)
    enc_b, parts = build_stages(model, [(0, 1), (1, 3), (3, 4)], [1, 2], max_seq_len=256, seed=7)
    enc_c, first = build_stages(model, [(0, 2), (2, 4)], [0], max_seq_len=256, seed=7)
    assert enc_b is None and all(torch.equal(p, q) for p, q in zip(enc_a.parameters(), enc_c.parameters()))
    ref = dict(whole.named_parameters())
    for stage in (*parts.values(), first[0]):
        names = whole_model_names(stage)
        for name, p in stage.named_parameters():
            assert torch.equal(p, ref[names[name]]), name
    _, other_seed = build_vlm(model, max_seq_len=256, seed=8)
    assert not torch.equal(next(other_seed.layers[0].parameters()), next(whole.layers[0].parameters()))


def test_bad_layer_ranges_are_refused():
    model = load_model_config("tiny")
    with pytest.raises(ValueError, match="do not tile"):
        build_stages(model, [(0, 2), (3, 4)], [0], max_seq_len=256, device="meta")


def test_spatial_merge_packs_each_2x2_block_of_patches_into_one_token(tiny):
    """A merge-2 encoder hands the backbone patches / 4 tokens, each the concatenation of one 2 x 2
    block of neighbouring patch features of the same ViT (identical weights, merge 1)."""
    from dataclasses import replace

    from torchtitan_patches.models.reference.vlm import Projector, VisionEncoder

    plain = VisionEncoder(tiny.encoder)
    merged = VisionEncoder(replace(tiny.encoder, merge=2))
    merged.load_state_dict(plain.state_dict())
    side = tiny.encoder.image_size // tiny.encoder.patch_size
    rows, grids = torch.randn(3 * side * side, tiny.encoder.patch_dim), ((side, side),) * 3
    patches = plain(rows, grids).view(3, side, side, -1)
    tokens = merged(rows, grids).view(3, merged.config.tokens_per_image, -1)
    assert tokens.shape == (3, merged.config.tokens_per_image, merged.config.merged_dim) == (3, side * side // 4, 4 * tiny.encoder.dim)
    for i, j in [(0, 0), (0, 1), (1, 0), (side // 2 - 1, side // 2 - 1)]:
        block = torch.cat([patches[:, 2 * i + a, 2 * j + b] for a in (0, 1) for b in (0, 1)], dim=-1)
        torch.testing.assert_close(tokens[:, i * (side // 2) + j], block)
    assert Projector(merged.config.merged_dim, tiny.backbone.dim)(tokens).shape == (3, side * side // 4, tiny.backbone.dim)


def test_encoder_chunks_built_alone_equal_the_whole_encoder(tiny):
    """DIP's encoder chunks (a 5-layer encoder cut 2+1+2, built on three 'ranks'): the same weights
    as the whole encoder's layers, embedding and norm, and run one after the other the same output."""
    from dataclasses import replace

    from torchtitan_patches.data.micro_batch import patchify
    from torchtitan_patches.models.reference.vlm import build_encoder_chunks

    model = replace(tiny, encoder=replace(tiny.encoder, n_layers=5, merge=2))
    whole, _ = build_vlm(model, max_seq_len=256, seed=3)
    ranges = [(0, 2), (2, 3), (3, 5)]
    chunks = {c: build_encoder_chunks(model, ranges, [c], seed=3)[c] for c in range(3)}
    ref = dict(whole.named_parameters())
    for chunk in chunks.values():
        for name, p in chunk.named_parameters():
            assert torch.equal(p, ref[whole_model_names(chunk)[name]]), name
    assert sum(len(list(c.parameters())) for c in chunks.values()) == len(ref)
    assert [(c.is_first, c.is_last) for c in chunks.values()] == [(True, False), (False, False), (False, True)]
    e = model.encoder
    pixels = torch.randn(3, 3, e.image_size, e.image_size)
    x = torch.cat([torch.from_numpy(patchify(im.numpy(), e.patch_size, 1)) for im in pixels])  # the loader's layout
    grids = ((e.image_size // e.patch_size,) * 2,) * 3
    y = x
    for c in range(3):
        y = chunks[c](y, grids)
    torch.testing.assert_close(y, whole(x, grids))
    assert y.shape == (3 * e.tokens_per_image, e.merged_dim)
    # the linear patch embedding of patch rows is the stride-patch_size convolution of the pixels
    conv = whole.patch_embed(pixels).flatten(2).transpose(1, 2)
    torch.testing.assert_close(torch.nn.functional.linear(x.view(3, e.patches_per_image, -1), whole.patch_embed.weight.flatten(1),
                                                          whole.patch_embed.bias), conv)
    with pytest.raises(ValueError, match="do not tile the encoder's 5 layers"):
        build_encoder_chunks(model, [(0, 2), (3, 5)], [0])
