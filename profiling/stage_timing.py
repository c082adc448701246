"""Measure real stage latencies of packed micro-batches (for checking and calibrating a table).

A stage here is what the pipeline runtime executes: on stage 0 the embedding, the projector and
the scatter of image features plus its layers; on the last stage its layers plus norm, head and
loss; the vision encoder is timed on its own (it is a separate action on stage 0).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from pipetune.config.model import ModelConfig
from pipetune.calibrate.action_fit import Observation, Observed, Part
from pipetune.cost.cost_model import MicroBatchShapes
from pipetune.cost.stage_layout import StageLayout
from pipetune.packing.config import PackingConfig
from torchtitan_patches.compat.cpu_allocator import retain_freed_memory
from torchtitan_patches.data.loader import DataLoaderConfig
from torchtitan_patches.data.micro_batch import PackedMicroBatch
from torchtitan_patches.models.packed_attention import varlen_metadata
from torchtitan_patches.models.reference.vlm import build_stages, token_loss_sum
from torchtitan_patches.runtime.timing import Clock, fwd_bwd_sample


class StageTimer:
    """Times stages and the encoder on real packed micro-batches, one sample per call, as the
    runtime runs them: stages built by ``build_stages`` on ``device`` (default: CUDA when there is
    one), the runtime's attention backend and compute dtype, and its clock
    (``torchtitan_patches.runtime.timing``: CUDA events on a GPU)."""

    def __init__(self, model: ModelConfig, layout: StageLayout, *, max_seq_len: int, seed: int = 0,
                 device: torch.device | str | None = None, attention_backend: str = "auto",
                 compute_dtype: torch.dtype = torch.float32):
        self.device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cpu":
            retain_freed_memory()
        self.encoder, stages = build_stages(model, list(layout.layer_ranges), list(range(layout.num_stages)),
                                            max_seq_len=max_seq_len, seed=seed, device=self.device, attention_backend=attention_backend)
        self.stages = [stages[s] for s in range(layout.num_stages)]
        self.dim = model.backbone.dim
        self.compute_dtype = compute_dtype
        self.clock = Clock(self.device)

    def _autocast(self):
        return nullcontext() if self.compute_dtype == torch.float32 else torch.autocast(self.device.type, dtype=self.compute_dtype)

    def encoder_seconds(self, mb: PackedMicroBatch) -> float:
        if self.encoder is None or mb.num_images == 0:
            return 0.0
        pixels = mb.pixel_values.to(self.device)
        with self._autocast():
            return fwd_bwd_sample(self.clock, lambda: (pixels,), lambda p: self.encoder(p, mb.image_grids), backward=False,
                                   key="encoder")[0]

    def stage_seconds(self, mb: PackedMicroBatch, stage: int) -> tuple[float, float]:
        """(forward, backward) seconds of ``mb`` on ``stage``."""
        mod = self.stages[stage]
        masks, spans = varlen_metadata(mb.cu_seqlens, self.device), mb.image_spans
        mb = mb.to(self.device)
        kwargs = {"positions": mb.positions[None], "masks": masks}
        if mod.is_first:
            with torch.no_grad(), self._autocast():
                feats = self.encoder(mb.pixel_values, mb.image_grids) if self.encoder is not None and mb.num_images else None
            kwargs.update(image_features=feats, image_spans=spans)

            def make():
                return (mb.tokens[None],)
        else:

            def make():
                return (torch.randn(1, mb.num_tokens, self.dim, device=self.device, dtype=self.compute_dtype, requires_grad=True),)

        def run(x):
            with self._autocast():
                y = mod(x, **kwargs)
            return token_loss_sum(y, mb.labels[None]) if mod.is_last else y

        return fwd_bwd_sample(self.clock, make, run, backward=True, key=stage)


def sample_micro_batches(
    model: ModelConfig, data: str | Path, n: int, *, max_seq_len: int, max_mbs: int = 4, seed: int = 0
) -> list[tuple[MicroBatchShapes, PackedMicroBatch]]:
    """``n`` random micro-batches of ``data``: balanced packings of random batches at a random
    mbs in ``1..max_mbs``, each as (metadata shapes, tensors)."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        packing = PackingConfig(mbs=int(rng.integers(1, max_mbs + 1)), max_seq_len=max_seq_len)
        cfg = DataLoaderConfig(data=data, gbs=int(rng.integers(4, 24)), max_seq_len=max_seq_len,
                               seed=int(rng.integers(2**31)), packing=packing, max_steps=1)
        loader = cfg.build(model)
        meta = loader.meta(0)
        (batch,) = list(loader)
        shapes = MicroBatchShapes.from_packing(meta.table, packing.build(model)(meta.table.lengths, 0))
        k = int(rng.integers(len(batch.micro_batches)))
        out.append((shapes.take(np.array([k])), batch.micro_batches[k]))
    return out


def observe(timer: StageTimer, samples, *, passes: int = 5, warmup: int = 1) -> list[Observation]:
    """Measured stage (forward + backward) and encoder times of each sample, as calibration input:
    medians over ``passes`` timed passes through all samples (after ``warmup`` untimed ones), so a
    slow spell of the machine hits one sample of many micro-batches rather than all samples of a
    few of them."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    runs = []
    for k in range(warmup + passes):
        times = []
        for _, mb in samples:
            times += [sum(timer.stage_seconds(mb, s)) for s in range(len(timer.stages))]
            times.append(timer.encoder_seconds(mb))
        if k >= warmup:
            runs.append(times)
    med = iter(np.median(np.asarray(runs), axis=0))
    obs = []
    for shapes, mb in samples:
        obs += [Observation(shapes, float(next(med)), stage=s) for s in range(len(timer.stages))]
        enc = float(next(med))
        if mb.num_images and timer.encoder is not None:
            obs.append(Observation(shapes, enc, kind=Observed.ENCODER, part=Part.FWD))
    return obs
