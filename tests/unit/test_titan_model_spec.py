"""pipetune's planning shapes derived from a TorchTitan model config agree with the built model.

The comparison is per component and counts matmul weights (``nn.Linear``) and embedding tables:
what pipetune's FLOPs / memory models are made of. Everything else (norm weights, biases, the
learned positional grid of the ViT) is deliberately left out of the planning schema; the test
pins how small that remainder is.
"""

import dataclasses
import hashlib
import json

import pytest
import torch
from torch import nn

from pipetune.config.model import ConfigError
from pipetune.packing.flops import FlopsModel
from torchtitan_patches.models.muse_glimmer.spec import muse_glimmer_spec
from torchtitan_patches.models.model_spec import planning_model_config


@pytest.fixture(scope="module")
def spec():
    return muse_glimmer_spec("debugmodel_mm")


@pytest.fixture(scope="module", params=[("debugmodel_mm", 4), ("heavy_vit", 8)], ids=lambda p: p[0])
def flavor(request):
    """A Muse Glimmer flavour (TorchTitan's or pipetune's size variant) and its image grid."""
    name, grid = request.param
    return muse_glimmer_spec(name), grid


def _matmul_weights(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, (nn.Linear, nn.Embedding)))


def _all(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_parameter_counts_match_the_built_model_per_component(flavor):
    spec, grid = flavor
    cfg = planning_model_config(spec, image_grid=grid)
    with torch.device("meta"):
        m = spec.model.build()
    b, e = cfg.backbone, cfg.encoder
    derived = {
        "backbone layers": b.n_layers * b.layer_params,
        "embedding + head": 2 * b.vocab_size * b.dim,
        "vision encoder": e.n_layers * e.layer_params + e.patch_dim * e.dim,
        "projector": cfg.projector_params,
    }
    parts = {
        "backbone layers": [m.layers],
        "embedding + head": [m.tok_embeddings, m.lm_head],
        "vision encoder": [m.vision_encoder],
        "projector": [m.vision_adapter, m.vision_projection],
    }
    actual = {k: sum(_matmul_weights(p) for p in mods) for k, mods in parts.items()}
    assert derived == actual
    # the only parameters outside the comparison: norms, biases, positional grid (< 0.5 %)
    total = _all(m)
    ignored = total - sum(actual.values())
    assert ignored == total - sum(derived.values())
    assert 0 < ignored < 0.005 * total, (ignored, total)
    assert sum(_all(p) for mods in parts.values() for p in mods) + _all(m.norm) == total


def test_shapes_come_from_the_torchtitan_config(spec):
    cfg = planning_model_config(spec, image_grid=6, encoder_frozen=False, name="mm")
    b, e = cfg.backbone, cfg.encoder
    assert (b.n_layers, b.dim, b.ffn_dim, b.n_heads, b.n_kv_heads, b.vocab_size) == (8, 256, 768, 4, 2, 2048)
    assert b.output_gate and b.rope_theta == 500_000.0
    assert (e.n_layers, e.dim, e.n_heads, e.patch_size, e.patch_temporal, e.merge) == (3, 64, 4, 14, 2, 2)
    assert e.image_size == 6 * 14 and e.tokens_per_image == 9 and not e.frozen
    assert e.projector_hidden == (128, 128) and cfg.name == "mm"
    # the FLOPs model reads the derived shapes: projector FLOPs per image = 2 * tokens * weights
    assert FlopsModel(cfg).projector_forward_per_image() == 2 * 9 * (256 * 128 + 128 * 128 + 128 * 256)


def test_image_grid_must_suit_the_pixel_shuffle(spec):
    with pytest.raises(ConfigError, match="downsample_factor=2"):
        planning_model_config(spec, image_grid=5)


def test_head_dim_outside_the_schema_is_refused(spec):
    odd = dataclasses.replace(spec.model, layers=[dataclasses.replace(l, attention=dataclasses.replace(l.attention, head_dim=32)) for l in spec.model.layers])
    with pytest.raises(ConfigError, match="head_dim = dim / n_heads"):
        planning_model_config(dataclasses.replace(spec, model=odd), image_grid=4)


def test_a_vlm_pipetune_does_not_map_is_refused_by_name():
    """TorchTitan's Kimi K2.7 has its own vision encoder: a ConfigError naming it, not an AttributeError."""
    from torchtitan.models.kimi_k2_7 import model_registry

    with pytest.raises(ConfigError, match="vision encoders of Muse Glimmer and Qwen3.5 only"):
        planning_model_config(model_registry("debugmodel"), image_grid=4)


def test_fingerprint_of_existing_presets_is_unchanged_by_the_new_fields(tiny):
    """Optional shape fields count only when set, so latency tables made before them stay valid."""
    gated = dataclasses.replace(tiny, backbone=dataclasses.replace(tiny.backbone, output_gate=True))
    assert gated.fingerprint() != tiny.fingerprint()
    d = tiny.to_dict()
    for k in ("output_gate", "linear_attention"):
        d["backbone"].pop(k)
    for k in ("patch_temporal", "projector_hidden"):
        d["encoder"].pop(k)
    d.pop("name")  # the hash as it was computed before the new fields existed
    assert tiny.fingerprint() == hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
