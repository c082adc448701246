"""TorchTitan ``ModelSpec`` -> a model that trains on CPU, and pipetune's planning shapes.

``with_document_attention`` rewrites a model config built with ``attn_backend="varlen"``: every
layer's inner attention becomes ``DocumentAttention`` with the same per-layer window (TorchTitan
bakes Muse Glimmer's sliding windows into the varlen configs), and a Muse Glimmer vision encoder
becomes ``DenseMaskVisionEncoder`` with ``VisionMaskAttention``. Everything else, parameters and
initialisation included, is TorchTitan's.

``planning_model_config`` derives pipetune's ``ModelConfig`` (the shapes the FLOPs, cost and
memory models read) from the TorchTitan config, so the planner and the trained model have one
source of truth. What pipetune's FLOPs model deliberately leaves out, and so this mapping drops:
norm weights, biases, Muse Glimmer's learned positional grid (no matmul), QK-norms, the soft cap
of the head and the sliding windows (attention is counted over whole documents: an overestimate
for documents longer than a window, 128 tokens in ``debugmodel_mm``); the encoder's windowed
layers are likewise counted as full attention over the image. Refused with a ``ConfigError``:
configs pipetune's schema cannot express (``head_dim * n_heads != dim``, layers that differ in
shape, MoE layers, video), and vision encoders other than Muse Glimmer's and Qwen3.5's
(TorchTitan's ``kimi_k2_7`` is not mapped yet). Qwen3.5's Gated DeltaNet layers are declared as
the backbone's linear-attention layers (``BackboneConfig.linear_attention``; what is approximated
is stated in ``planning_model_config``).

``muse_glimmer_spec`` takes TorchTitan's flavours and pipetune's size variants (``FLAVORS``), which
call TorchTitan's own Muse Glimmer config builder with other sizes, exactly as TorchTitan's
``debugmodel_mm`` does (TorchTitan keeps its flavours in a module dict of such builders and offers
no other way to add one).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

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
from torchtitan.models.qwen3_5.model import Qwen35Model
from torchtitan.protocols.model_spec import ModelSpec

from pipetune.config.model import BackboneConfig, ConfigError, EncoderConfig, LinearAttentionConfig, ModelConfig
from torchtitan_patches.model.gated_delta_cpu import CHUNK
from torchtitan_patches.titan.document_attention import DocumentAttention, VisionMaskAttention
from torchtitan_patches.titan.stages import TitanStage, encoder_chunks
from torchtitan_patches.titan.vision import DenseMaskVisionEncoder


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


def _uniform(values: list, what: str):
    if len(set(values)) != 1:
        raise ConfigError(f"{what} differs between layers ({sorted(set(values))}); pipetune's planning schema needs identical layers")
    return values[0]


def _backbone(cfg: Decoder.Config) -> BackboneConfig:
    attn = [layer.attention for layer in cfg.layers]
    ffn = [layer.feed_forward for layer in cfg.layers]
    if any(getattr(layer, "moe", None) is not None or f is None for layer, f in zip(cfg.layers, ffn)):
        raise ConfigError("MoE layers are not in pipetune's planning schema (dense SwiGLU layers only)")
    n_heads = _uniform([a.n_heads for a in attn], "n_heads")
    n_kv = _uniform([a.n_kv_heads or a.n_heads for a in attn], "n_kv_heads")
    head_dim = _uniform([a.head_dim or cfg.dim // a.n_heads for a in attn], "head_dim")
    if n_heads * head_dim != cfg.dim:
        raise ConfigError(
            f"n_heads * head_dim = {n_heads} * {head_dim} != dim = {cfg.dim}; pipetune's backbone schema has head_dim = dim / n_heads"
        )
    return BackboneConfig(
        n_layers=len(cfg.layers),
        dim=cfg.dim,
        ffn_dim=_uniform([f.w1.out_features for f in ffn], "ffn hidden dim"),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        vocab_size=cfg.vocab_size,
        rope_theta=float(_uniform([a.rope.theta for a in attn], "rope theta")),
        norm_eps=float(cfg.layers[0].attention_norm.eps),
        output_gate=bool(_uniform([getattr(a, "o_gate", None) is not None for a in attn], "output gate")),
    )


def _encoder(cfg, image_grid: int, frozen: bool) -> EncoderConfig:
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


def _qwen3_5_linear_attention(cfg: Qwen35Model.Config) -> LinearAttentionConfig | None:
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
        layers=tuple(linear), key_head_dim=_uniform([d.key_head_dim for d in dn], "DeltaNet key_head_dim"),
        value_head_dim=_uniform([d.value_head_dim for d in dn], "DeltaNet value_head_dim"),
        n_key_heads=_uniform([d.in_proj_q.out_features // d.key_head_dim for d in dn], "DeltaNet key heads"),
        n_value_heads=_uniform([d.in_proj_v.out_features // d.value_head_dim for d in dn], "DeltaNet value heads"),
        conv_kernel=_uniform([d.conv_kernel_size for d in dn], "DeltaNet conv_kernel_size"), chunk=CHUNK,
    )


def _qwen3_5_backbone(cfg: Qwen35Model.Config) -> BackboneConfig:
    """The full-attention layers' shapes, and which layers are linear attention: see ``planning_model_config``."""
    full = [layer.attention for layer in cfg.layers if layer.attention is not None]
    if not full or any(layer.moe is not None for layer in cfg.layers):
        raise ConfigError("pipetune maps dense Qwen3.5 models with full-attention layers only")
    n_heads, head_dim = _uniform([a.n_heads for a in full], "n_heads"), _uniform([a.head_dim for a in full], "head_dim")
    if n_heads * head_dim != cfg.dim:
        raise ConfigError(f"n_heads * head_dim = {n_heads} * {head_dim} != dim = {cfg.dim}; pipetune's backbone schema has "
                          "head_dim = dim / n_heads (of TorchTitan's Qwen3.5 flavours, debugmodel fits)")
    return BackboneConfig(
        n_layers=len(cfg.layers), dim=cfg.dim, ffn_dim=_uniform([layer.feed_forward.w1.out_features for layer in cfg.layers], "ffn hidden dim"),
        n_heads=n_heads, n_kv_heads=_uniform([a.n_kv_heads for a in full], "n_kv_heads"), vocab_size=cfg.vocab_size,
        rope_theta=float(_uniform([a.rope.theta for a in full], "rope theta")), norm_eps=float(cfg.layers[0].attention_norm.eps), output_gate=True,
        linear_attention=_qwen3_5_linear_attention(cfg),
    )


def _qwen3_5_encoder(cfg: Qwen35Model.Config, image_grid: int, frozen: bool) -> EncoderConfig:
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


def planning_model_config(spec: ModelSpec, *, image_grid: int, encoder_frozen: bool = True, name: str | None = None) -> ModelConfig:
    """pipetune's ``ModelConfig`` for a TorchTitan Muse Glimmer or (dense) Qwen3.5 spec.

    pipetune plans with one image size: ``image_grid`` patches per side (a multiple of the
    encoder's downsample / merge factor). ``encoder_frozen`` says whether the job trains the ViT.

    Qwen3.5: the Gated DeltaNet layers are the backbone's ``linear_attention`` layers, whose token
    mixing the cost model prices linear in the (chunk-padded) tokens from its own profiled curve.
    Their projections and FFN are planned as the gated full-attention layer's (GQA, output gate,
    SwiGLU), an approximation: the projections agree closely (``debugmodel``: DeltaNet 264 k
    weights per layer against 262 k); the memory model likewise counts their weights and
    activations as the full-attention layer's. Partial RoPE and QK-norms cost no matmul.
    """
    cfg = spec.model
    if not isinstance(cfg, Decoder.Config):
        raise ConfigError(f"{spec.name}/{spec.flavor}: not a decoder model ({type(cfg).__name__})")
    name = name or f"{spec.name}_{spec.flavor}"
    enc = getattr(cfg, "vision_encoder", None)
    if isinstance(cfg, Qwen35Model.Config):
        encoder = _qwen3_5_encoder(cfg, image_grid, encoder_frozen) if enc is not None else None
        return ModelConfig(name=name, backbone=_qwen3_5_backbone(cfg), encoder=encoder)
    if enc is not None and not isinstance(enc, MuseGlimmerVisionEncoder.Config):
        raise ConfigError(f"{spec.name}/{spec.flavor}: pipetune maps the vision encoders of Muse Glimmer and Qwen3.5 only, not "
                          f"{type(enc).__qualname__}; train this model with TorchTitan's own trainer, or pick a muse_glimmer or "
                          "qwen3_5 flavour (configs/)")
    return ModelConfig(name=name, backbone=_backbone(cfg), encoder=_encoder(cfg, image_grid, encoder_frozen) if enc is not None else None)


@dataclass(frozen=True)
class StageRuntime:
    """How ``PipeTuneTrainer`` runs a family's model parts: its stage wrapper, its encoder chunks
    and the encoder's submodules that train while the ViT is frozen (the projector's part of it)."""

    stage: Callable
    encoder_chunks: Callable
    trained_with_frozen_encoder: tuple[str, ...] = ()


def stage_runtime(spec: ModelSpec) -> StageRuntime:
    """The ``StageRuntime`` of ``spec``'s family (Muse Glimmer: ``stages``; Qwen3.5: ``qwen3_5``,
    whose merger lives inside its vision encoder)."""
    if spec.name == "qwen3_5":
        from torchtitan_patches.titan import qwen3_5

        return StageRuntime(qwen3_5.Qwen35Stage, qwen3_5.encoder_chunks, ("merger",))
    return StageRuntime(TitanStage, encoder_chunks)
