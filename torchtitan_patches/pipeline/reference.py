"""The non-pipelined reference: the whole model on one process, micro-batch after micro-batch.

Gradients of a pipelined plan must equal these, whatever the packing, order, micro-batch count or
encoder placement, because the loss is ``sum of token losses / global label-token count``.
"""

from __future__ import annotations

import torch

from torchtitan_patches.data.micro_batch import GlobalBatch
from torchtitan_patches.model.vlm import BackboneStage, VisionEncoder, token_loss_sum


def reference_step(encoder: VisionEncoder | None, whole: BackboneStage, batch: GlobalBatch) -> float:
    """Forward + backward of every micro-batch; returns the batch loss, leaves gradients in ``.grad``."""
    total = 0.0
    for mb in batch.micro_batches:
        feats = None
        if encoder is not None and mb.num_images:
            with torch.no_grad():
                feats = encoder(mb.pixel_values)
        logits = whole(mb.tokens[None], positions=mb.positions[None], cu_seqlens=mb.cu_seqlens,
                       image_features=feats, image_token_index=mb.image_token_index)
        loss = token_loss_sum(logits, mb.labels[None]) / batch.num_label_tokens
        loss.backward()
        total += float(loss.detach())
    return total


def whole_model_names(stage: BackboneStage) -> dict[str, str]:
    """Parameter names of a split stage -> the same parameters' names in the whole model."""
    out = {}
    for name, _ in stage.named_parameters():
        parts = name.split(".")
        if parts[0] == "layers":
            parts[1] = str(int(parts[1]) + stage.first_layer)
        out[name] = ".".join(parts)
    return out
