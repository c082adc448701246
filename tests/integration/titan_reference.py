"""The unsplit TorchTitan model as the reference of pipelined runs (tests and their workers)."""

from __future__ import annotations

import torch

from torchtitan_patches.model.packed_attention import varlen_metadata
from torchtitan_patches.model.vlm import token_loss_sum
from torchtitan_patches.titan.stages import collated_images


def unsplit_step(model, batch) -> float:
    """Forward + backward of every micro-batch of ``batch`` through the unsplit model's own forward
    (vision encoder and adapter inside), loss ``sum / label tokens``; returns the batch loss and
    leaves the gradients in ``.grad``."""
    enc, total = model.vision_encoder, torch.zeros(())
    for mb in batch.micro_batches:
        kwargs = {}
        if mb.num_images:
            patches, grid = collated_images(mb)
            image_id = int(mb.tokens[mb.image_token_index[0]])  # the job's tokenizer's image id
            kwargs = {"pixel_values": patches, "grid_thw": grid, "special_tokens": {"image_id": image_id}}
        logits = model(mb.tokens[None], mb.positions[None], varlen_metadata(mb.cu_seqlens), **kwargs)
        loss = token_loss_sum(logits, mb.labels[None]) / batch.num_label_tokens
        loss.backward()
        total += loss.detach()
    return float(total)
