"""Model FLOPs of real tokens, vision encoder included, through TorchTitan's metrics processor.

TorchTitan 0.3.0 logs throughput as every position of a batch per second (padding included) and
MFU as ``num_flops_per_token`` times that, where ``num_flops_per_token`` is fixed at start from
the text model alone (its VLM FLOPs have a "TODO: add a per-batch vision encoder FLOP term"). On
packed VLM batches both are off: padding is counted as work, the encoder's FLOPs are not, and a
token's attention cost varies with its document's length.

``WorkMetricsProcessor`` keeps TorchTitan's processor (its loggers, TensorBoard / W&B, memory
and timing figures, the device's peak from ``get_peak_flops``) and, where a trainer hands it each
step's ``StepWork``, logs at each ``log`` call TorchTitan's own ``throughput(tps)``, ``tflops`` and
``mfu(%)`` over *real* tokens and *model* FLOPs (``pipetune.packing.flops``: backbone, head,
encoder and projector, forward and backward as trained, per document), plus ``padding(%)``.
Both ``PipeTuneTrainer`` and ``StockTrainer`` hand it their steps' work, so their figures compare.

Recomputation: MFU is PaLM's (model FLOPs only). Under TorchTitan's full activation checkpointing
(``activation_checkpoint`` ``FullAC``) each checkpointed block's forward runs again in the backward,
so ``hfu(%)`` (hardware FLOPs utilisation) is logged beside it: model FLOPs plus the blocks' forward
(``FlopsModel.block_forward_flops``: backbone layers, ViT layers when trained). Under selective
(per-op) or memory-budget checkpointing what is recomputed depends on TorchTitan's op policy or the
compiler, so no ``hfu(%)`` is logged (said once at start).

Limits: the peak is TorchTitan's table for the device; on a device it does not know (CPU) it
assumes an A100 unless ``metrics.peak_tflops`` is set, so CPU figures are for checking only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Iterable

import numpy as np
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.tools.logging import logger

from pipetune.packing.flops import FlopsModel
from torchtitan_patches.data.micro_batch import PackedMicroBatch


@dataclass(frozen=True)
class StepWork:
    """What a step trains: model FLOPs of its real documents, their tokens, padding tokens, and the
    forward FLOPs of their transformer blocks (what full activation checkpointing recomputes)."""

    model_flops: float = 0.0
    real_tokens: int = 0
    padding_tokens: int = 0
    block_forward_flops: float = 0.0

    @classmethod
    def of(cls, flops: FlopsModel, micro_batches: Iterable[PackedMicroBatch]) -> "StepWork":
        """The work of packed micro-batches: their first ``len(sample_ids)`` documents are real,
        a trailing padding document (sequence-parallel rounding) is not."""
        lengths, patches, padding = [], [], 0
        for mb in micro_batches:
            docs = np.diff(mb.cu_seqlens.numpy())
            real = len(mb.sample_ids)
            lengths.append(docs[:real])
            padding += int(docs[real:].sum())
            patches.extend(h * w for h, w in mb.image_grids)
        lengths = np.concatenate(lengths) if lengths else np.zeros(0)
        return cls(flops.training_flops(lengths, patches), int(lengths.sum()), padding, flops.block_forward_flops(lengths, patches))

    def as_list(self) -> list[float]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_list(cls, values) -> "StepWork":
        """The inverse of ``as_list`` (e.g. after an all-reduce of it); each field back to its default's type."""
        return cls(*(type(f.default)(v) for f, v in zip(fields(cls), values)))

    def __add__(self, other: "StepWork") -> "StepWork":
        return StepWork(*(a + b for a, b in zip(self.as_list(), other.as_list())))

    def scaled(self, factor: float) -> "StepWork":
        """A share of this work (e.g. one replica's average: ``1 / replicas``)."""
        return StepWork(*(v * factor for v in self.as_list()))

    @property
    def padding_share(self) -> float:
        total = self.real_tokens + self.padding_tokens
        return self.padding_tokens / total if total else 0.0


class WorkMetricsProcessor(MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        peak_tflops: float = 0.0
        """Peak dense bf16 TFLOPS of one device for MFU (0: TorchTitan's table for the device)."""

    @classmethod
    def upgrade(cls, config: MetricsProcessor.Config) -> "WorkMetricsProcessor.Config":
        """A job's metrics settings as this processor's (a plain TorchTitan config keeps its values)."""
        if isinstance(config, cls.Config):
            return config
        return cls.Config(**{f.name: getattr(config, f.name) for f in fields(config)})

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        if config.peak_tflops < 0:
            raise ValueError(f"metrics.peak_tflops is {config.peak_tflops}: give a device's peak TFLOPS, or 0 for TorchTitan's table")
        if config.peak_tflops:
            self.gpu_peak_flops = config.peak_tflops * 1e12
        self.work = StepWork()
        self.recomputes_blocks = False

    def count_recompute(self, activation_checkpoint) -> None:
        """Log ``hfu(%)`` where the job's activation checkpointing is TorchTitan's full one (module
        doc); say once why not under another policy."""
        self.recomputes_blocks = isinstance(activation_checkpoint, FullAC.Config)
        if activation_checkpoint is not None and not self.recomputes_blocks:
            logger.info(f"pipetune metrics: no hfu(%) under {type(activation_checkpoint).__qualname__.removesuffix('.Config')}: "
                        "what it recomputes depends on its op policy; mfu(%) counts model FLOPs")

    def add_work(self, work: StepWork) -> None:
        """A step's work per device's pipeline: with data parallelism, the step's total over replicas
        divided by their number (TorchTitan divides by the other dimensions itself)."""
        self.work = self.work + work

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float, extra_metrics: dict | None = None):
        work, self.work = self.work, StepWork()
        extra = dict(extra_metrics or {})
        if work.real_tokens:
            self.ntokens_since_last_log = work.real_tokens
            self.num_flops_per_token = work.model_flops / work.real_tokens
            extra["padding(%)"] = 100 * work.padding_share
            if self.recomputes_blocks and self.gpu_peak_flops > 0:
                seconds = time.perf_counter() - self.time_last_log  # as TorchTitan's log measures it
                per_device = (work.model_flops + work.block_forward_flops) / self.parallel_dims.non_data_parallel_size
                extra["hfu(%)"] = 100 * per_device / seconds / self.gpu_peak_flops
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)
