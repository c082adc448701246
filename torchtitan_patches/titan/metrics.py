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

Limits: MFU in TorchTitan's sense (PaLM's): recomputation is not counted, so a job with activation
checkpointing does up to one more forward of each checkpointed layer than it logs (no hardware
FLOPs utilisation is logged). The peak is TorchTitan's table for the device; on a device it does not know (CPU) it
assumes an A100 unless ``metrics.peak_tflops`` is set, so CPU figures are for checking only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable

import numpy as np
from torchtitan.components.metrics import MetricsProcessor

from pipetune.packing.flops import FlopsModel
from torchtitan_patches.data.micro_batch import PackedMicroBatch


@dataclass(frozen=True)
class StepWork:
    """What a step trains: model FLOPs of its real documents, their tokens, and padding tokens."""

    model_flops: float = 0.0
    real_tokens: int = 0
    padding_tokens: int = 0

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
        return cls(flops.training_flops(lengths, patches), int(lengths.sum()), padding)

    def __add__(self, other: "StepWork") -> "StepWork":
        return StepWork(self.model_flops + other.model_flops, self.real_tokens + other.real_tokens,
                        self.padding_tokens + other.padding_tokens)

    def scaled(self, factor: float) -> "StepWork":
        """A share of this work (e.g. one replica's average: ``1 / replicas``)."""
        return StepWork(self.model_flops * factor, self.real_tokens * factor, self.padding_tokens * factor)

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
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)
