"""GPU memory per pipeline stage: model states plus in-flight activations, and the largest mbs that fits.

A trained ViT's activations are data-dependent (images per micro-batch) and are checked on every
candidate plan's simulated peak (``pipetune.plan.search.planner``), not in the worst case below.

Model states per rank (no ZeRO; tensor parallelism splits everything ``tp`` ways): every trained
parameter costs ``TRAINED_BYTES_PER_PARAM`` = 16 bytes (BF16 weight and gradient, FP32 master weight
and two Adam moments; with master weights, FP32 weight and gradient and two Adam moments); the
frozen ViT costs its weights only (FP32 with master weights). With master weights each forward
also keeps a compute-dtype copy of the weights it trains until its backward: activations per
micro-batch (``CostModel.weight_copy_bytes``). Each rank holds its backbone stage
and the encoder chunks the layout places on it (co-located: the whole encoder on rank 0; with
virtual stages, its ``V`` backbone chunks). Activations come from the latency table's bytes per
token and image. A micro-batch of size ``mbs`` holds at most ``mbs * max_seq_len`` tokens, all of
which may be image tokens; rank ``r`` keeps ``activation_caps(P, V)[r]`` micro-batches' chunk
activations in flight (1F1B: ``P - r``), and a zero-bubble table up to the largest of them on
every rank. ``reserve`` keeps a fraction of memory free for workspace and fragmentation.
"""

from __future__ import annotations

import numpy as np

from pipetune.cost.cost_model import CostModel, MicroBatchShapes
from pipetune.schedule.schedules import activation_caps

TRAINED_BYTES_PER_PARAM = 16


def model_state_bytes(cost: CostModel) -> np.ndarray:
    """Bytes of weights, gradients and optimizer state on each rank's GPU."""
    frozen_weight_bytes = 4 if cost.table.master_weights else 2
    placement = cost.placement()
    model, tp = cost.table.model, cost.table.tp
    b = model.backbone
    trained = cost.layers * b.layer_params
    trained[0] += b.vocab_size * b.dim
    trained[-1] += b.vocab_size * b.dim + b.dim
    enc = model.encoder
    if enc is not None:
        trained[0] += model.projector_params
        vit = cost.encoder_layers * enc.layer_params
        vit[0] += enc.patch_dim * enc.dim + enc.patches_per_image * enc.dim
    per_rank = np.bincount(placement.backbone, weights=trained * TRAINED_BYTES_PER_PARAM, minlength=placement.num_ranks)
    if enc is not None:
        np.add.at(per_rank, np.array(placement.encoder), vit * (frozen_weight_bytes if enc.frozen else TRAINED_BYTES_PER_PARAM))
    return per_rank / tp


def worst_case_activation_bytes(cost: CostModel, tokens: int, *, split_backward: bool = False) -> np.ndarray:
    """Activation bytes per stage of one micro-batch of ``tokens`` tokens, all of them image tokens,
    (with ``split_backward``, plus the output gradients held from ``I`` to ``W``), leaving out a
    trained ViT's activations: those depend on how many images the data puts in a
    micro-batch (a 8192-token micro-batch of 169-token images would hold 48 images, ~33 GB at
    DIP's sizes), so the planner checks them on every candidate plan's simulated peak instead."""
    tpi = cost.table.model.tokens_per_image
    images = tokens // tpi if tpi else 0
    shapes = MicroBatchShapes(np.array([tokens]), np.array([0]), np.array([tokens]), np.array([images]))
    return cost.activation_bytes(shapes)[0] + (cost.weight_grad_bytes(shapes)[0] if split_backward else 0.0)


def stage_peak_bytes(cost: CostModel, mbs: int, max_seq_len: int, *, split_backward: bool = False, in_flight: int | None = None) -> np.ndarray:
    """Worst-case peak bytes per rank under 1F1B (interleaved with virtual stages; zero-bubble
    with ``split_backward``) at micro-batch size ``mbs``: each rank's cap of in-flight
    micro-batches times its costliest chunk's activations; ``in_flight`` sets that count on every
    rank instead (with offload, 2: the activations being made and the ones reloaded for a gradient)."""
    p = cost.placement()
    caps = np.array(activation_caps(p.num_ranks, p.chunks_per_rank, p.style))
    in_flight = np.full_like(caps, in_flight) if in_flight else np.full_like(caps, caps.max()) if split_backward else caps
    chunk = worst_case_activation_bytes(cost, mbs * max_seq_len, split_backward=split_backward)
    worst = np.zeros(p.num_ranks)
    np.maximum.at(worst, np.array(p.backbone), chunk)
    return model_state_bytes(cost) + in_flight * worst


def max_micro_batch_size(cost: CostModel, max_seq_len: int, memory_bytes: float, *, reserve: float = 0.1, limit: int = 64,
                        split_backward: bool = False, in_flight: int | None = None) -> int:
    """Largest mbs whose worst case (``stage_peak_bytes``) fits ``memory_bytes * (1 - reserve)`` on every rank (0: none)."""
    budget = memory_bytes * (1 - reserve)
    best = 0
    for mbs in range(1, limit + 1):
        if (stage_peak_bytes(cost, mbs, max_seq_len, split_backward=split_backward, in_flight=in_flight) > budget).any():
            break
        best = mbs
    return best
