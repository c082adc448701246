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

Recomputation: MFU is PaLM's (model FLOPs only); ``hfu(%)`` (hardware FLOPs utilisation) is
logged beside it where the job's activation checkpointing recomputes a known share of the blocks'
forward (``FlopsModel.block_forward_parts``: backbone layers, ViT layers when trained, each split
into matmuls with weights, which scale with tokens, and attention, which scales with pairs):

* ``FullAC`` recomputes every checkpointed block's whole forward: hfu adds all four parts.
* ``SelectiveAC`` recomputes the ops its per-op policy does not save (TorchTitan's: every second
  matmul in call order, ops outside its save list, e.g. CPU SDPA's flash kernel). Rather than guess
  a share, ``RecomputeCount`` wraps the ``context_fn`` of its checkpoint wrappers for the first step
  (until its ``add_work``, or the first log): a counting dispatch mode (torch's ``flop_counter`` formulas) sits beneath SAC's
  caching mode in the forward and beneath its cached mode in the recompute, so ops served from
  SAC's cache never reach it and it counts exactly what each block invocation recomputes, beside
  what its forward ran. Then the wrappers get their own ``context_fn`` back (no cost afterwards);
  at the first log the counts are summed over ranks and each part's share fixed as recomputed / forward: constant for a per-op
  policy, since every op of a part scales alike. Every log then adds ``sum(share * part)`` of its
  steps' work.
* ``MemoryBudgetAC`` (the compiler's partitioner decides) and selective AC on compiled blocks
  (recompute runs inside the compiled graph, out of a dispatch mode's reach): no ``hfu(%)``, said
  once at start.

Limits of the count: ops without a FLOP formula count nothing (norms, activations, as in the
FLOPs model; but also grouped MoE matmuls and custom kernels other than CPU SDPA and varlen
attention); a matmul on weights through ``bmm`` counts as attention; the ViT is told apart by its
module path (``vision_encoder``); a hybrid backbone's full and linear attention layers share one
attention share; a part the counted steps never ran (e.g. no images for a trained ViT) leaves
``hfu(%)`` out of the logs whose steps run it, said once.

Limits: the peak is TorchTitan's table for the device; on a device it does not know (CPU) it
assumes an A100 unless ``metrics.peak_tflops`` is set, so CPU figures are for checking only.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import partial
from typing import Iterable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.attention.varlen  # noqa: F401  registers torch_attn::_varlen_attn, counted below
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_flop_count
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.tools.logging import logger

from pipetune.packing.flops import BLOCK_PARTS, FlopsModel
from torchtitan_patches.data.micro_batch import PackedMicroBatch


@dataclass(frozen=True)
class StepWork:
    """What a step trains: model FLOPs of its real documents, their tokens, padding tokens, and the
    forward FLOPs of their transformer blocks by part (``FlopsModel.block_forward_parts``: what
    activation checkpointing recomputes a share of)."""

    model_flops: float = 0.0
    real_tokens: int = 0
    padding_tokens: int = 0
    backbone_weights: float = 0.0
    backbone_attention: float = 0.0
    vision_weights: float = 0.0
    vision_attention: float = 0.0

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
        return cls(flops.training_flops(lengths, patches), int(lengths.sum()), padding, *flops.block_forward_parts(lengths, patches).tolist())

    @property
    def block_forward(self) -> np.ndarray:
        """The blocks' forward FLOPs, one per ``BLOCK_PARTS``."""
        return np.array([getattr(self, part) for part in BLOCK_PARTS])

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


WEIGHT_OPS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten._scaled_mm, torch.ops.aten.convolution}
"""Counted ops that multiply by weights (FLOPs scale with tokens); every other counted op (``bmm``,
``baddbmm``, attention kernels) multiplies activations together: attention's part."""


def _raw(formula):
    """Mark a formula as taking the op's tensors, as ``FlopCounterMode``'s ``custom_mapping`` reads it."""
    formula._get_raw = True
    return formula


@_raw
def _cpu_sdpa_flop(query, key, value, *args, out_val=None, **kwargs) -> int:
    """CPU SDPA's flash kernel, which torch's registry lacks: as its other SDPA kernels (dense)."""
    return sdpa_flop_count(query.shape, key.shape, value.shape)


@_raw
def _varlen_flop(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *args, out_val=None, **kwargs) -> int:
    """TorchTitan's varlen attention (torch's custom op around the varlen flash kernel): that kernel's formula."""
    flash = flop_registry[torch.ops.aten._flash_attention_forward]
    return flash(query, key, value, cu_seq_q, cu_seq_q if cu_seq_k is None else cu_seq_k, max_q, max_k)


EXTRA_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop, torch.ops.torch_attn._varlen_attn: _varlen_flop}
"""Attention kernels torch's ``flop_counter`` registry lacks (a ``FlopCounterMode`` ``custom_mapping``)."""

FORMULAS = {**flop_registry, **EXTRA_FORMULAS}
"""FLOP formulas by op: what ``FlopCounterMode(custom_mapping=EXTRA_FORMULAS)`` counts."""


class FlopTally(TorchDispatchMode):
    """Forward FLOPs of the ops that reach it, as ``[weights, attention]`` (``WEIGHT_OPS``), counted
    as ``FlopCounterMode`` counts them (``FORMULAS``)."""

    supports_higher_order_operators = True  # flex attention is one (counted); others run uncounted

    def __init__(self):
        super().__init__()
        self.flops = np.zeros(2)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = getattr(func, "_overloadpacket", func)  # a higher-order op is its own key
        formula = FORMULAS.get(packet)
        if formula is None and isinstance(func, torch._ops.OpOverload) and func is not torch.ops.prim.device.default:
            with self:  # as FlopCounterMode: an op without a formula may decompose into ops with one
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if formula is not None:
            self.flops[int(packet not in WEIGHT_OPS)] += formula(*args, **kwargs, out_val=out)
        return out


@contextmanager
def _beneath(tally: FlopTally, mode, then=lambda: None):
    """``mode`` (SAC's) above ``tally``: only the ops ``mode`` lets run reach the tally."""
    with tally, mode:
        yield
    then()


class RecomputeCount:
    """Forward and recomputed FLOPs of the selectively checkpointed blocks of ``model_parts``, per
    ``BLOCK_PARTS``, while installed (module doc); blocks whose forward is never recomputed (a
    frozen ViT) count in neither."""

    def __init__(self, model_parts):
        self.forward, self.recomputed = np.zeros(len(BLOCK_PARTS)), np.zeros(len(BLOCK_PARTS))
        self.compiled = False
        self.wrappers: list[tuple[CheckpointWrapper, partial]] = []
        for part in model_parts:
            for name, module in part.named_modules():
                if isinstance(module, CheckpointWrapper) and "context_fn" in module.checkpoint_fn.keywords:
                    self.compiled |= getattr(module, "_compiled_call_impl", None) is not None
                    own = module.checkpoint_fn
                    first = 2 * ("vision_encoder" in name.split("."))  # BLOCK_PARTS: backbone's two, then the ViT's
                    module.checkpoint_fn = partial(own.func, *own.args, **{**own.keywords, "context_fn": self._counting(own.keywords["context_fn"], first)})
                    self.wrappers.append((module, own))

    def _counting(self, context_fn, first: int):
        def counting_context_fn():
            caching, cached = context_fn()
            forward, recompute = FlopTally(), FlopTally()

            def add():  # counted once the invocation is recomputed
                self.forward[first:first + 2] += forward.flops
                self.recomputed[first:first + 2] += recompute.flops
            return _beneath(forward, caching), _beneath(recompute, cached, then=add)
        return counting_context_fn

    def stop(self) -> None:
        """Give the wrappers back their own ``context_fn`` (again: a no-op)."""
        for module, own in self.wrappers:
            module.checkpoint_fn = own

    def shares(self, group=None) -> np.ndarray:
        """Recomputed / forward FLOPs per part, summed over the ranks of ``group`` (NaN: a part
        no counted block ran)."""
        counts = torch.tensor(np.concatenate([self.forward, self.recomputed]))
        if dist.is_initialized():
            dist.all_reduce(counts, group=group)
        forward, recomputed = counts.numpy().reshape(2, -1)
        return np.divide(recomputed, forward, out=np.full_like(forward, np.nan), where=forward > 0)


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
        self.recompute_share: np.ndarray | None = None  # per BLOCK_PARTS; None: no hfu(%)
        self.counting: RecomputeCount | None = None
        self.group = None
        self.said_unknown = False

    def count_recompute(self, activation_checkpoint, model_parts=(), group=None) -> None:
        """Log ``hfu(%)`` under TorchTitan's full or selective activation checkpointing of
        ``model_parts`` (the selective one's shares counted on the first step and summed over
        ``group`` at the first log, which every rank reaches: module doc); say once why not under
        another policy."""
        self.recompute_share, self.counting, self.group = None, None, group
        if isinstance(activation_checkpoint, FullAC.Config):
            self.recompute_share = np.ones(len(BLOCK_PARTS))
        elif isinstance(activation_checkpoint, SelectiveAC.Config):
            self.counting = RecomputeCount(model_parts)
            if self.counting.compiled:
                self.counting.stop()
                self.counting = None
                logger.info("pipetune metrics: no hfu(%) under SelectiveAC on compiled blocks: the compiled graph recomputes "
                            "out of a dispatch mode's reach; mfu(%) counts model FLOPs")
        elif activation_checkpoint is not None:
            logger.info(f"pipetune metrics: no hfu(%) under {type(activation_checkpoint).__qualname__.removesuffix('.Config')}: "
                        "the compiler decides what it recomputes; mfu(%) counts model FLOPs")

    def add_work(self, work: StepWork) -> None:
        """A step's work per device's pipeline: with data parallelism, the step's total over replicas
        divided by their number (TorchTitan divides by the other dimensions itself). Ends the
        selective count: one step is enough (its shares are summed over ranks at the first log)."""
        if self.counting is not None:
            self.counting.stop()
        self.work = self.work + work

    def _recomputed(self, work: StepWork) -> float | None:
        """FLOPs recomputed in ``work``'s steps (None: not known); settles the selective count first."""
        if self.counting is not None:
            self.counting.stop()
            self.recompute_share, self.counting = self.counting.shares(self.group), None
            logger.info("pipetune metrics: selective AC recomputes, of the blocks' forward FLOPs, "
                        + ", ".join(f"{part} {100 * share:.1f} %" for part, share in zip(BLOCK_PARTS, self.recompute_share)))
        if self.recompute_share is None:
            return None
        ran = work.block_forward > 0
        unknown = ran & np.isnan(self.recompute_share)
        if unknown.any():
            if not self.said_unknown:
                logger.info(f"pipetune metrics: no hfu(%) for steps with {', '.join(np.array(BLOCK_PARTS)[unknown])}: "
                            "the counted step ran none")
                self.said_unknown = True
            return None
        return float(np.where(ran, self.recompute_share, 0.0) @ work.block_forward)

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float, extra_metrics: dict | None = None):
        work, self.work = self.work, StepWork()
        extra = dict(extra_metrics or {})
        recomputed = self._recomputed(work)
        if work.real_tokens:
            self.ntokens_since_last_log = work.real_tokens
            self.num_flops_per_token = work.model_flops / work.real_tokens
            extra["padding(%)"] = 100 * work.padding_share
            if recomputed is not None and self.gpu_peak_flops > 0:
                seconds = time.perf_counter() - self.time_last_log  # as TorchTitan's log measures it
                per_device = (work.model_flops + recomputed) / self.parallel_dims.non_data_parallel_size
                extra["hfu(%)"] = 100 * per_device / seconds / self.gpu_peak_flops
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)
