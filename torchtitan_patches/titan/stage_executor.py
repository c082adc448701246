"""A rank's ``PlanExecutor`` over the model parts TorchTitan built for it: its backbone chunks
(TorchTitan's parts of the layout's chunks on this rank, ascending: ``r, r + P, ...``, or ``r`` and
``2P - 1 - r`` when V-shaped) as the model's pipeline stages, its encoder chunks
(meta-initialised: each rank materialised only its own parts), and a frozen encoder's parameters
out of the optimizer's way."""

from __future__ import annotations

import torch.distributed as dist
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger

from pipetune.config.model import ModelConfig
from pipetune.cost import StageLayout
from torchtitan_patches.models.model_spec import stage_runtime
from torchtitan_patches.runtime.executor import ImageShapes, PlanExecutor
from torchtitan_patches.settings import PipeTuneSettings
from torchtitan_patches.titan.model_parts import local_encoder_chunks


def build_executor(trainer, pt: PipeTuneSettings.Config, model: ModelConfig, layout: StageLayout) -> PlanExecutor:
    """``trainer``'s (a ``PipeTuneTrainer`` whose parts, pipeline place and groups are set) executor
    on its pipeline (TorchTitan's ``pp`` mesh); logs every rank's parameter bytes on rank 0."""
    pp, stage = trainer.parallel_dims.pp, trainer.stage
    chunks_total = layout.num_stages
    own = [c for c, r in enumerate(layout.placement(encoder=False, encoder_trained=False).backbone) if r == stage]
    parts = dict(zip(own, trainer.model_parts))  # TorchTitan's order: ascending, in either style
    runtime = stage_runtime(trainer.config.model_spec)
    for part in parts.values():
        if pt.freeze_vision_encoder and getattr(part, "vision_encoder", None) is not None:
            part.vision_encoder.requires_grad_(False)  # AdamW skips parameters without gradients
            for name in runtime.trained_with_frozen_encoder:
                getattr(part.vision_encoder, name).requires_grad_(True)
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, sum(p.numel() * p.element_size() for part in parts.values() for p in part.parameters()), group=trainer.control)
    if trainer.rank == 0:
        logger.info("pipetune: parameter bytes per rank " + ", ".join(f"rank {r} {b / 2**20:.1f} MiB" for r, b in enumerate(sizes)))
    backbone = {c: runtime.stage(part, is_first=c == 0, is_last=c == chunks_total - 1) for c, part in parts.items()}
    enc = model.encoder
    if layout.is_separated:
        ranges = layout.encoder_chunks
        chunks = runtime.encoder_chunks(parts[stage], ranges, local_encoder_chunks(stage, pp, ranges), image_grid=pt.image_grid)
    else:
        chunks = runtime.encoder_chunks(parts[0], [(0, enc.n_layers)], [0], image_grid=pt.image_grid) if enc is not None and 0 in parts else {}
    return PlanExecutor(
        backbone, chunks, dim=model.backbone.dim, rank=stage, group=trainer.parallel_dims.get_mesh("pp").get_group(),
        control_group=trainer.control, replica=trainer.replica, sequence_shards=trainer.sequence_shards,
        image_shapes=ImageShapes.of(enc) if enc is not None else None, device=trainer.device, strict_order=pt.strict_order,
        count_host_syncs=pt.count_host_syncs, compute_dtype=TORCH_DTYPE_MAP[trainer.config.training.mixed_precision_param],
        loss_fn=lambda logits, labels, n: trainer.loss_fn(logits, labels, n)[0])  # a Python divisor: no upload per micro-batch
