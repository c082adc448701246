"""Qwen3.5's ``ModelSpec`` under pipetune and its planning shapes (package doc)."""

from __future__ import annotations

import dataclasses

from torchtitan.models.qwen3_5 import model_registry, qwen3_5_configs
from torchtitan.models.qwen3_5.model import Qwen35Model
from torchtitan.protocols.model_spec import ModelSpec

from pipetune.config.model import BackboneConfig, ConfigError, EncoderConfig, LinearAttentionConfig
from torchtitan_patches.models.planning_shapes import uniform
from torchtitan_patches.models.qwen3_5.cpu_paths import with_cpu_paths
from torchtitan_patches.models.qwen3_5.gated_delta_cpu import CHUNK
from torchtitan_patches.models.qwen3_5.parallelize import parallelize_for_pipetune


def _small_vocab(attn_backend: str) -> Qwen35Model.Config:
    """TorchTitan's ``debugmodel`` (8 layers of width 256, 6 Gated DeltaNet + 2 full attention; a
    4-block ViT of width 256 with a 2 x 2 merger) with a vocabulary of 2048 instead of Qwen's
    248,320, whose embedding and head (127 M of its 136 M parameters) would dominate a CPU test."""
    cfg = qwen3_5_configs["debugmodel"](attn_backend=attn_backend)
    vocab = 2048
    return dataclasses.replace(cfg, vocab_size=vocab, tok_embeddings=dataclasses.replace(cfg.tok_embeddings, num_embeddings=vocab),
                               lm_head=dataclasses.replace(cfg.lm_head, out_features=vocab))


FLAVORS = {"debugmodel_small_vocab": _small_vocab}
"""pipetune's Qwen3.5 size variants, by flavour name (beside TorchTitan's own)."""


def qwen3_5_spec(flavor: str = "debugmodel") -> ModelSpec:
    """TorchTitan's Qwen3.5 ``ModelSpec`` of a dense flavour (TorchTitan's or one of ``FLAVORS``)
    with ``with_cpu_paths`` applied and ``parallelize_for_pipetune``; split by TorchTitan's
    ``pipeline_vlm`` (pipetune hands it the layout through ``module_fqns_per_model_part``)."""
    if flavor in FLAVORS:
        spec = dataclasses.replace(model_registry("debugmodel", attn_backend="varlen"), flavor=flavor, model=FLAVORS[flavor]("varlen"))
    else:
        spec = model_registry(flavor, attn_backend="varlen")
    return dataclasses.replace(spec, model=with_cpu_paths(spec.model), parallelize_fn=parallelize_for_pipetune)


def _linear_attention(cfg: Qwen35Model.Config) -> LinearAttentionConfig | None:
    """The Gated DeltaNet layers (TorchTitan's ``full_attention_interval`` leaves every layer but each
    4th one linear) and their recurrence's shapes."""
    linear = {i: layer.delta_net for i, layer in enumerate(cfg.layers) if layer.attention is None}
    if not linear:
        return None
    dn = list(linear.values())
    if any(d.kernel.backend != "fla_chunked" for d in dn):
        raise ConfigError("pipetune plans Gated DeltaNet layers on fla's chunked kernel (backend 'fla_chunked', TorchTitan's "
                          "training default); the fused recurrent one is for inference")
    return LinearAttentionConfig(
        layers=tuple(linear), key_head_dim=uniform([d.key_head_dim for d in dn], "DeltaNet key_head_dim"),
        value_head_dim=uniform([d.value_head_dim for d in dn], "DeltaNet value_head_dim"),
        n_key_heads=uniform([d.in_proj_q.out_features // d.key_head_dim for d in dn], "DeltaNet key heads"),
        n_value_heads=uniform([d.in_proj_v.out_features // d.value_head_dim for d in dn], "DeltaNet value heads"),
        conv_kernel=uniform([d.conv_kernel_size for d in dn], "DeltaNet conv_kernel_size"), chunk=CHUNK,
    )


def planning_backbone(cfg: Qwen35Model.Config) -> BackboneConfig:
    """The full-attention layers' shapes, and which layers are linear attention: see ``planning_model_config``."""
    full = [layer.attention for layer in cfg.layers if layer.attention is not None]
    if not full or any(layer.moe is not None for layer in cfg.layers):
        raise ConfigError("pipetune maps dense Qwen3.5 models with full-attention layers only")
    n_heads, head_dim = uniform([a.n_heads for a in full], "n_heads"), uniform([a.head_dim for a in full], "head_dim")
    if n_heads * head_dim != cfg.dim:
        raise ConfigError(f"n_heads * head_dim = {n_heads} * {head_dim} != dim = {cfg.dim}; pipetune's backbone schema has "
                          "head_dim = dim / n_heads (of TorchTitan's Qwen3.5 flavours, debugmodel fits)")
    return BackboneConfig(
        n_layers=len(cfg.layers), dim=cfg.dim, ffn_dim=uniform([layer.feed_forward.w1.out_features for layer in cfg.layers], "ffn hidden dim"),
        n_heads=n_heads, n_kv_heads=uniform([a.n_kv_heads for a in full], "n_kv_heads"), vocab_size=cfg.vocab_size,
        rope_theta=float(uniform([a.rope.theta for a in full], "rope theta")), norm_eps=float(cfg.layers[0].attention_norm.eps), output_gate=True,
        linear_attention=_linear_attention(cfg),
    )


def planning_encoder(cfg: Qwen35Model.Config, image_grid: int, frozen: bool) -> EncoderConfig:
    """Qwen's ViT; its ``PatchMerger`` (``merged -> merged -> dim`` MLP) is the projector."""
    enc = cfg.vision_encoder
    merger, merge = enc.merger, enc.spatial_merge_size
    if image_grid % merge:
        raise ConfigError(f"image_grid={image_grid} patches per side is not a multiple of the encoder's spatial_merge_size={merge}")
    if merger.fc1.in_features != enc.dim * merge**2 or merger.fc2.in_features != merger.fc1.out_features or merger.fc2.out_features != cfg.dim:
        raise ConfigError(f"merger widths {merger.fc1.in_features} -> {merger.fc1.out_features} -> {merger.fc2.out_features} do not chain "
                          f"from the merged width {enc.dim * merge**2} to dim={cfg.dim}")
    return EncoderConfig(
        n_layers=enc.num_layers, dim=enc.dim, ffn_dim=enc.block.mlp.fc1.out_features, n_heads=enc.num_heads, image_size=image_grid * enc.patch_size,
        patch_size=enc.patch_size, channels=enc.in_channels, patch_temporal=enc.temporal_patch_size, frozen=frozen,
        norm_eps=float(enc.block.norm1.eps), merge=merge, projector_hidden=(merger.fc1.out_features,),
    )
