"""Muse Glimmer under pipetune: TorchTitan's ``ModelSpec`` with attention that trains on CPU, pipetune's size
variants, and its vision encoder's planning shapes.

``with_document_attention`` rewrites a model config built with ``attn_backend="varlen"``: every
layer's inner attention becomes ``DocumentAttention`` with the same per-layer window (TorchTitan
bakes Muse Glimmer's sliding windows into the varlen configs), and the vision encoder becomes
``DenseMaskVisionEncoder`` with ``VisionMaskAttention``. Everything else, parameters and
initialisation included, is TorchTitan's.

``muse_glimmer_spec`` takes TorchTitan's flavours and pipetune's size variants (``FLAVORS``), which
call TorchTitan's own Muse Glimmer config builder with other sizes, exactly as TorchTitan's
``debugmodel_mm`` does (TorchTitan keeps its flavours in a module dict of such builders and offers
no other way to add one).
"""

from __future__ import annotations

import copy
import dataclasses

from torchtitan.models.common.attention import VarlenAttention
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.muse_glimmer import (
    MuseGlimmerModel,
    _muse_glimmer_config,
    model_registry,
    muse_glimmer_vision_adapter_config,
    muse_glimmer_vision_encoder_config,
)
from torchtitan.models.muse_glimmer.vision_encoder import MuseGlimmerVisionEncoder
from torchtitan.protocols.model_spec import ModelSpec

from pipetune.config.model import ConfigError, EncoderConfig
from torchtitan_patches.models.document_attention import DocumentAttention, VisionMaskAttention
from torchtitan_patches.models.muse_glimmer.vision import DenseMaskVisionEncoder


def with_document_attention(model_config: Decoder.Config) -> Decoder.Config:
    """A copy of ``model_config`` whose attention trains on CPU (see module doc)."""
    cfg = copy.deepcopy(model_config)
    for i, layer in enumerate(cfg.layers):
        inner = layer.attention.inner_attention
        if not isinstance(inner, VarlenAttention.Config):
            raise ConfigError(
                f"layer {i} uses {type(inner).__name__}; build the model spec with attn_backend='varlen' so each "
                "layer's window is in its inner-attention config, then apply with_document_attention"
            )
        layer.attention.inner_attention = DocumentAttention.Config(window_size=inner.window_size)
    enc = getattr(cfg, "vision_encoder", None)
    if enc is not None:
        if not isinstance(enc, MuseGlimmerVisionEncoder.Config):
            raise ConfigError(f"no CPU attention for vision encoder {type(enc).__name__}; only Muse Glimmer's is supported")
        block = dataclasses.replace(enc.block, attn=dataclasses.replace(enc.block.attn, inner_attention=VisionMaskAttention.Config()))
        fields = {f.name: getattr(enc, f.name) for f in dataclasses.fields(enc) if f.init}
        cfg.vision_encoder = DenseMaskVisionEncoder.Config(**{**fields, "block": block})
    return cfg


def _heavy_vit(attn_backend: str) -> MuseGlimmerModel.Config:
    """``debugmodel_mm`` with a vision encoder heavier than its backbone: a 10-layer ViT of width
    192 (MLP 768, 4 heads; 4.7 M parameters) on an 8-layer backbone of width 128 (4 heads, 2 KV
    heads, FFN 384; 1.7 M parameters in its layers). At 8 x 8 patches per image
    (``pipetune.image_grid = 8``; 16 tokens after the 2 x 2 merge) and DataMix3 cut at 512 tokens
    (2.1 images and 210 tokens per sample), the ViT's forward + backward (when trained) is 1.5 x
    the FLOPs of the backbone layers' forward + backward. The text side (sliding windows,
    vocabulary, adapter width) is ``debugmodel_mm``'s."""
    encoder = muse_glimmer_vision_encoder_config(
        latent_dim=192, num_layers=10, num_heads=4, mlp_ratio=4.0, downsample_factor=2, sparse_attention_factor=2, pos_emb_grid_h=2,
        pos_emb_grid_w=2,
    )
    adapter_dim = 128
    return _muse_glimmer_config(
        dim=128, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=2048, max_seq_len=4096, window_pattern=[128, 128, 128, 0],
        output_multiplier=1.0, attn_backend=attn_backend, vision_adapter_dim=adapter_dim, vision_encoder=encoder,
        vision_adapter=muse_glimmer_vision_adapter_config(input_dim=encoder.output_dim, output_dim=adapter_dim),
    )


FLAVORS = {"heavy_vit": _heavy_vit}
"""pipetune's Muse Glimmer size variants, by flavour name (beside TorchTitan's own)."""


def muse_glimmer_spec(flavor: str = "debugmodel_mm") -> ModelSpec:
    """TorchTitan's Muse Glimmer ``ModelSpec`` (its own parallelize / pipelining functions and
    state-dict adapter) of a TorchTitan flavour or one of ``FLAVORS``, with
    ``with_document_attention`` applied."""
    if flavor in FLAVORS:
        spec = dataclasses.replace(model_registry("debugmodel_mm", attn_backend="varlen"), flavor=flavor, model=FLAVORS[flavor]("varlen"))
    else:
        spec = model_registry(flavor, attn_backend="varlen")
    return dataclasses.replace(spec, model=with_document_attention(spec.model))


def planning_encoder(cfg, image_grid: int, frozen: bool) -> EncoderConfig:
    enc, adapter, proj = cfg.vision_encoder, cfg.vision_adapter, cfg.vision_projection
    if adapter is None or proj is None:
        raise ConfigError("the vision encoder needs vision_adapter and vision_projection configs")
    f = enc.downsample_factor
    if image_grid % f:
        raise ConfigError(f"image_grid={image_grid} patches per side is not a multiple of the encoder's downsample_factor={f}")
    widths = [(adapter.c_fc.in_features, adapter.c_fc.out_features), (adapter.c_proj.in_features, adapter.c_proj.out_features)]
    widths.append((proj.in_features, proj.out_features))
    chain = [w for pair in widths for w in pair]
    if chain[0] != enc.output_dim or any(a != b for a, b in zip(chain[1:-1:2], chain[2::2])) or chain[-1] != cfg.dim:
        raise ConfigError(f"projector widths {widths} do not chain from the encoder's output_dim={enc.output_dim} to dim={cfg.dim}")
    return EncoderConfig(
        n_layers=enc.num_layers,
        dim=enc.latent_dim,
        ffn_dim=enc.block.mlp.fc1.out_features,
        n_heads=enc.num_heads,
        image_size=image_grid * enc.patch_size,
        patch_size=enc.patch_size,
        channels=enc.conv1.in_features // (enc.patch_temporal * enc.patch_size**2),
        patch_temporal=enc.patch_temporal,
        frozen=frozen,
        norm_eps=float(enc.ln_pre.eps),
        merge=f,
        projector_hidden=tuple(out for _, out in widths[:-1]),
    )
