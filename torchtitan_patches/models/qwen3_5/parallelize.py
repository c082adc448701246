"""TorchTitan's Qwen3.5 parallelisation without FSDP, which pipetune applies itself (package doc)."""

from __future__ import annotations

import dataclasses

from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.full_dtensor import validate_config
from torchtitan.models.qwen3_5 import parallelize_qwen3_5
from torchtitan.models.qwen3_5.vision_encoder import Qwen35VisionEncoder
from torchtitan.protocols.sharding import ShardingConfig


def merger_converts_output(encoder: Qwen35VisionEncoder) -> None:
    """Move the encoder's output conversion (TP ``I`` -> ``R``, whose backward sums the merged
    tokens' gradients over TP: under sequence parallelism each TP rank's decoder sends back only
    its own slice's) from the encoder to its merger: pipetune runs the merger on its own in stage
    0's forward (``Qwen35Stage``), never the encoder's ``forward``. Before ``parallelize``."""
    config = encoder._sharding_config
    if config is None or config.out_dst_shardings is None:
        return
    encoder.merger._sharding_config = ShardingConfig(out_src_shardings=config.out_src_shardings, out_dst_shardings=config.out_dst_shardings)
    encoder._sharding_config = dataclasses.replace(config, out_src_shardings=None, out_dst_shardings=None)


def parallelize_for_pipetune(model, *, parallel_dims, training, parallelism, compile_config, ac_config, dump_folder, skip_dp: bool = False):
    """TorchTitan's ``parallelize_qwen3_5``; with ``skip_dp`` (what ``PipeTuneTrainer`` asks for) its
    steps before FSDP, in its order: the model's sharding plan (its ViT's output conversion on the
    merger, ``merger_converts_output``), activation checkpointing, compile (TorchTitan's function
    has no way to skip FSDP, which it applies last)."""
    if not skip_dp:
        return parallelize_qwen3_5(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                                   compile_config=compile_config, ac_config=ac_config, dump_folder=dump_folder)
    if parallel_dims.cp_enabled:
        raise NotImplementedError("context parallelism is not supported for Qwen3.5 (TorchTitan refuses it too)")
    if model.vision_encoder is not None:
        merger_converts_output(model.vision_encoder)
    if parallelism.spmd_backend == "spmd_types":
        validate_config(parallel_dims, model)
        model.parallelize(parallel_dims)
    elif parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        model.parallelize(parallel_dims)
    if ac_config is not None:
        policy = ac_config.build(dump_folder=dump_folder)
        policy.apply(model)
        if model.vision_encoder is not None:
            policy.apply(model.vision_encoder)
    if compile_config.enable and "model" in compile_config.components:
        for m in (model, model.vision_encoder):
            if m is not None:
                apply_compile(m, compile_config=compile_config, parallel_dims=parallel_dims)
    return model
