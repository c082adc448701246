"""A LLaVA-style VLM from TorchTitan blocks: frozen ViT -> 2-layer MLP projector -> LLaMA decoder.

The model is built whole and then split into pipeline stages by layer ranges
(``split_backbone``), so a pipelined run and a single-process reference hold the very same weights.
The ViT is its own module: PipeTune co-locates it with stage 0 and may run it early (encoder
pre-computation); DIP places it in segments of its own. Its output, per image, is
``(tokens_per_image, encoder_dim)`` features that stage 0 projects and scatters into the sequence.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchtitan.models.common import Embedding, Linear
from torchtitan.models.common.nn_modules import LayerNorm, RMSNorm

from pipetune.config.model import EncoderConfig, ModelConfig
from torchtitan_patches.data.micro_batch import IGNORE_INDEX
from torchtitan_patches.model.attention import varlen_metadata
from torchtitan_patches.model.blocks import decoder_layer_config, no_rope, vit_layer_config

_SMALL = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}


class VisionEncoder(nn.Module):
    """Patch embedding + learned positions + ViT layers + final LayerNorm (SigLIP layout)."""

    def __init__(self, e: EncoderConfig, tp: int = 1):
        super().__init__()
        self.config = e
        self.patch_embed = nn.Conv2d(e.channels, e.dim, kernel_size=e.patch_size, stride=e.patch_size)
        self.pos_embed = nn.Parameter(torch.randn(e.tokens_per_image, e.dim) * 0.02)
        self.layers = nn.ModuleList(vit_layer_config(e, tp).build() for _ in range(e.n_layers))
        self.post_norm = LayerNorm.Config(normalized_shape=e.dim, eps=e.norm_eps).build()
        for layer in self.layers:
            layer.init_states()
        if e.frozen:
            self.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2) + self.pos_embed
        for layer in self.layers:
            x = layer(x, rope_cache=x.new_zeros(1), rope_apply=no_rope, attention_mask=None)
        return self.post_norm(x)


class Projector(nn.Module):
    """Encoder features -> backbone embeddings: Linear, GELU, Linear (trained); ``tp > 1`` builds
    one tensor-parallel rank's shard (for profiling)."""

    def __init__(self, encoder_dim: int, dim: int, tp: int = 1):
        super().__init__()
        self.fc1 = Linear.Config(in_features=encoder_dim, out_features=dim // tp, bias=True, param_init=_SMALL).build()
        self.fc2 = Linear.Config(in_features=dim // tp, out_features=dim, bias=True, param_init=_SMALL).build()
        self.fc1.init_states()
        self.fc2.init_states()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(features)))


class BackboneStage(nn.Module):
    """Decoder layers ``[first_layer, first_layer + len(layers))``; the first stage also embeds
    tokens and projects image features, the last applies the final norm and the output head.

    ``forward`` returns hidden states ``(1, T, dim)``, or logits ``(1, T, vocab)`` on the last stage.
    """

    def __init__(self, model: ModelConfig, *, max_seq_len: int, attention_backend: str = "auto"):
        super().__init__()
        b = model.backbone
        self.first_layer = 0
        self.tok_embeddings = Embedding.Config(num_embeddings=b.vocab_size, embedding_dim=b.dim, param_init=_SMALL).build()
        self.projector = Projector(model.encoder.dim, b.dim) if model.encoder is not None else None
        self.layers = nn.ModuleList(
            decoder_layer_config(b, max_seq_len=max_seq_len, attention_backend=attention_backend).build() for _ in range(b.n_layers)
        )
        self.norm = RMSNorm.Config(normalized_shape=b.dim, eps=b.norm_eps).build()
        self.lm_head = Linear.Config(in_features=b.dim, out_features=b.vocab_size, param_init=_SMALL).build()
        for m in (self.tok_embeddings, *self.layers, self.lm_head):
            m.init_states()

    @property
    def is_first(self) -> bool:
        return self.tok_embeddings is not None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    def forward(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        image_features: torch.Tensor | None = None,
        image_token_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.is_first:
            x = self.tok_embeddings(x)
            if image_features is not None and image_features.shape[0] > 0:
                if self.projector is None:
                    raise ValueError("image features given to a text-only model")
                projected = self.projector(image_features.flatten(0, 1)).to(x.dtype)
                x = x.index_put((torch.zeros_like(image_token_index), image_token_index), projected)
        masks = varlen_metadata(cu_seqlens)
        for layer in self.layers:
            x = layer(x, masks, positions)
        if self.is_last:
            x = self.lm_head(self.norm(x))
        return x


def build_vlm(model: ModelConfig, *, max_seq_len: int, seed: int = 0, attention_backend: str = "auto"):
    """(vision encoder or None, whole backbone as one stage), deterministically initialised."""
    torch.manual_seed(seed)
    encoder = VisionEncoder(model.encoder) if model.encoder is not None else None
    backbone = BackboneStage(model, max_seq_len=max_seq_len, attention_backend=attention_backend)
    return encoder, backbone


def split_backbone(whole: BackboneStage, layer_ranges: list[tuple[int, int]]) -> list[BackboneStage]:
    """Copies of ``whole`` holding the given contiguous layer ranges (weights shared by value)."""
    n = len(whole.layers)
    if layer_ranges[0][0] != 0 or layer_ranges[-1][1] != n or any(a[1] != b[0] for a, b in zip(layer_ranges, layer_ranges[1:])):
        raise ValueError(f"layer ranges {layer_ranges} do not tile the backbone's {n} layers")
    stages = []
    for k, (lo, hi) in enumerate(layer_ranges):
        stage = copy.deepcopy(whole)
        stage.layers = nn.ModuleList(stage.layers[lo:hi])
        stage.first_layer = lo
        if k > 0:
            stage.tok_embeddings = None
            stage.projector = None
        if k < len(layer_ranges) - 1:
            stage.norm = None
            stage.lm_head = None
        stages.append(stage)
    return stages


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies; the caller divides by the global label-token count."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
