"""FLOPs of packed micro-batches: what balance packing balances and the analytical cost model uses.

Conventions (algorithmic FLOPs, 2 per multiply-add; norms, softmax and activations ignored, as
``torch.utils.flop_counter`` does):

* Backbone layer, forward: ``2 * T * layer_params`` for the matmuls over the ``T`` packed tokens,
  plus, in a full-attention layer, attention ``4 * dim * pairs``, where ``pairs`` is the number of
  (query, key) pairs that varlen attention computes: ``sum(l * (l + 1) / 2)`` over documents when
  causal (FlashAttention skips the masked half), ``sum(l ** 2)`` when not.
* A linear-attention layer (``BackboneConfig.linear_attention``) has no pairs: its chunked gated
  delta rule does, per value head, ``3 C K + 2 C V + 3 K V`` multiply-adds per token of the
  chunk-padded length (``C``: chunk, ``K`` / ``V``: key / value head dims; the within-chunk
  products ``k k^T``, ``q k^T``, the WY transforms of ``k`` and ``v`` and the output's ``C x C``
  product, and the state's read, write and output over ``K x V``). Its triangular solve, causal
  convolutions and gates are left out like the norms; its projections count as a full-attention
  layer's (``layer_params``).
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
BLOCK_PARTS = ("backbone_weights", "backbone_attention", "vision_weights", "vision_attention")
"""The parts of ``FlopsModel.block_forward_parts``, in its order."""


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

    @property
    def linear_attention_per_token(self) -> float:
        """Forward FLOPs per chunk-padded token of one linear-attention layer's recurrence (module doc)."""
        la = self.model.backbone.linear_attention
        if la is None:
            return 0.0
        c, k, v = la.chunk, la.key_head_dim, la.value_head_dim
        return 2.0 * la.n_value_heads * (3 * c * k + 2 * c * v + 3 * k * v)

    def layer_forward(self, lengths) -> np.ndarray:
        """Forward FLOPs of one full-attention decoder layer for each document length."""
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.linear_per_token * lengths + self.attention_per_pair * attention_pairs(lengths, self.causal)

    def linear_layer_forward(self, lengths) -> np.ndarray:
        """Forward FLOPs of one linear-attention decoder layer for each document length."""
        lengths = np.asarray(lengths, dtype=np.float64)
        la = self.model.backbone.linear_attention
        return self.linear_per_token * lengths + self.linear_attention_per_token * la.chunked(lengths)

    def sequence_flops(self, lengths, *, with_head: bool = True) -> np.ndarray:
        """Forward + backward FLOPs of the whole backbone for each document: the packing weight
        (attention pairs in the full-attention layers only)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        b = self.model.backbone
        fwd = b.n_full_layers * self.layer_forward(lengths)
        if b.linear_layers:
            fwd = fwd + len(b.linear_layers) * self.linear_layer_forward(lengths)
        if with_head:
            fwd = fwd + self.head_per_token * lengths
        return (1.0 + BACKWARD_FACTOR) * fwd

    def vit_forward(self, patches) -> np.ndarray:
        """ViT forward FLOPs of each image of ``patches`` patches (attention within the image)."""
        enc = self.model.encoder
        p = np.asarray(patches, dtype=np.float64)
        if enc is None:
            return np.zeros_like(p)
        return 2.0 * p * enc.patch_dim * enc.dim + self.vit_layers_forward(p)

    def vit_layers_forward(self, patches) -> np.ndarray:
        """Forward FLOPs of the ViT's layers alone (no patch embedding) for each image of ``patches`` patches."""
        enc, p = self.model.encoder, np.asarray(patches, dtype=np.float64)
        return enc.n_layers * (2.0 * p * enc.layer_params + 4.0 * enc.dim * p * p)

    def vit_forward_per_image(self) -> float:
        enc = self.model.encoder
        return 0.0 if enc is None else float(self.vit_forward(enc.patches_per_image))

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

    def training_flops(self, lengths, image_patches=()) -> float:
        """Model FLOPs of one training pass over documents of ``lengths`` tokens (their image
        tokens included) whose images have ``image_patches`` patches each: backbone and head
        forward + backward, the ViT's forward (+ backward when trained), the projector's forward +
        backward (it is always trained). MFU's numerator: pass real documents only, since what
        padding costs is not model FLOPs; recomputation is not counted (PaLM's MFU: see
        ``block_forward_parts`` for what activation checkpointing adds)."""
        total = float(self.sequence_flops(lengths).sum())
        enc, patches = self.model.encoder, np.asarray(image_patches, dtype=np.float64)
        if enc is None or not patches.size:
            return total
        vit = (1.0 + (0.0 if enc.frozen else BACKWARD_FACTOR)) * self.vit_forward(patches).sum()
        projector = (1.0 + BACKWARD_FACTOR) * 2.0 * self.model.projector_params * (patches / enc.merge**2).sum()
        return total + float(vit + projector)

    def block_forward_parts(self, lengths, image_patches=()) -> np.ndarray:
        """Forward FLOPs of the transformer blocks over documents of ``lengths`` tokens and images of
        ``image_patches`` patches, by what each part scales with (``BLOCK_PARTS``): the backbone
        layers' matmuls with weights (tokens), their attention (pairs; a linear-attention layer's
        recurrence, chunk-padded tokens), then the same two of the ViT layers when the ViT is
        trained (a frozen ViT runs without autograd, so nothing of it is recomputed). Not the
        head, embeddings, patch embedding or projector. Full activation checkpointing recomputes
        all of it in the backward (hardware FLOPs = ``training_flops`` + the sum); selective
        checkpointing recomputes a share of each part that its per-op policy fixes, which the
        split lets ``torchtitan_patches.titan.metrics`` measure once and apply to every step."""
        lengths = np.asarray(lengths, dtype=np.float64)
        b = self.model.backbone
        weights = b.n_layers * self.linear_per_token * lengths.sum()
        attention = b.n_full_layers * self.attention_per_pair * attention_pairs(lengths, self.causal).sum()
        if b.linear_layers:
            attention += len(b.linear_layers) * self.linear_attention_per_token * b.linear_attention.chunked(lengths).sum()
        enc, p = self.model.encoder, np.asarray(image_patches, dtype=np.float64)
        if enc is None or enc.frozen or not p.size:
            return np.array([weights, attention, 0.0, 0.0])
        return np.array([weights, attention, enc.n_layers * 2.0 * enc.layer_params * p.sum(), enc.n_layers * 4.0 * enc.dim * (p * p).sum()])
