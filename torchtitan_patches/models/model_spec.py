"""The ``ModelSpec`` families pipetune plans, and what each needs from it: planning shapes and a stage runtime.

``planning_model_config`` derives pipetune's ``ModelConfig`` (the shapes the FLOPs, cost and
memory models read) from the TorchTitan config, so the planner and the trained model have one
source of truth (each family's folder holds its mapping). What pipetune's FLOPs model deliberately
leaves out, and so the mapping drops: norm weights, biases, Muse Glimmer's learned positional grid
(no matmul), QK-norms, the soft cap of the head and the sliding windows (attention is counted over
whole documents: an overestimate for documents longer than a window, 128 tokens in
``debugmodel_mm``); the encoder's windowed layers are likewise counted as full attention over the
image. Refused with a ``ConfigError``: configs pipetune's schema cannot express (``head_dim *
n_heads != dim``, layers that differ in shape, MoE layers, video), and vision encoders other than
Muse Glimmer's and Qwen3.5's (TorchTitan's ``kimi_k2_7`` is not mapped yet). Qwen3.5's Gated
DeltaNet layers are declared as the backbone's linear-attention layers
(``BackboneConfig.linear_attention``; what is approximated is stated in ``planning_model_config``).

``stage_runtime`` gives the family's stage wrapper and encoder chunks (``muse_glimmer.stages``,
``qwen3_5.stages``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torchtitan.models.common.decoder import Decoder
from torchtitan.models.muse_glimmer.vision_encoder import MuseGlimmerVisionEncoder
from torchtitan.models.qwen3_5.model import Qwen35Model
from torchtitan.protocols.model_spec import ModelSpec

from pipetune.config.model import ConfigError, ModelConfig
from torchtitan_patches.models.muse_glimmer.spec import planning_encoder as muse_glimmer_encoder
from torchtitan_patches.models.muse_glimmer.stages import TitanStage, encoder_chunks
from torchtitan_patches.models.planning_shapes import decoder_backbone
from torchtitan_patches.models.qwen3_5.spec import planning_backbone as qwen3_5_backbone, planning_encoder as qwen3_5_encoder


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
        encoder = qwen3_5_encoder(cfg, image_grid, encoder_frozen) if enc is not None else None
        return ModelConfig(name=name, backbone=qwen3_5_backbone(cfg), encoder=encoder)
    if enc is not None and not isinstance(enc, MuseGlimmerVisionEncoder.Config):
        raise ConfigError(f"{spec.name}/{spec.flavor}: pipetune maps the vision encoders of Muse Glimmer and Qwen3.5 only, not "
                          f"{type(enc).__qualname__}; train this model with TorchTitan's own trainer, or pick a muse_glimmer or "
                          "qwen3_5 flavour (configs/)")
    return ModelConfig(name=name, backbone=decoder_backbone(cfg), encoder=muse_glimmer_encoder(cfg, image_grid, encoder_frozen) if enc is not None else None)


@dataclass(frozen=True)
class StageRuntime:
    """How ``PipeTuneTrainer`` runs a family's model parts: its stage wrapper, its encoder chunks
    and the encoder's submodules that train while the ViT is frozen (the projector's part of it)."""

    stage: Callable
    encoder_chunks: Callable
    trained_with_frozen_encoder: tuple[str, ...] = ()


def stage_runtime(spec: ModelSpec) -> StageRuntime:
    """The ``StageRuntime`` of ``spec``'s family (Muse Glimmer: ``muse_glimmer.stages``; Qwen3.5: ``qwen3_5.stages``,
    whose merger lives inside its vision encoder)."""
    if spec.name == "qwen3_5":
        from torchtitan_patches.models.qwen3_5 import stages

        return StageRuntime(stages.Qwen35Stage, stages.encoder_chunks, ("merger",))
    return StageRuntime(TitanStage, encoder_chunks)
