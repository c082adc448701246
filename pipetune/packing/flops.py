"""FLOPs of packed micro-batches: what balance packing balances and the analytical cost model uses.

Conventions (algorithmic FLOPs, 2 per multiply-add; norms, softmax and activations ignored, as
``torch.utils.flop_counter`` does):

* Backbone layer, forward: ``2 * T * layer_params`` for the matmuls over the ``T`` packed tokens,
  plus attention ``4 * dim * pairs``, where ``pairs`` is the number of (query, key) pairs that
  varlen attention computes: ``sum(l * (l + 1) / 2)`` over documents when causal (FlashAttention
  skips the masked half), ``sum(l ** 2)`` when not.
* Backward = 2 x forward (gradients of inputs and of weights).
* Output head (last stage): ``2 * T * dim * vocab`` forward; embedding lookups cost no FLOPs.
* Vision encoder, per image of ``P`` patches: patch embedding, ``n_layers`` ViT layers with full
  attention over the ``P`` patches; forward only when frozen. Projector (trained) per image of
  ``K = P / merge**2`` merged tokens: ``2 * K * projector_params`` forward (``enc_dim * merge**2 *
  dim + dim * dim`` for the default two-layer MLP).

Because every term is a sum over documents, the FLOPs of a micro-batch are the sum of its
documents' FLOPs: ``sequence_flops`` gives that per-document weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetune.config.model import ModelConfig

BACKWARD_FACTOR = 2.0


def attention_pairs(lengths: np.ndarray, causal: bool = True) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.float64)
    return lengths * (lengths + 1) / 2 if causal else lengths * lengths


@dataclass(frozen=True)
class FlopsModel:
    """Per-token and per-pair coefficients of a model; all methods are vectorised over arrays."""

    model: ModelConfig
    causal: bool = True

    @property
    def linear_per_token(self) -> float:
        """Forward FLOPs per token of one decoder layer's matmuls."""
        return 2.0 * self.model.backbone.layer_params

    @property
    def attention_per_pair(self) -> float:
        """Forward FLOPs per (query, key) pair of one decoder layer (QK^T and PV, all heads)."""
        return 4.0 * self.model.backbone.dim

    @property
    def head_per_token(self) -> float:
        b = self.model.backbone
        return 2.0 * b.dim * b.vocab_size

    def layer_forward(self, lengths) -> np.ndarray:
        """Forward FLOPs of one decoder layer for each document length."""
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.linear_per_token * lengths + self.attention_per_pair * attention_pairs(lengths, self.causal)

    def sequence_flops(self, lengths, *, with_head: bool = True) -> np.ndarray:
        """Forward + backward FLOPs of the whole backbone for each document: the packing weight."""
        lengths = np.asarray(lengths, dtype=np.float64)
        fwd = self.model.backbone.n_layers * self.layer_forward(lengths)
        if with_head:
            fwd = fwd + self.head_per_token * lengths
        return (1.0 + BACKWARD_FACTOR) * fwd

    def vit_forward_per_image(self) -> float:
        enc = self.model.encoder
        if enc is None:
            return 0.0
        p = enc.patches_per_image
        patch_embed = 2.0 * p * enc.patch_dim * enc.dim
        layers = enc.n_layers * (2.0 * p * enc.layer_params + 4.0 * enc.dim * p * p)
        return patch_embed + layers

    def projector_forward_per_image(self) -> float:
        enc = self.model.encoder
        if enc is None:
            return 0.0
        return 2.0 * enc.tokens_per_image * self.model.projector_params

    def encoder_flops(self, num_images, *, backward: bool | None = None) -> np.ndarray:
        """ViT FLOPs for ``num_images`` images (forward, plus backward if the ViT is trained)."""
        enc = self.model.encoder
        trained = enc is not None and not enc.frozen if backward is None else backward
        factor = 1.0 + (BACKWARD_FACTOR if trained else 0.0)
        return factor * self.vit_forward_per_image() * np.asarray(num_images, dtype=np.float64)

