"""Run one iteration's ``IterationPlan`` on this rank's pipeline stages (gloo on CPU, NCCL on GPU).

Unlike torch's ``PipelineSchedule*`` (shapes inferred once from micro-batch 0, losses stored in
execution order), every micro-batch here may have its own length and the order is arbitrary:

* every rank holds the whole ``GlobalBatch`` (each PP rank runs the same dataloader, as in
  TorchTitan), so the shape of every message is known and no shape inference runs, ever;
* messages follow ``pipetune.schedule.lowering``: between every pair of ranks both sides post
  them in the same order, so a transport that ignores tags (NCCL) runs any plan; each ``Post`` is
  one ``batch_isend_irecv``. ``strict_order=True`` gives every message the same tag, so gloo
  matches by order as NCCL does (the tests run that way);
* messages carry the compute dtype (``compute_dtype``, the same on every rank and part of the
  plan digest); with bf16, stages run under ``torch.autocast`` as TorchTitan does without FSDP:
  fp32 master weights and gradients, bf16 matmuls, fp32 residual stream and loss; activations
  and their gradients are rounded to bf16 only where they cross a stage boundary;
* losses are keyed by micro-batch index; each is ``sum of token losses / global label-token
  count``, and gradients accumulate unscaled (``scale_grads=False``), so any packing, order or
  micro-batch count yields the same gradients as the baseline; losses are read once per step;
* encoder actions (the co-located layout: one encoder chunk beside stage 0, ``E0F{j}`` encoding
  micro-batch ``j``'s images) run wherever the plan put them (pre-computation) and hand their
  output to stage 0's forward of that micro-batch: without gradients when the encoder is frozen
  (PipeTune's setting, no graph kept); when it is trained, stage 0's forward takes a detached
  copy, so stage 0's backward stops at the image features and leaves their gradient, and the
  plan's own ``E0B{j}`` back-propagates it through the encoder;
* plans of the separated layout (encoder chunks of their own on every rank, DIP) are refused with
  a ``PlanError`` for now: executing them needs per-chunk encoder modules, which come later;
* a stage is any module with ``is_first`` / ``is_last`` and the keyword interface of
  ``BackboneStage`` (pipetune's model, or ``torchtitan_patches.titan.stages.TitanStage`` around a
  TorchTitan model part); the last stage's output goes through ``loss_fn`` (default: token
  cross-entropy summed, divided by the batch's label-token count, as TorchTitan's loss does).

Before running, ranks compare a digest of the plan, of the micro-batch shapes and of the batch
content (token ids and labels); a mismatch raises ``PlanMismatchError`` on every rank, naming it,
instead of hanging in a receive or training on another rank's labels.

Timelines come from ``profiling.timing.ActionTimeline``: CUDA events on a GPU, the host clock on
CPU, in the simulator's semantics (idle time is time spent waiting for messages).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from contextlib import nullcontext
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pipetune.plan.plan import IterationPlan, PlanError
from pipetune.schedule.lowering import Compute, Direction, Message, MessageKind, Post, Wait, inputs, lower
from pipetune.schedule.table import Action, Module, Op, ScheduleTable
from pipetune.simulate.simulator import TimedAction
from profiling.timing import Clock
from torchtitan_patches.data.micro_batch import GlobalBatch, PackedMicroBatch
from torchtitan_patches.model.attention import varlen_metadata
from torchtitan_patches.model.vlm import BackboneStage, VisionEncoder, token_loss_sum

MAX_MICRO_BATCHES = 1 << 16


class PlanMismatchError(PlanError):
    """Ranks disagree about the plan or the batch: running it would deadlock or corrupt gradients."""


@dataclass
class StepResult:
    """One rank's view of a step. ``loss`` is the batch loss (last-stage rank only);
    ``timeline`` holds this rank's compute actions (absolute ``perf_counter`` seconds);
    ``overhead_s`` is the per-step set-up of a new plan on this rank (digest + lowering; the
    digest exchange itself is a synchronisation point, not counted)."""

    losses: dict[int, float] = field(default_factory=dict)
    timeline: list[TimedAction] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    overhead_s: float = 0.0

    @property
    def loss(self) -> float | None:
        return sum(self.losses.values()) if self.losses else None


def _tag(m: Message) -> int:
    """A tag both sides derive from the message alone: what it carries, from which chunk, which
    direction, for which unit."""
    kind = list(MessageKind).index(m.kind)
    return ((3 * m.src.chunk + kind) * 2 + int(m.src.op is Op.BACKWARD)) * MAX_MICRO_BATCHES + m.unit


def content_digest(mb: PackedMicroBatch) -> str:
    """A short hash of what a micro-batch teaches: sample ids, token ids and labels (host tensors)."""
    h = hashlib.blake2b(digest_size=8)
    for t in (mb.sample_ids, mb.tokens, mb.labels):
        h.update(t.numpy().tobytes())
    return h.hexdigest()


class PlanExecutor:
    """Executes plans for the stages ``stages`` (stage index -> module, already on ``device``)
    held by ``rank``.

    ``encoder`` must be given on the rank of stage 0 when the model has one: a module with a
    ``trained`` property (``VisionEncoder``, TorchTitan's ``TitanEncoder``) returning the image
    features, or a dataclass of tensors holding them. ``group`` is the
    pipeline process group (default: the world); ``control_group`` carries the per-step digest
    exchange (default: ``group``; on NCCL pass a gloo group). ``device`` defaults to the stages'.
    """

    def __init__(
        self,
        stages: dict[int, BackboneStage],
        encoder: VisionEncoder | None,
        *,
        dim: int,
        rank: int,
        group=None,
        control_group=None,
        device: torch.device | str | None = None,
        compute_dtype: torch.dtype = torch.float32,
        strict_order: bool = False,
        loss_fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
    ):
        self.stages = stages
        self.encoder = encoder
        self.dim = dim
        self.rank = rank
        self.group = group
        self.control_group = control_group if control_group is not None else group
        self.device = torch.device(device) if device is not None else next(next(iter(stages.values())).parameters()).device
        self.compute_dtype = compute_dtype
        self.strict_order = strict_order
        self.loss_fn = loss_fn or (lambda logits, labels, normaliser: token_loss_sum(logits, labels) / normaliser)
        self.encoder_trained = encoder is not None and encoder.trained
        self.clock = Clock(self.device)

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _digests(self, batch: GlobalBatch, plan: IterationPlan) -> tuple[str, list[str]]:
        shapes = [(mb.num_tokens, mb.num_images) for mb in batch.micro_batches]
        blob = repr((plan.step, plan.ranks, plan.micro_batches, plan.placement, plan.sub_mb_parent, plan.image_sub_batch, batch.step,
                     shapes, batch.num_label_tokens, str(self.compute_dtype), self.strict_order))
        return hashlib.sha256(blob.encode()).hexdigest(), [content_digest(mb) for mb in batch.micro_batches]

    def check_consistent(self, batch: GlobalBatch, plan: IterationPlan, digests: tuple[str, list[str]]) -> None:
        """All ranks must run the same plan on the same batch (one small all-gather of digests)."""
        mine = (*digests, plan.num_micro_batches, [mb.num_tokens for mb in batch.micro_batches], str(self.compute_dtype))
        every = [None] * dist.get_world_size(self.control_group)
        dist.all_gather_object(every, mine, group=self.control_group)
        if len({d[0] for d in every}) > 1:
            detail = "; ".join(f"rank {r}: {d[2]} micro-batches of {d[3]} tokens, {d[4]} messages" for r, d in enumerate(every))
            raise PlanMismatchError(f"step {plan.step}: ranks disagree about the plan or batch ({detail})")
        for r, d in enumerate(every):
            bad = [k for k, (a, b) in enumerate(zip(every[0][1], d[1])) if a != b]
            if bad:
                k = bad[0]
                raise PlanMismatchError(
                    f"step {plan.step}: ranks disagree about the batch content: micro-batch {k} (samples "
                    f"{batch.micro_batches[k].sample_ids.tolist()[:8]}) holds other token ids or labels on rank {r} than on rank 0 "
                    f"({len(bad)} of {len(d[1])} micro-batches differ); every rank must read the same data set with the same seed")

    def _check_runnable(self, batch: GlobalBatch, plan: IterationPlan) -> None:
        if plan.separated:
            raise PlanError(f"step {plan.step}: this plan runs the encoder in chunks of its own on every rank (the separated layout); "
                            "the executor does not run separated plans yet: plan with the co-located layout (--layout even, auto or "
                            "explicit) to train")
        if plan.encoder and self.encoder is not None and plan.placement.encoder_trained != self.encoder_trained:
            raise PlanError(f"step {plan.step}: the plan was made for a {'trained' if plan.placement.encoder_trained else 'frozen'} "
                            f"vision encoder, but this rank's encoder is {'trained' if self.encoder_trained else 'frozen'}")
        plan.image_ranges([mb.num_images for mb in batch.micro_batches])

    def run(self, batch: GlobalBatch, plan: IterationPlan) -> StepResult:
        t0 = time.perf_counter()
        if batch.sample_ids != [list(mb) for mb in plan.micro_batches]:
            raise PlanMismatchError(f"rank {self.rank}: batch {batch.step} was not packed as plan {plan.step} says")
        self._check_runnable(batch, plan)
        digests = self._digests(batch, plan)
        steps = lower(plan.table(), self.rank)
        overhead = time.perf_counter() - t0
        self.check_consistent(batch, plan, digests)
        timeline = self.clock.timeline()
        st = _StepState(batch, plan, plan.table(), StepResult(start=timeline.start(), overhead_s=overhead), self._on_device(batch, plan))
        done: list[Action] = []
        for step in steps:
            match step:
                case Post():
                    self._post(st, step)
                case Wait(message=m):
                    with timeline.waiting():
                        st.recvs[m][0].wait()
                case Compute(action=a):
                    timeline.begin()
                    self._compute(st, a)
                    timeline.end()
                    done.append(a)
        for work, _ in st.sends:
            work.wait()
        spans, st.res.end = timeline.finish()
        if st.losses:
            st.res.losses = dict(zip(st.losses, torch.stack(list(st.losses.values())).tolist()))
        precomputed = _precomputed(plan, self.rank)
        st.res.timeline = [TimedAction(self.rank, a, s, e, precomputed=a in precomputed) for a, (s, e) in zip(done, spans)]
        return st.res

    def _compute(self, st: "_StepState", a: Action) -> None:
        match (a.module, a.op):
            case (Module.ENCODER, Op.FORWARD):
                self._encode(st, a.unit)
            case (Module.ENCODER, Op.BACKWARD):
                self._encode_backward(st, a.unit)
            case (Module.BACKBONE, Op.FORWARD):
                self._forward(st, a)
            case (Module.BACKBONE, Op.BACKWARD):
                self._backward(st, a)

    def _on_device(self, batch: GlobalBatch, plan: IterationPlan) -> list[dict]:
        """Per micro-batch, the tensors this rank's stages use, moved to the device (non-blocking),
        and the attention metadata built from the host's lengths (no device synchronisation)."""
        mine = set(self.stages)
        first, last = 0 in mine, plan.num_stages - 1 in mine
        out = []
        for mb in batch.micro_batches:
            d = {"positions": mb.positions[None], "masks": varlen_metadata(mb.cu_seqlens, self.device)}
            if first:
                d.update(tokens=mb.tokens[None], image_token_index=mb.image_token_index, pixel_values=mb.pixel_values)
            if last:
                d["labels"] = mb.labels[None]
            out.append({k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in d.items()})
        return out

    def _post(self, st: "_StepState", post: Post) -> None:
        """Every post, even of one message, is a ``batch_isend_irecv``: torch's NCCL backend may
        run batched and single point-to-point calls on different communicators, and the order
        shared by two ranks holds only within one (the lowering test simulates both one queue
        per pair and one queue per rank)."""
        ops, recv_bufs = [], []
        for t in post.transfers:
            m = t.message
            if t.direction is Direction.SEND:
                tensor = st.outbox.pop(m)
                ops.append(dist.P2POp(dist.isend, tensor, t.peer, group=self.group, tag=0 if self.strict_order else _tag(m)))
            else:
                tensor = torch.empty(1, st.batch.micro_batches[m.unit].num_tokens, self.dim, dtype=self.compute_dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, tensor, t.peer, group=self.group, tag=0 if self.strict_order else _tag(m)))
                recv_bufs.append((m, tensor))
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # a coalescing backend (NCCL) returns one work for the whole batch
            works = works * len(ops)
        recv_at = iter(recv_bufs)
        for t, op, work in zip(post.transfers, ops, works):
            if t.direction is Direction.SEND:
                st.sends.append((work, op.tensor))
            else:
                m, buf = next(recv_at)
                st.recvs[m] = (work, buf)

    def _encode(self, st: "_StepState", k: int) -> None:
        """Sub-microbatch ``k`` (co-located: all of micro-batch ``k``'s images)."""
        pixels = st.dev[st.plan.sub_mb_parent[k]]["pixel_values"]
        with torch.set_grad_enabled(self.encoder_trained), self._autocast():
            st.features[k] = self.encoder(pixels) if pixels.shape[0] else None

    def _image_features(self, st: "_StepState", j: int):
        """Micro-batch ``j``'s encoder output for stage 0's forward. A trained encoder's output is
        handed over detached, so stage 0's backward leaves the features' gradient for ``E0B``."""
        (k,) = st.table.sub_micro_batches[j]
        out = st.features.pop(k)
        if out is None or not self.encoder_trained:
            return out
        leaf = _detached(out)
        st.encoded[k] = (out, leaf)
        return leaf

    def _encode_backward(self, st: "_StepState", k: int) -> None:
        out, leaf = st.encoded.pop(k, (None, None))
        pairs = [(t, g.grad) for t, g in zip(_tensors(out), _tensors(leaf)) if g.grad is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    def _input(self, st: "_StepState", a: Action) -> torch.Tensor:
        """What backbone action ``a`` consumes from another stage: a local hand-over or a received message."""
        (need,) = [n for n in inputs(st.table, a) if not (isinstance(n, Action) and (n.is_encoder or n.chunk == a.chunk))]
        return st.recvs.pop(need)[1] if isinstance(need, Message) else st.local.pop(Message(need, a))

    def _output(self, st: "_StepState", a: Action, tensor: torch.Tensor) -> None:
        """Hand ``a``'s output to the next backbone stage (locally or as a message)."""
        for c in st.table.consumers(a):
            if not c.is_encoder and c.chunk != a.chunk:
                target = st.local if st.table.placement.rank_of(c) == self.rank else st.outbox
                target[Message(a, c)] = tensor

    def _forward(self, st: "_StepState", a: Action) -> None:
        s, i = a.chunk, a.unit
        d = st.dev[i]
        stage = self.stages[s]
        kwargs = {"positions": d["positions"], "masks": d["masks"]}
        if stage.is_first:
            x = d["tokens"]
            if st.plan.encoder:
                kwargs.update(image_features=self._image_features(st, i), image_token_index=d["image_token_index"])
        else:
            x = self._input(st, a).requires_grad_(True)
        with self._autocast():
            # the residual stream stays fp32 as in the unsplit model; only messages are rounded
            y = stage(x if stage.is_first else x.float(), **kwargs)
        if stage.is_last:
            y = self.loss_fn(y, d["labels"], st.batch.num_label_tokens)
            st.losses[i] = y.detach()
        else:
            y = y.to(self.compute_dtype)  # the message dtype every rank knows
            self._output(st, a, y.detach())
        st.saved[(s, i)] = (x, y)

    def _backward(self, st: "_StepState", a: Action) -> None:
        s = a.chunk
        x, y = st.saved.pop((s, a.unit))
        if self.stages[s].is_last:
            y.backward()
        else:
            torch.autograd.backward(y, self._input(st, a))
        if s > 0:
            self._output(st, a, x.grad)


def _tensors(value) -> list[torch.Tensor]:
    """The tensors of an encoder output: itself, or the tensor fields of a dataclass (TorchTitan's
    ``EncodedImages``), in field order."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    return [getattr(value, f.name) for f in dataclasses.fields(value) if isinstance(getattr(value, f.name), torch.Tensor)]


def _detached(value):
    """``value`` with every tensor that carries a graph replaced by a leaf collecting its gradient."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    return dataclasses.replace(value, **{f.name: _detached(getattr(value, f.name)) for f in dataclasses.fields(value)
                                         if isinstance(getattr(value, f.name), torch.Tensor)})


@dataclass
class _StepState:
    """What one step keeps between actions: device tensors per micro-batch, posted receives,
    pending sends, outputs waiting to be sent, saved activations for backward, same-rank
    hand-overs between stages, encoder features waiting for their forward, a trained encoder's
    outputs and their detached copies waiting for its backward, losses."""

    batch: GlobalBatch
    plan: IterationPlan
    table: ScheduleTable
    res: StepResult
    dev: list[dict]
    recvs: dict = field(default_factory=dict)
    sends: list = field(default_factory=list)
    outbox: dict = field(default_factory=dict)
    saved: dict = field(default_factory=dict)
    local: dict = field(default_factory=dict)
    features: dict = field(default_factory=dict)
    encoded: dict = field(default_factory=dict)
    losses: dict = field(default_factory=dict)


def _precomputed(plan: IterationPlan, rank: int) -> set[Action]:
    """Encoder forwards of ``rank`` that do not sit right before the stage-0 forward that consumes them."""
    acts = [Action.parse(a) for a in plan.ranks[rank]]
    return {
        a
        for k, a in enumerate(acts)
        if a.is_encoder and a.op is Op.FORWARD
        and not (k + 1 < len(acts) and acts[k + 1] == Action(0, Op.FORWARD, plan.sub_mb_parent[a.unit]))
    }
