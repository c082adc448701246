"""Modality-aware partitioner (DIP Sec. 4): the separated layout of a job, chosen before training.

* Image sub-microbatch size ``B``: the smallest image count whose encoder throughput (images per
  second of forward, plus backward when the encoder is trained, on the latency table's ``encoder``
  curve) is at least ``threshold`` (95 %) of the best over the sizes a sub-microbatch can have,
  ``1 .. max_seq_len // tokens_per_image`` (the most images one sequence holds; DIP: 48). Smaller
  sizes under-use the GPU, larger ones balance worse (DIP Fig. 9).
* Encoder segments ``K = max(1, floor(T_enc / T_backbone))``: ``T_enc`` is the whole encoder's work
  (forward, plus backward when trained) on one sub-microbatch of ``B`` images, ``T_backbone`` the
  whole backbone's forward and backward on one micro-batch, the mean over the sampled batches'
  micro-batches (balanced packing at micro-batch size 1, as the planner packs them). So one
  sub-microbatch's pass through one encoder segment costs about what a micro-batch's pass through
  the backbone does. ``K`` is capped so every encoder chunk keeps at least one layer.
* Chunks: the encoder's layers cut into ``P * K`` chunks as evenly as possible (chunk ``k`` on
  rank ``k mod P``); the backbone keeps the split it is given (by default even: the encoder no
  longer sits on stage 0, so nothing is left to balance there but the embeddings and the head).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetune.config.model import ModelConfig
from pipetune.cost.cost_model import CostModel, MicroBatchShapes, lookup
from pipetune.cost.stage_layout import StageLayout

THRESHOLD = 0.95


@dataclass(frozen=True)
class Partition:
    """The separated layout and the figures it was chosen from."""

    layout: StageLayout
    encoder_s: float
    backbone_s: float

    @property
    def image_sub_batch(self) -> int:
        return self.layout.image_sub_batch

    @property
    def segments(self) -> int:
        """Encoder chunks per rank."""
        return len(self.layout.encoder_chunks) // self.layout.num_stages


def image_sub_batch_size(cost: CostModel, max_images: int, *, threshold: float = THRESHOLD) -> int:
    """``B``: the smallest size in ``1 .. max_images`` within ``threshold`` of the best encoder throughput."""
    if "encoder" not in cost.table.curves:
        raise ValueError(f"model {cost.table.model.name!r} has no vision encoder: the separated layout separates the encoder")
    sizes = np.arange(1, max(1, max_images) + 1)
    seconds = sum(lookup(cost.table.curves["encoder"], sizes, which)[0] for which in (("fwd", "bwd") if cost.encoder_trainable else ("fwd",)))
    throughput = sizes / seconds
    return int(sizes[np.argmax(throughput >= threshold * throughput.max())])


def partition(model: ModelConfig, cost: CostModel, sample: list[MicroBatchShapes], *, max_seq_len: int,
              backbone: StageLayout | None = None, threshold: float = THRESHOLD) -> Partition:
    """The separated layout for ``cost``'s table on these sampled micro-batches (module doc)."""
    if model.encoder is None:
        raise ValueError(f"--layout separated needs a model with a vision encoder; {model.name!r} has none")
    if not sample or not any(s.num_micro_batches for s in sample):
        raise ValueError("the partitioner needs at least one sampled micro-batch")
    B = image_sub_batch_size(cost, max_seq_len // model.tokens_per_image, threshold=threshold)
    backbone = backbone or StageLayout.even(model.backbone.n_layers, cost.num_stages)
    bb_cost = cost.with_layout(backbone)
    one = bb_cost.stage_costs(MicroBatchShapes(np.array([1]), np.array([0]), np.array([1]), np.array([B])))  # B images, whole encoder
    enc = float(one.encoder.sum() + one.encoder_bwd.sum())
    per_mb = np.concatenate([(c.fwd + c.bwd).sum(axis=1) for c in map(bb_cost.stage_costs, sample)])
    T_bb = float(per_mb.mean())
    K = int(min(max(1, np.floor(enc / T_bb)), model.encoder.n_layers // backbone.num_stages))
    if K < 1:
        raise ValueError(f"the encoder's {model.encoder.n_layers} layers cannot be spread over {backbone.num_stages} ranks")
    return Partition(backbone.separated(model.encoder.n_layers, K, B), float(enc), T_bb)
