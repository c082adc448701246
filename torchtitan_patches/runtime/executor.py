"""Run one iteration's ``IterationPlan`` on this rank's model chunks (gloo on CPU, NCCL on GPU).

Unlike torch's ``PipelineSchedule*`` and ``PipelineStage`` (one chunk kind, shapes inferred once
from micro-batch 0, losses stored in execution order), every micro-batch here may have its own
length, the order is arbitrary, and a rank may hold chunks of two modules whose units differ:

* chunks: backbone stages (micro-batches as units) and vision-encoder chunks (image
  sub-microbatches as units), as the plan's ``Placement`` puts them. PipeTune's co-located layout
  is one encoder chunk (the whole encoder) beside stage 0, its sub-microbatch ``j`` all of
  micro-batch ``j``'s images; DIP's separated layout cuts the encoder into ``P * K`` chunks (layer
  ranges) over all ranks and each micro-batch's images into sub-microbatches of ``B`` images
  (``plan.image_sub_batch``). ``PipelineStage`` has one input and one output shape per stage and
  one unit kind; here backbone chunk 0's forward takes several messages (the image features of
  every sub-microbatch of its micro-batch) besides its tokens, and its backward sends several;
* every rank holds the whole ``GlobalBatch`` (each PP rank runs the same dataloader, as in
  TorchTitan), so the shape of every message is known and no shape inference runs, ever: backbone
  activations ``(1, tokens of the micro-batch / sequence_shards, dim)``; encoder activations, the
  images' patch rows flat, ``(B * patches, encoder width)`` (``ImageShapes``: per image, e.g.
  patches x encoder width); image features ``(tokens of the sub-microbatch's images, merged
  width)``; gradients as their activations. Encoder chunks take and give images flat with their
  grids (host tuples): images at their own resolution in the co-located layout; the separated
  layout's messages have one shape per image, so its images must all be the standard one;
* fixed-shape encoder units: the last sub-microbatch of a micro-batch (fewer than ``B`` images)
  is padded with zero images (``pad_images``) so every encoder chunk runs one shape; images are
  independent in the encoder (attention within an image), and the last chunk drops the padding
  rows before its features leave, so padding changes no loss and no gradient (the padding rows'
  gradients are exactly zero);
* messages follow ``pipetune.schedule.lowering``: between every pair of ranks both sides post
  them in the same order, so a transport that ignores tags (NCCL) runs any plan. Each message is
  its own ``isend`` / ``irecv``, with a work of its own: NCCL's ``batch_isend_irecv`` returns one
  work for its whole batch, so a wait for one receive waited for every transfer posted with it
  (a backward's gradient behind a forward's activation). What a wait still follows is the
  transport's order: torch's NCCL backend runs single point-to-point calls on a two-rank
  communicator per pair of ranks (one stream each, so a message follows the earlier messages of
  its pair), or, when the default group was initialised with a ``device_id``, on the group's
  communicator (one stream: a message follows every earlier one of its rank). The lowering is
  safe under both (``tests/unit/test_lowering_fifo.py`` simulates both). ``strict_order=True``
  gives every message the same tag, so gloo matches by order as NCCL does (the tests run that way);
* messages carry the compute dtype (``compute_dtype``, the same on every rank and part of the
  plan digest); with bf16, chunks run under ``torch.autocast`` as TorchTitan does without FSDP:
  fp32 master weights and gradients, bf16 matmuls, fp32 residual stream and loss. Backbone
  activations and their gradients are rounded to bf16 at every stage boundary; encoder outputs
  only where they leave the rank (as messages), so a co-located encoder hands stage 0 its output
  as computed;
* losses are keyed by micro-batch index; each is ``sum of token losses / global label-token
  count``, and gradients accumulate unscaled (``scale_grads=False``), so any packing, order or
  micro-batch count yields the same gradients as the baseline; losses are read once per step;
* encoder forwards run wherever the plan put them (in the co-located layout early on stage 0's
  rank: pre-computation) without gradients when the encoder is frozen (PipeTune's setting, no
  graph kept). When it is trained, every chunk boundary is a detached leaf: stage 0's backward
  stops at the image features and leaves their gradient per sub-microbatch, and the plan's own
  encoder backward actions carry it back chunk by chunk;
* virtual stages: a rank may hold several backbone chunks (``Placement.interleaved``: chunk ``c``
  on rank ``c mod P``, TorchTitan's ``Interleaved1F1B`` layout), each its own module in ``stages``;
  which chunk is first or last is the chunk's, not the rank's;
* split backward (zero-bubble plans): a backbone chunk's ``I`` runs torch's own
  ``stage_backward_input`` (``torch.distributed.pipelining._backward``), which computes the input
  gradient (on chunk 0 with a trained encoder, the image features'), keeps the graph from where
  each weight meets the input's path on, with the gradients arriving there, and drops the rest;
  its ``W`` runs ``stage_backward_weight`` on what ``I`` kept, which frees it. Where a chunk's
  inputs need no gradient (chunk 0 beside a frozen encoder, or a micro-batch without images),
  ``I`` computes nothing and ``W`` runs the whole backward, as torch does for its first stage
  (``_WeightGrad``). Between ``I`` and ``W`` a chunk holds its saved activations and, besides them,
  the output gradient of every weight's operation (the plan's memory model counts both);
* activation offload (plans with ``O`` and ``R`` actions, ``pipetune.schedule.offload``): the
  forward of an offloaded backbone ``(chunk, micro-batch)`` saves its tensors through the hooks of
  ``runtime.offload``; its ``O`` copies them to host memory and its ``R`` back, on a copy stream
  beside the compute stream (CUDA; on CPU a host copy that saves no memory), and its gradient
  action waits for its ``R``. Copies are in the timeline, timed on the copy stream;
* a backbone stage is any module with ``is_first`` / ``is_last`` and the keyword interface of
  ``BackboneStage`` (pipetune's model, or ``torchtitan_patches.models.muse_glimmer.stages.TitanStage`` around a
  TorchTitan model part); an encoder chunk any module with ``is_first`` / ``is_last`` and
  ``layer_range`` that maps pixels ``(N, C, H, W)`` (first chunk) or hidden states to hidden
  states or features ``(N, *features)`` (last chunk) (``VisionEncoder``, ``TitanEncoderChunk``).
  The last stage's output goes through ``loss_fn`` (default: token cross-entropy summed, divided
  by the batch's label-token count, as TorchTitan's loss does).

Before running, ranks compare a digest of the plan, of the micro-batch shapes and of the batch
content (token ids and labels), and every rank's encoder chunks' layer ranges; a mismatch raises
``PlanMismatchError`` on every rank, naming it, instead of hanging in a receive or training on
another rank's labels or a mis-cut encoder.

Timelines come from ``ActionTimeline`` (``torchtitan_patches.runtime.timing``): CUDA events on a
GPU, the host clock on CPU, in the simulator's semantics (idle time is time spent waiting for
messages).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from pipetune.config.model import EncoderConfig
from pipetune.plan.plan import IterationPlan, PlanError
from pipetune.schedule.lowering import Compute, Direction, Message, MessageKind, Post, Wait, inputs, lower
from pipetune.schedule.table import Action, Module, Op, ScheduleTable
from pipetune.simulate.simulator import TimedAction
from torchtitan_patches.data.micro_batch import GlobalBatch, PackedMicroBatch
from torchtitan_patches.models.packed_attention import varlen_metadata
from torchtitan_patches.models.reference.vlm import BackboneStage, token_loss_sum
from torchtitan_patches.runtime.host_sync import HostSyncCounter
from torchtitan_patches.runtime.memory import SavedActivations, storage_bytes
from torchtitan_patches.runtime.offload import ActivationCopies
from torchtitan_patches.runtime.timing import Clock

MAX_MICRO_BATCHES = 1 << 16


class PlanMismatchError(PlanError):
    """Ranks disagree about the plan or the batch: running it would deadlock or corrupt gradients."""


@dataclass(frozen=True)
class ImageShapes:
    """Per standard image (``grid`` patches per side), the encoder's messages: ``hidden`` between
    encoder chunks (patches, encoder width) and ``features`` from the last chunk to backbone
    stage 0 (tokens, merged width)."""

    hidden: tuple[int, int]
    features: tuple[int, int]
    grid: tuple[int, int]

    @classmethod
    def of(cls, e: EncoderConfig) -> "ImageShapes":
        side = e.image_size // e.patch_size
        return cls((e.patches_per_image, e.dim), (e.tokens_per_image, e.merged_dim), (side, side))


@dataclass
class StepResult:
    """One rank's view of a step. ``loss`` is the loss of this rank's micro-batches (last-stage
    rank only); ``timeline`` holds this rank's actions (its copies ``O`` and ``R`` timed on the copy
    stream) and ``elapsed_s`` the step's length, both in seconds from the step's start on this rank
    (``ActionTimeline``: right for ranks on other nodes, whose clocks are unrelated); ``overhead_s``
    is the per-step set-up of a new plan on this rank (digest + lowering; the digest exchange
    itself is a synchronisation point, not counted); ``peak_bytes`` the most memory the device's
    allocator held during the step (CUDA's ``max_memory_allocated``: weights, gradients and
    optimizer state included; None on CPU), to set beside the plan's ``peak_bytes``; ``host_syncs`` the host-device synchronisations of the
    step's action loop (None: not counted). With ``measure_activations``: ``activation_trace``, after
    each action of ``timeline`` (and first at the step's start), the bytes of activations this rank
    holds: tensors saved for backward still alive (``runtime.memory``) and the output gradients
    split backwards keep for their weight-gradient actions; ``activation_peak_bytes`` the most of
    their sum (what the plan's memory model predicts, without weights and messages)."""

    losses: dict[int, float] = field(default_factory=dict)
    timeline: list[TimedAction] = field(default_factory=list)
    elapsed_s: float = 0.0
    overhead_s: float = 0.0
    peak_bytes: float | None = None
    host_syncs: int | None = None
    activation_trace: list[tuple[int, int]] | None = None

    @property
    def activation_peak_bytes(self) -> int | None:
        return max(saved + held for saved, held in self.activation_trace) if self.activation_trace is not None else None

    @property
    def loss(self) -> float | None:
        return sum(self.losses.values()) if self.losses else None


def _tag(m: Message) -> int:
    """A tag both sides derive from the message alone: what it carries, from which chunk, which
    direction (a split backward's ``I`` is a backward: its gradient and the same chunk's forward
    activation may pass between the same two ranks, as with two chunks per rank), for which unit."""
    kind = list(MessageKind).index(m.kind)
    return ((3 * m.src.chunk + kind) * 2 + int(m.src.op.is_backward)) * MAX_MICRO_BATCHES + m.unit


def content_digest(mb: PackedMicroBatch) -> str:
    """A short hash of what a micro-batch teaches: sample ids, token ids and labels (host tensors)."""
    h = hashlib.blake2b(digest_size=8)
    for t in (mb.sample_ids, mb.tokens, mb.labels):
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def pad_images(patches: torch.Tensor, rows: int) -> torch.Tensor:
    """Image patch rows ``(n, patch_dim)`` followed by zero rows up to ``rows``: zero images that
    make a fixed-shape encoder unit."""
    return torch.cat([patches, patches.new_zeros(rows - patches.shape[0], patches.shape[1])])


class PlanExecutor:
    """Executes plans for the backbone stages ``stages`` (stage index -> module, already on
    ``device``) and the encoder chunks ``encoder`` held by ``rank``.

    ``encoder``: this rank's encoder chunks by chunk index, or one module standing for chunk 0,
    the whole encoder (the co-located layout: given on the rank of stage 0 when the model has one).
    ``image_shapes`` sizes the encoder's messages (``ImageShapes.of(model.encoder)``); needed for
    separated plans. ``group`` is the pipeline process group (default: the world), ``rank`` this
    rank's place in it (its pipeline stage): messages go to group ranks, so one pipeline of a
    data- or tensor-parallel job (TorchTitan's ``pp`` mesh) runs as if it were the world.
    ``sequence_shards``: tensor-parallel ranks that split a backbone activation's sequence
    (sequence parallelism: every micro-batch's length is a multiple of it, and each rank's
    pipeline carries its ``1 / sequence_shards`` of the tokens); 1 otherwise.
    ``count_host_syncs``: count the synchronisations of each step's action loop
    (``runtime.host_sync``: a check, with overhead on CPU) into ``StepResult.host_syncs``.
    ``measure_activations``: record the activation memory after every action
    (``StepResult.activation_trace``; a check: a Python hook on every tensor autograd saves).
    ``control_group`` carries the per-step digest exchange (default: ``group``; on NCCL pass a
    gloo group); it may span several replicas (``replica``: the data-parallel replica whose plan
    this rank runs; only ranks of one replica must agree). ``device`` defaults to the stages'.
    """

    def __init__(
        self,
        stages: dict[int, BackboneStage],
        encoder: nn.Module | dict[int, nn.Module] | None,
        *,
        dim: int,
        rank: int,
        image_shapes: ImageShapes | None = None,
        group=None,
        control_group=None,
        device: torch.device | str | None = None,
        compute_dtype: torch.dtype = torch.float32,
        strict_order: bool = False,
        replica: int = 0,
        sequence_shards: int = 1,
        loss_fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
        count_host_syncs: bool = False,
        measure_activations: bool = False,
    ):
        self.stages = stages
        self.encoder = dict(encoder) if isinstance(encoder, dict) else {} if encoder is None else {0: encoder}
        self.dim = dim
        self.rank = rank
        self.image_shapes = image_shapes
        self.group = group
        self.control_group = control_group if control_group is not None else group
        self.device = torch.device(device) if device is not None else next(next(iter(stages.values())).parameters()).device
        self.compute_dtype = compute_dtype
        self.strict_order = strict_order
        self.replica = replica
        self.sequence_shards = sequence_shards
        self.loss_fn = loss_fn or (lambda logits, labels, normaliser: token_loss_sum(logits, labels) / normaliser)
        self.encoder_trained = any(p.requires_grad for chunk in self.encoder.values() for p in chunk.parameters())
        self.clock = Clock(self.device)
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.count_host_syncs = count_host_syncs
        self.measure_activations = measure_activations

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _digests(self, batch: GlobalBatch, plan: IterationPlan) -> tuple[str, list[str]]:
        shapes = [(mb.num_tokens, mb.num_images) for mb in batch.micro_batches]
        blob = repr((plan.step, plan.ranks, plan.micro_batches, plan.placement, plan.sub_mb_parent, plan.image_sub_batch, batch.step,
                     shapes, batch.num_label_tokens, str(self.compute_dtype), self.strict_order, self.sequence_shards, self.image_shapes if plan.separated else None))
        return hashlib.sha256(blob.encode()).hexdigest(), [content_digest(mb) for mb in batch.micro_batches]

    def check_consistent(self, batch: GlobalBatch, plan: IterationPlan, digests: tuple[str, list[str]]) -> None:
        """All ranks of a replica (its pipelines' ranks: with tensor parallelism, several pipelines)
        must run the same plan on the same batch, and the encoder chunks of every pipeline must tile
        the encoder (one small all-gather of digests and layer ranges over the control group)."""
        chunks = {c: tuple(m.layer_range) for c, m in self.encoder.items()} if plan.separated else {}
        pipeline = tuple(dist.get_process_group_ranks(self.group)) if self.group is not None else ()
        mine = (*digests, plan.num_micro_batches, [mb.num_tokens for mb in batch.micro_batches], str(self.compute_dtype), chunks,
                self.replica, pipeline, dist.get_rank())
        every = [None] * dist.get_world_size(self.control_group)
        dist.all_gather_object(every, mine, group=self.control_group)
        peers = [d for d in every if d[6] == self.replica]
        if len({d[0] for d in peers}) > 1:
            detail = "; ".join(f"rank {d[8]}: {d[2]} micro-batches of {d[3]} tokens, compute dtype {d[4]}" for d in peers)
            raise PlanMismatchError(f"step {plan.step}: the ranks of replica {self.replica} disagree about the plan or batch ({detail})")
        for d in peers:
            bad = [k for k, (a, b) in enumerate(zip(peers[0][1], d[1])) if a != b]
            if bad:
                k = bad[0]
                raise PlanMismatchError(
                    f"step {plan.step}: ranks disagree about the batch content: micro-batch {k} (samples "
                    f"{batch.micro_batches[k].sample_ids.tolist()[:8]}) holds other token ids or labels on rank {d[8]} than on rank "
                    f"{peers[0][8]} ({len(bad)} of {len(d[1])} micro-batches differ); every rank must read the same data set with the same seed")
        line = [d for d in peers if d[7] == pipeline]
        ranges = [r for _, r in sorted((c, r) for d in line for c, r in d[5].items())]
        if any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
            where = "; ".join(f"rank {d[8]}: {d[5]}" for d in line)
            raise PlanMismatchError(f"step {plan.step}: the ranks' encoder chunks do not cut the encoder into consecutive layer "
                                    f"ranges ({where}); build every rank's chunks from one layout")

    def _check_runnable(self, plan: IterationPlan) -> None:
        p = plan.placement
        for module, held in ((Module.BACKBONE, self.stages), (Module.ENCODER, self.encoder if plan.encoder else {})):
            what = "encoder chunk" if module is Module.ENCODER else "backbone stage"
            mine = [c for c, r in enumerate(p.chunks(module)) if r == self.rank]
            if set(mine) - set(held):
                raise PlanError(f"step {plan.step}: the plan places {what}s {mine} on rank {self.rank}, which holds {what}s "
                                f"{sorted(held)}; build the model for the plan's layout")
            n = len(p.chunks(module))
            for c in mine:
                if (held[c].is_first, held[c].is_last) != (c == 0, c == n - 1):
                    raise PlanError(f"step {plan.step}: the plan cuts the {module.name.lower()} into {n} chunks, so {what} {c} is "
                                    f"{_part(c == 0, c == n - 1)}, but this rank's is {_part(held[c].is_first, held[c].is_last)}; "
                                    "build the model for the plan's layout")
        if plan.separated and self.image_shapes is None:
            raise PlanError(f"step {plan.step}: a separated plan sends encoder messages; give the executor image_shapes "
                            "(ImageShapes.of(model.encoder)) to size them")
        if plan.encoder and self.encoder and p.encoder_trained != self.encoder_trained:
            raise PlanError(f"step {plan.step}: the plan was made for a {'trained' if p.encoder_trained else 'frozen'} "
                            f"vision encoder, but this rank's encoder is {'trained' if self.encoder_trained else 'frozen'}")

    def run(self, batch: GlobalBatch, plan: IterationPlan) -> StepResult:
        t0 = time.perf_counter()
        if batch.sample_ids != [list(mb) for mb in plan.micro_batches]:
            raise PlanMismatchError(f"rank {self.rank}: batch {batch.step} was not packed as plan {plan.step} says")
        self._check_runnable(plan)
        if plan.separated and any(g != self.image_shapes.grid for mb in batch.micro_batches for g in mb.image_grids):
            raise PlanError(f"step {plan.step}: a separated plan's encoder messages have one shape per image, but batch {batch.step} "
                            f"holds images at their own resolution; resize every image to the standard "
                            f"{self.image_shapes.grid} patch grid (dataloader keep_aspect=False) or use a co-located layout")
        uneven = [j for j, mb in enumerate(batch.micro_batches) if mb.num_tokens % self.sequence_shards]
        if uneven:
            raise PlanError(f"step {plan.step}: micro-batch {uneven[0]} has {batch.micro_batches[uneven[0]].num_tokens} tokens, not a "
                            f"multiple of the {self.sequence_shards} sequence-parallel ranks; pad micro-batches to a multiple "
                            "(DataLoaderConfig.seq_multiple)")
        images = plan.image_ranges([mb.num_images for mb in batch.micro_batches])
        digests = self._digests(batch, plan)
        table = plan.table()
        steps = lower(table, self.rank)
        overhead = time.perf_counter() - t0
        self.check_consistent(batch, plan, digests)
        cuda = self.device.type == "cuda"
        if cuda:  # allocator statistics, kept on the host: no device synchronisation
            torch.cuda.reset_peak_memory_stats(self.device)
        timeline = self.clock.timeline()
        timeline.start()
        st = _StepState(batch, plan, table, StepResult(overhead_s=overhead), self._on_device(batch, plan), images)
        counter = HostSyncCounter(self.device) if self.count_host_syncs else None
        if self.measure_activations:
            st.memory = SavedActivations([*self._weights_and_buffers(), *(t for d in st.dev for t in d.values() if isinstance(t, torch.Tensor))])
            st.res.activation_trace = [(0, 0)]
        if table.offloaded:
            st.copies = ActivationCopies(table.offloaded, self.device, self.copy_stream, st.memory)
        with counter or nullcontext(), st.memory or nullcontext():
            done = self._loop(st, steps, timeline)
        st.res.host_syncs = counter.count if counter is not None else None
        spans, st.res.elapsed_s = timeline.finish()
        st.res.peak_bytes = float(torch.cuda.max_memory_allocated(self.device)) if cuda else None
        if st.losses:
            st.res.losses = dict(zip(st.losses, torch.stack(list(st.losses.values())).tolist()))
        precomputed = _precomputed(plan, self.rank)
        st.res.timeline = [TimedAction(self.rank, a, s, e, precomputed=a in precomputed) for a, (s, e) in zip(done, spans)]
        return st.res

    def _loop(self, st: "_StepState", steps: list, timeline) -> list[Action]:
        """The step's hot loop: this rank's lowered steps in order, then its sends' completion;
        returns the actions (compute and copies) in the order they ran."""
        done = []
        for step in steps:
            match step:
                case Post():
                    self._post(st, step)
                case Wait(message=m):
                    with timeline.waiting():
                        st.recvs[m][0].wait()
                case Compute(action=a):
                    if a.op is Op.OFFLOAD or a.op is Op.RELOAD:
                        st.copies.run(a, timeline)  # on the copy stream, timed there
                    else:
                        timeline.begin()
                        if a.op is Op.FORWARD:
                            (self._encoder_forward if a.is_encoder else self._forward)(st, a)
                        elif a.is_encoder:
                            self._encoder_backward(st, a)
                        elif a.op is Op.BACKWARD_WEIGHT:
                            st.weight_grads.pop(a).run()
                        else:
                            self._backward(st, a)
                        timeline.end()
                    done.append(a)
                    if st.memory is not None:
                        st.res.activation_trace.append((st.memory.live_bytes(), storage_bytes(
                            t for w in st.weight_grads.values() for t in w.held())))
        for work, _ in st.sends:
            work.wait()
        return done

    def _weights_and_buffers(self):
        for module in (*self.stages.values(), *self.encoder.values()):
            yield from module.parameters()
            yield from module.buffers()

    def _on_device(self, batch: GlobalBatch, plan: IterationPlan) -> list[dict]:
        """Per micro-batch, the tensors this rank's chunks use, moved to the device (non-blocking),
        and the attention metadata built from the host's lengths (no device synchronisation)."""
        first, last = 0 in self.stages, plan.num_stages - 1 in self.stages
        pixels = plan.encoder and 0 in self.encoder
        if plan.encoder:
            grids = {g for mb in batch.micro_batches for g in mb.image_grids}
            for chunk in self.encoder.values():
                chunk.prepare(grids, self.device)
        out = []
        for mb in batch.micro_batches:
            # image spans on every stage: a model whose positions depend on the images (Qwen's MRoPE) needs them
            d = {"positions": mb.positions[None], "masks": varlen_metadata(mb.cu_seqlens, self.device), "image_spans": mb.image_spans}
            if first:
                d["tokens"] = mb.tokens[None]
            if pixels:
                d["pixel_values"] = mb.pixel_values
            if last:
                d["labels"] = mb.labels[None]
            out.append({k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in d.items()})
        return out

    def _shape(self, st: "_StepState", m: Message) -> tuple[int, ...]:
        """A message's shape, from the batch and the plan alone (see the module doc)."""
        match m.kind:
            case MessageKind.ACTIVATION:
                return (1, st.batch.micro_batches[m.unit].num_tokens // self.sequence_shards, self.dim)
            case MessageKind.ENCODER_ACTIVATION:
                patches, width = self.image_shapes.hidden
                return (st.plan.image_sub_batch * patches, width)
            case MessageKind.FEATURES:
                tokens, width = self.image_shapes.features
                return (st.images[m.unit][2] * tokens, width)

    def _post(self, st: "_StepState", post: Post) -> None:
        """Every transfer of ``post`` as its own operation, in order: one work per message (never
        ``batch_isend_irecv``, whose batches torch's NCCL backend runs on another communicator than
        single calls: the order two ranks share holds within one communicator only)."""
        for t in post.transfers:
            m = t.message
            tag = 0 if self.strict_order else _tag(m)
            if t.direction is Direction.SEND:
                tensor = st.outbox.pop(m)
                st.sends.append((dist.isend(tensor, group=self.group, group_dst=t.peer, tag=tag), tensor))
            else:
                tensor = torch.empty(self._shape(st, m), dtype=self.compute_dtype, device=self.device)
                st.recvs[m] = (dist.irecv(tensor, group=self.group, group_src=t.peer, tag=tag), tensor)

    def _take(self, st: "_StepState", a: Action) -> dict[Action, torch.Tensor | None]:
        """What ``a`` consumes from other chunks, by producing action: received messages and
        same-rank hand-overs (its own chunk's saved forward is not among them)."""
        out = {}
        for need in inputs(st.table, a):
            if isinstance(need, Message):
                out[need.src] = st.recvs.pop(need)[1]
            elif (need.module, need.chunk) != (a.module, a.chunk):
                out[need] = st.local.pop(Message(need, a))
        return out

    def _give(self, st: "_StepState", a: Action, value: torch.Tensor | None, to: Action | None = None) -> None:
        """Hand ``a``'s output ``value`` to its consumers on other chunks (or only ``to``): on this
        rank as it is, to other ranks as a message in the compute dtype."""
        for c in ([to] if to is not None else st.table.consumers(a)):
            if (c.module, c.chunk) == (a.module, a.chunk):
                continue
            m = Message(a, c)
            if st.table.placement.rank_of(c) == self.rank:
                st.local[m] = value
            else:
                st.outbox[m] = value.to(self.compute_dtype).contiguous()

    def _encoder_forward(self, st: "_StepState", a: Action) -> None:
        """Encoder chunk ``a.chunk`` on sub-microbatch ``a.unit``: pixels (padded to the plan's
        ``image_sub_batch``) on the first chunk, else the previous chunk's output; the last chunk
        hands on the real images' features only."""
        c, k = a.chunk, a.unit
        chunk = self.encoder[c]
        trained = st.plan.placement.encoder_trained
        j, first, n = st.images[k]
        B = st.plan.image_sub_batch
        mb = st.batch.micro_batches[j]
        grids = mb.image_grids[first:first + n]
        if B > n:
            grids += (self.image_shapes.grid,) * (B - n)
        if chunk.is_first:
            x = st.dev[j]["pixel_values"][mb.patch_rows(first, n)]
            x = pad_images(x, B * self.image_shapes.hidden[0]) if n < B else x
        else:
            (x,) = self._take(st, a).values()
            x = x.requires_grad_(trained)
        y = None
        if x.shape[0]:  # a co-located micro-batch without images
            with torch.set_grad_enabled(trained), self._autocast():
                y = chunk(x.float(), grids)  # fp32 residual stream, as in the unsplit encoder
            y = y[:n * self.image_shapes.features[0]] if chunk.is_last and n < B else y
        if trained:
            st.saved[a] = (x, y)
        self._give(st, a, y.detach() if y is not None else None)

    def _encoder_backward(self, st: "_StepState", a: Action) -> None:
        x, y = st.saved.pop(Action(a.chunk, Op.FORWARD, a.unit, a.module))
        (grad,) = self._take(st, a).values()
        if y is not None:
            torch.autograd.backward(y, grad.to(y.dtype))
        if not self.encoder[a.chunk].is_first:
            self._give(st, a, x.grad)

    def _image_features(self, st: "_StepState", j: int, got: dict) -> torch.Tensor | None:
        """Micro-batch ``j``'s image features for stage 0's forward: its sub-microbatches' in order.
        With a trained encoder each is a leaf whose gradient stage 0's backward leaves for the last
        encoder chunk's backward."""
        last = len(st.plan.placement.encoder) - 1
        parts = [(k, got[Action(last, Op.FORWARD, k, Module.ENCODER)]) for k in st.table.sub_micro_batches[j]]
        if st.plan.placement.encoder_trained:
            parts = [(k, f.detach().requires_grad_(True) if f is not None else None) for k, f in parts]
            st.leaves[j] = parts
        tensors = [f for _, f in parts if f is not None]
        return None if not tensors else tensors[0] if len(tensors) == 1 else torch.cat(tensors)

    def _forward(self, st: "_StepState", a: Action) -> None:
        s, j = a.chunk, a.unit
        d = st.dev[j]
        stage = self.stages[s]
        got = self._take(st, a)
        kwargs = {"positions": d["positions"], "masks": d["masks"], "image_spans": d["image_spans"]}
        if stage.is_first:
            x = d["tokens"]
            if st.plan.encoder:
                kwargs["image_features"] = self._image_features(st, j, got)
        else:
            (x,) = got.values()
            x.requires_grad_(True)
        offloaded = st.copies is not None and (s, j) in st.copies.pairs
        with self._offloading(st, a, x, got, kwargs) if offloaded else nullcontext():
            with self._autocast():
                # the residual stream stays fp32 as in the unsplit model; only messages are rounded
                y = stage(x if stage.is_first else x.float(), **kwargs)
            if stage.is_last:
                y = self.loss_fn(y, d["labels"], st.batch.num_label_tokens)
        if stage.is_last:
            st.losses[j] = y.detach()
        else:
            y = y.to(self.compute_dtype)  # the message dtype every rank knows
            self._give(st, a, y.detach())
        st.saved[a] = (x, y)

    def _offloading(self, st: "_StepState", a: Action, x: torch.Tensor, got: dict, kwargs: dict):
        """Saved-tensor hooks for the forward ``a`` of an offloaded pair (``runtime.offload``): what
        other chunks share stays on the device (weights, the micro-batch's inputs, image features,
        hand-overs from this rank's other chunks); a received input moves with the activations."""
        local = [t for p, t in got.items() if t is not None and st.table.placement.rank_of(p) == self.rank]
        stage = self.stages[a.chunk]
        inputs = [t for v in st.dev[a.unit].values() for t in (v if isinstance(v, tuple) else (v,)) if isinstance(t, torch.Tensor)]
        features = kwargs.get("image_features")
        keep = [*stage.parameters(), *stage.buffers(), *inputs, *local, *([features] if features is not None else [])]
        received = None if stage.is_first or local else x  # a chunk > 0's input: received, or handed over by this rank's chunk
        return st.copies.capture((a.chunk, a.unit), keep, received)

    def _backward(self, st: "_StepState", a: Action) -> None:
        """A whole backward ``B``, or a split one's input gradient ``I`` (which leaves its chunk's
        ``W`` what it needs: ``_WeightGrad``); either hands the input gradients on: to the previous
        chunk, or from chunk 0 the image features' to the last encoder chunk."""
        s, j = a.chunk, a.unit
        x, y = st.saved.pop(Action(s, Op.FORWARD, j))
        if st.copies is not None and (s, j) in st.copies.pairs:
            st.copies.ready((s, j))
        grad = None
        if not self.stages[s].is_last:
            (grad,) = self._take(st, a).values()
        leaves = st.leaves.pop(j, ()) if s == 0 else ()
        if a.op is Op.BACKWARD:
            torch.autograd.backward(y, grad)
        else:
            inputs = [x] if s > 0 else [leaf for _, leaf in leaves if leaf is not None]
            weights = [p for p in self.stages[s].parameters() if p.requires_grad]
            st.weight_grads[Action(s, Op.BACKWARD_WEIGHT, j)] = _WeightGrad.split(y, grad, inputs, weights, where=a)
        if s > 0:
            self._give(st, a, x.grad)
            return
        last = len(st.plan.placement.encoder) - 1
        for k, leaf in leaves:
            grad = None if leaf is None else leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            self._give(st, a, grad, to=Action(last, Op.BACKWARD, k, Module.ENCODER))


@dataclass
class _WeightGrad:
    """What a split backward's ``W`` needs from its ``I``: torch's parameter groups
    (``stage_backward_input``: the graph from where each weight meets the input's path on, kept
    alive, and the gradients that arrived there), or, where no input of the chunk needs a
    gradient (chunk 0 without a trained encoder's features), the output and its gradient: ``I``
    then has nothing to compute and ``W`` runs the whole backward, torch's rule for the first stage
    (``PipelineStage.backward_weight_one_chunk``), since without a differentiable input torch's
    parameter groups capture no weight."""

    weights: list[nn.Parameter]
    groups: list[dict] | None = None
    output: torch.Tensor | None = None
    grad: torch.Tensor | None = None

    @classmethod
    def split(cls, output: torch.Tensor, grad: torch.Tensor | None, inputs: list[torch.Tensor], weights: list[nn.Parameter],
              *, where: Action) -> "_WeightGrad":
        """Run the input gradient of ``output`` (a loss when ``grad`` is None) into each input's
        ``.grad``; return what the weight gradient needs."""
        if not inputs:
            return cls(weights, output=output, grad=grad)
        dinputs, groups = stage_backward_input([output], None if grad is None else [grad], inputs, iter(weights))
        if all(d is None for d in dinputs):  # no group would hold a weight: W would silently add nothing
            raise RuntimeError(f"{where}: the chunk's output does not depend on its inputs, so a split backward cannot find "
                               "its weights' gradients; run this plan with whole backwards")
        return cls(weights, groups=groups)

    def run(self) -> None:
        """Accumulate the weights' gradients (``W``)."""
        if self.groups is None:
            torch.autograd.backward(self.output, self.grad)
        else:
            stage_backward_weight(iter(self.weights), self.groups)

    def held(self):
        """The gradients kept for ``run`` (memory a split backward holds beside the saved activations)."""
        if self.groups is None:
            yield self.grad
            return
        for group in self.groups:
            for grads in group.get("grads") or ():
                yield from (g for g in grads or () if isinstance(g, torch.Tensor))


def _part(first: bool, last: bool) -> str:
    return "the whole module" if first and last else "its first chunk" if first else "its last chunk" if last else "a middle chunk"


@dataclass
class _StepState:
    """What one step keeps between actions: device tensors per micro-batch, each sub-microbatch's
    ``(micro-batch, first image, images)``, posted receives, pending sends, outputs waiting to be
    sent, saved inputs and outputs of forwards for their backward (by forward action), same-rank
    hand-overs between chunks (by message), a trained encoder's feature leaves per micro-batch
    waiting for stage 0's backward, losses, what split backwards' ``W`` actions need (by ``W``
    action), the activation tracker (``measure_activations``) and the offloaded activations
    (plans with ``O`` / ``R`` actions)."""

    batch: GlobalBatch
    plan: IterationPlan
    table: ScheduleTable
    res: StepResult
    dev: list[dict]
    images: list[tuple[int, int, int]]
    recvs: dict = field(default_factory=dict)
    sends: list = field(default_factory=list)
    outbox: dict = field(default_factory=dict)
    saved: dict = field(default_factory=dict)
    local: dict = field(default_factory=dict)
    leaves: dict = field(default_factory=dict)
    losses: dict = field(default_factory=dict)
    weight_grads: dict = field(default_factory=dict)
    memory: SavedActivations | None = None
    copies: ActivationCopies | None = None


def _precomputed(plan: IterationPlan, rank: int) -> set[Action]:
    """Encoder forwards of ``rank`` that do not sit right before the stage-0 forward that consumes
    them (pre-computation: a notion of the co-located layout; none in separated plans). Copies run
    beside compute: an ``R`` between the two does not make the forward pre-computed."""
    if plan.separated:
        return set()
    acts = [a for a in map(Action.parse, plan.ranks[rank]) if not a.op.is_copy]
    return {
        a
        for k, a in enumerate(acts)
        if a.is_encoder and a.op is Op.FORWARD
        and not (k + 1 < len(acts) and acts[k + 1] == Action(0, Op.FORWARD, plan.sub_mb_parent[a.unit]))
    }
