"""The non-pipelined reference: the whole model on one process, micro-batch after micro-batch.

Gradients of a pipelined plan must equal these, whatever the packing, order, micro-batch count or
encoder placement, because the loss is ``sum of token losses / global label-token count``.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from torchtitan_patches.data.micro_batch import GlobalBatch
from torchtitan_patches.models.packed_attention import varlen_metadata
from torchtitan_patches.models.reference.vlm import BackboneStage, VisionEncoder, token_loss_sum


def reference_step(encoder: VisionEncoder | None, whole: BackboneStage, batch: GlobalBatch,
                   compute_dtype: torch.dtype = torch.float32) -> float:
    """Forward + backward of every micro-batch (under autocast to ``compute_dtype`` unless fp32, as
    the executor runs; through the encoder too when it is trained); returns the batch loss, leaves
    gradients in ``.grad``."""
    device = next(whole.parameters()).device
    cast = nullcontext() if compute_dtype == torch.float32 else torch.autocast(device.type, dtype=compute_dtype)
    total = torch.zeros((), device=device)
    for host in batch.micro_batches:
        mb = host.to(device)  # image spans and attention metadata come from the host copy: no device-to-host reads
        feats = None
        with cast:
            if encoder is not None and mb.num_images:
                with torch.set_grad_enabled(any(p.requires_grad for p in encoder.parameters())):
                    feats = encoder(mb.pixel_values, mb.image_grids)
            logits = whole(mb.tokens[None], positions=mb.positions[None], masks=varlen_metadata(host.cu_seqlens, device),
                           image_features=feats, image_spans=host.image_spans)
        loss = token_loss_sum(logits, mb.labels[None]) / batch.num_label_tokens
        loss.backward()
        total += loss.detach()
    return float(total)


def whole_model_names(stage: BackboneStage | VisionEncoder) -> dict[str, str]:
    """Parameter names of a split stage (or encoder chunk) -> the same parameters' names in the
    whole backbone (or whole encoder)."""
    out = {}
    for name, _ in stage.named_parameters():
        parts = name.split(".")
        if parts[0] == "layers":
            parts[1] = str(int(parts[1]) + stage.first_layer)
        out[name] = ".".join(parts)
    return out
