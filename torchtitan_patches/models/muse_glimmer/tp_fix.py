"""Muse Glimmer's multimodal tensor-parallel plan without sequence parallelism, made consistent.

TorchTitan 0.3.0 types the multimodal embedding output ``Replicate`` over TP (the vision scatter
needs the whole sequence, ``sharding._set_multimodal_sharding``) and, under sequence parallelism,
gives the first decoder block a ``Replicate -> Shard(1)`` input redistribution. Without sequence
parallelism it gives that block none, so the ``Replicate`` stream enters blocks that take an
``Invariant`` input. Forward values are the same, but the backward disagrees: the blocks return
an ``Invariant`` gradient (each TP rank holds the whole), which the embedding's and the vision
projection's ``Replicate`` conversions then sum over TP once more. Measured on TP 2 x PP 2 against
the unsplit model: the token-embedding and vision-adapter gradients came out exactly doubled.

``convert_first_block_input`` gives the first block the missing ``Replicate -> Invariant``
conversion (free in forward; its backward turns the gradient into the partial sum the upstream
conversions expect), as the sequence-parallel plan does with its own redistribution.
"""

from __future__ import annotations

import spmd_types as spmd
from torch import nn
from torchtitan.models.common.decoder_sharding import dense_activation_placement
from torchtitan.protocols.sharding import ShardingConfig


def convert_first_block_input(model: nn.Module, *, enable_sp: bool) -> None:
    """Before ``model.parallelize``: on the part that holds the embedding and the vision stack,
    without sequence parallelism, the first decoder block converts its ``Replicate`` input to
    ``Invariant``."""
    layers = getattr(model, "layers", None)
    if enable_sp or getattr(model, "tok_embeddings", None) is None or getattr(model, "vision_projection", None) is None:
        return
    if layers is None or "0" not in layers or layers["0"]._sharding_config is not None:
        return
    invariant = dense_activation_placement(tp=spmd.I)
    layers["0"]._sharding_config = ShardingConfig(in_src_shardings={"x": dense_activation_placement(tp=spmd.R)},
                                                  in_dst_shardings={"x": invariant}, out_src_shardings=invariant)
