"""The unsplit TorchTitan model as the reference of pipelined runs (tests and their workers)."""

from __future__ import annotations

import pytest
import torch

from torchtitan_patches.data.micro_batch import IMAGE_TOKEN_ID
from torchtitan_patches.models.packed_attention import varlen_metadata
from torchtitan_patches.models.reference.vlm import token_loss_sum
from torchtitan_patches.models.qwen3_5.stages import block_order, mrope_positions
from torchtitan_patches.models.image_batches import collated_images


def unsplit_step(model, batch) -> float:
    """Forward + backward of every micro-batch of ``batch`` through the unsplit model's own forward
    (vision encoder and adapter inside), loss ``sum / label tokens``; returns the batch loss and
    leaves the gradients in ``.grad``."""
    total = torch.zeros(())
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


def qwen3_5_unsplit_model(weights: dict | None, *, trained: bool, dtype: torch.dtype = torch.float32):
    """The ``qwen3_5_debug`` job's model, unsplit, with ``weights`` (else TorchTitan's init) in
    ``dtype``; its ViT trained or frozen (the merger trains either way, as under pipetune)."""
    from pipetune_configs import config_registry

    with torch.device("meta"):
        model = config_registry.qwen3_5_debug().model_spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    if weights is not None:
        model.load_state_dict(weights, strict=True)
    model.to(dtype)
    model.vision_encoder.requires_grad_(trained)
    model.vision_encoder.merger.requires_grad_(True)
    return model


def qwen3_5_unsplit_step(model, batch) -> float:
    """``unsplit_step`` for TorchTitan's Qwen3.5 (ViT and merger inside its forward), with the MRoPE
    positions of ``models.qwen3_5.stages`` (proven equal to TorchTitan's collator's in the unit tests) and
    the pixels in the model's dtype. Run it with TorchTitan's ``_spmd_backend`` at
    ``partial_dtensor`` (no device mesh in the test's process)."""
    merge, dtype, total = model.spatial_merge_size, model.tok_embeddings.weight.dtype, torch.zeros(())
    for mb in batch.micro_batches:
        images = [(span.start, (span.grid[0] // merge, span.grid[1] // merge)) for span in mb.image_spans]
        mrope = torch.from_numpy(mrope_positions(mb.cu_seqlens.tolist(), images))[None]
        kwargs = {}
        if mb.num_images:
            patches, grid_thw = collated_images(mb)  # the loader's raster order; Qwen's merger wants block order
            blocks = torch.stack([torch.nn.functional.pad(block_order(p[:h * w], (h, w), merge)[0], (0, 0, 0, len(p) - h * w))
                                  for p, (_, h, w) in zip(patches, grid_thw.tolist())])
            kwargs = {"pixel_values": blocks.to(dtype), "grid_thw": grid_thw}
        masks = varlen_metadata(mb.cu_seqlens)
        logits = model(mb.tokens[None], attention_masks={"quadratic_attention": masks, "deltanet": masks}, positions=mb.positions[None],
                       mrope_positions=mrope, special_tokens={"image_id": IMAGE_TOKEN_ID, "video_id": -1}, **kwargs)
        loss = token_loss_sum(logits, mb.labels[None]) / batch.num_label_tokens
        loss.backward()
        total += loss.detach()
    return float(total)


def join_tensor_parallel(pieces: list[torch.Tensor], shape: torch.Size, what: str) -> torch.Tensor:
    """A whole tensor of ``shape`` from its tensor-parallel ranks' ``pieces`` (in TP rank order):
    shards joined along the one dim they split, or, held whole on every rank, the same on each."""
    if pieces[0].shape == shape:
        for k, p in enumerate(pieces[1:], 1):
            err = float((p - pieces[0]).norm() / max(float(pieces[0].norm()), 1e-30))
            assert err < 1e-5, f"{what}: tensor-parallel rank {k} holds another copy (relative difference {err:.2e})"
        return pieces[0]
    dims = [d for d, (a, b) in enumerate(zip(pieces[0].shape, shape)) if a != b]
    assert len(dims) == 1, f"{what}: shard {tuple(pieces[0].shape)} of {tuple(shape)}"
    return torch.cat(pieces, dim=dims[0])


def check_unsplit_step(at: list[dict], batches, loss: float, shapes: dict, reference, *, step: int, replicas: int, floor: float) -> dict:
    """One step of a scale-out job (``at``: every rank's record of it; ``batches``: each replica's;
    ``loss``: summed over replicas) against the unsplit model (``reference(weights, batches, dtype)``
    gives its loss and gradients from the weights the ranks held): the same loss, every gradient
    (joined over TP, after FSDP's reduction) within 4x the float32 reference's own rounding error of
    the float64 one (at least ``floor`` relative; a missing or doubled reduction is off by 30-100 %),
    none of them zero, and every rank clipped by the float64 norm. The float64 gradients."""

    def joined(kind: str, replica: int) -> dict:
        mine = sorted((a for a in at if a["replica"] == replica), key=lambda a: a["tp_rank"])
        names = {n for a in mine for n in a[kind]}
        return {n: join_tensor_parallel([a[kind][n] for a in mine if n in a[kind]], shapes[n], f"step {step}: {kind} {n}") for n in names}

    weights = joined("weights", 0)
    expected, rounded = reference(weights, batches, torch.float32)
    _, exact = reference(weights, batches, torch.float64)
    assert not [k for k, g in exact.items() if not g.abs().max() > 0], "a gradient is zero: the comparison would prove nothing"
    assert loss == pytest.approx(expected, rel=1e-5)
    for replica in range(replicas):
        grads = joined("grads", replica)
        assert set(grads) == set(exact)
        for name, g in grads.items():
            scale = exact[name].norm()
            err, bound = float((g.double() - exact[name]).norm() / scale), max(4 * float((rounded[name].double() - exact[name]).norm() / scale), floor)
            assert err < bound, f"step {step}, replica {replica}: {name}: relative gradient error {err:.2e} (bound {bound:.2e})"
    norm = float(torch.stack([g.norm() for g in exact.values()]).norm())
    for a in at:
        assert a["grad_norm"] == pytest.approx(norm, rel=1e-4), f"step {step}: a rank clipped by another norm"
    return exact
