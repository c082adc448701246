"""Run one iteration's ``IterationPlan`` on this rank's pipeline stages (gloo on CPU, NCCL on GPU).

Unlike torch's ``PipelineSchedule*`` (shapes inferred once from micro-batch 0, losses stored in
execution order), every micro-batch here may have its own length and the order is arbitrary:

* every rank holds the whole ``GlobalBatch`` (each PP rank runs the same dataloader, as in
  TorchTitan), so the shape of every message is known and no shape inference runs, ever;
* messages are matched by (stage, direction, micro-batch) tags, so any order is safe;
* losses are keyed by micro-batch index; each is ``sum of token losses / global label-token
  count``, and gradients accumulate unscaled (``scale_grads=False``), so any packing, order or
  micro-batch count yields the same gradients as the baseline;
* ``E`` actions run the frozen vision encoder wherever the plan put them (pre-computation) and
  hand their features to stage 0's forward of that micro-batch.

Before running, ranks compare a digest of the plan and of the micro-batch shapes; a mismatch
raises ``PlanMismatchError`` on every rank instead of hanging in a receive.

Timeline semantics match the simulator's: an action's recorded interval runs from when its rank
was free to work on it (its previous action's end, pushed back by any wait for an incoming
message) to its end, so bookkeeping between actions (posting sends and receives) is charged to
the action it prepares and idle time is only time spent waiting for messages.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pipetune.plan.plan import IterationPlan, PlanError
from pipetune.schedule.lowering import lower
from pipetune.schedule.table import Action, Op
from pipetune.simulate.simulator import TimedAction
from torchtitan_patches.data.micro_batch import GlobalBatch
from torchtitan_patches.model.vlm import BackboneStage, VisionEncoder, token_loss_sum

MAX_MICRO_BATCHES = 1 << 16
OPS = {"E": Op.ENCODER, "F": Op.FORWARD, "B": Op.BACKWARD}


class PlanMismatchError(PlanError):
    """Ranks disagree about the plan or the batch: running it would deadlock or corrupt gradients."""


@dataclass
class StepResult:
    """One rank's view of a step. ``loss`` is the batch loss (last-stage rank only);
    ``timeline`` holds this rank's compute actions (absolute ``perf_counter`` seconds);
    ``overhead_s`` is the per-step set-up of a new plan on this rank (plan digest + lowering; the
    digest exchange itself is a synchronisation point, not counted)."""

    losses: dict[int, float] = field(default_factory=dict)
    timeline: list[TimedAction] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    overhead_s: float = 0.0

    @property
    def loss(self) -> float | None:
        return sum(self.losses.values()) if self.losses else None


def _tag(stage: int, backward: bool, mb: int) -> int:
    return (2 * stage + int(backward)) * MAX_MICRO_BATCHES + mb


class PlanExecutor:
    """Executes plans for the stages ``stages`` (stage index -> module) held by ``rank``.

    ``encoder`` must be given on the rank of stage 0 when the model has one. ``group`` is the
    pipeline process group (default: the world).
    """

    def __init__(
        self, stages: dict[int, BackboneStage], encoder: VisionEncoder | None, *, dim: int, rank: int, group=None, dtype=torch.float32
    ):
        self.stages = stages
        self.encoder = encoder
        self.dim = dim
        self.rank = rank
        self.group = group
        self.dtype = dtype

    def _digest(self, batch: GlobalBatch, plan: IterationPlan) -> str:
        shapes = [(mb.num_tokens, mb.num_images) for mb in batch.micro_batches]
        blob = repr((plan.step, plan.ranks, plan.micro_batches, plan.stage_rank, batch.step, shapes, batch.num_label_tokens))
        return hashlib.sha256(blob.encode()).hexdigest()

    def check_consistent(self, batch: GlobalBatch, plan: IterationPlan, mine: str) -> None:
        """All ranks must run the same plan on the same batch shapes (one small all-gather of digests)."""
        digests = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(digests, (mine, plan.num_micro_batches, [mb.num_tokens for mb in batch.micro_batches]), group=self.group)
        if len({d[0] for d in digests}) > 1:
            detail = "; ".join(f"rank {r}: {d[1]} micro-batches of {d[2]} tokens" for r, d in enumerate(digests))
            raise PlanMismatchError(f"step {plan.step}: ranks disagree about the plan or batch ({detail})")

    def run(self, batch: GlobalBatch, plan: IterationPlan) -> StepResult:
        t0 = time.perf_counter()
        if batch.sample_ids != [list(mb) for mb in plan.micro_batches]:
            raise PlanMismatchError(f"rank {self.rank}: batch {batch.step} was not packed as plan {plan.step} says")
        digest = self._digest(batch, plan)
        steps = lower(plan.table(), self.rank)
        overhead = time.perf_counter() - t0
        self.check_consistent(batch, plan, digest)
        st = _StepState(batch, plan, StepResult(start=time.perf_counter(), overhead_s=overhead))
        mbs = batch.micro_batches
        ready = st.res.start  # when this rank could start on its next action (see the module doc)
        for step in steps:
            kind, s, i = step.kind, step.stage, step.mb
            if kind.startswith("RECV_"):
                buf = torch.empty(1, mbs[i].num_tokens, self.dim, dtype=self.dtype)
                work = dist.irecv(buf, src=step.peer, group=self.group, tag=_tag(s, kind == "RECV_B", i))
                st.recvs[(kind[-1], s, i)] = (work, buf)
            elif kind.startswith("WAIT_"):
                waiting_from = time.perf_counter()
                st.recvs[(kind[-1], s, i)][0].wait()
                ready += time.perf_counter() - waiting_from
            elif kind.startswith("SEND_"):
                if kind == "SEND_F":
                    tensor, tag = st.saved[(s, i)][1].detach().contiguous(), _tag(s + 1, False, i)
                else:
                    tensor, tag = st.saved.pop((s, i))[0].grad.contiguous(), _tag(s - 1, True, i)
                st.sends.append(dist.isend(tensor, dst=step.peer, group=self.group, tag=tag))
            else:
                if kind == "E":
                    with torch.no_grad():
                        st.features[i] = self.encoder(mbs[i].pixel_values.to(self.dtype)) if mbs[i].num_images else None
                elif kind == "F":
                    self._forward(st, s, i)
                else:
                    self._backward(st, s, i)
                done = time.perf_counter()
                st.res.timeline.append(TimedAction(self.rank, Action(s, OPS[kind], i), ready, done))
                ready = done
        for w in st.sends:
            w.wait()
        res = st.res
        res.end = time.perf_counter()
        precomputed = _precomputed(plan, self.rank)
        res.timeline = [TimedAction(t.rank, t.action, t.start, t.end, precomputed=t.action in precomputed) for t in res.timeline]
        return res

    def _forward(self, st: "_StepState", s: int, i: int) -> None:
        mb = st.batch.micro_batches[i]
        stage = self.stages[s]
        kwargs = {"positions": mb.positions[None], "cu_seqlens": mb.cu_seqlens}
        if stage.is_first:
            x = mb.tokens[None]
            if st.plan.encoder:
                kwargs.update(image_features=st.features.pop(i), image_token_index=mb.image_token_index)
        else:
            x = st.local.pop(("F", s, i)) if ("F", s, i) in st.local else st.recvs.pop(("F", s, i))[1]
            x.requires_grad_(True)
        y = stage(x, **kwargs)
        if s == st.plan.num_stages - 1:
            loss = token_loss_sum(y, mb.labels[None]) / st.batch.num_label_tokens
            st.res.losses[i] = float(loss.detach())
            y = loss
        elif st.plan.stage_rank[s + 1] == self.rank:
            st.local[("F", s + 1, i)] = y.detach()
        st.saved[(s, i)] = (x, y)

    def _backward(self, st: "_StepState", s: int, i: int) -> None:
        x, y = st.saved[(s, i)]
        if s == st.plan.num_stages - 1:
            y.backward()
        else:
            grad = st.local.pop(("B", s, i)) if ("B", s, i) in st.local else st.recvs.pop(("B", s, i))[1]
            torch.autograd.backward(y, grad)
        if s > 0 and st.plan.stage_rank[s - 1] == self.rank:
            st.local[("B", s - 1, i)] = st.saved.pop((s, i))[0].grad
        elif s == 0:
            st.saved.pop((s, i))


@dataclass
class _StepState:
    """What one step keeps between actions: posted receives, pending sends, saved activations for
    backward, same-rank hand-overs between stages, encoder features waiting for their forward."""

    batch: GlobalBatch
    plan: IterationPlan
    res: StepResult
    recvs: dict = field(default_factory=dict)
    sends: list = field(default_factory=list)
    saved: dict = field(default_factory=dict)
    local: dict = field(default_factory=dict)
    features: dict = field(default_factory=dict)


def _precomputed(plan: IterationPlan, rank: int) -> set[Action]:
    """Encoder actions of ``rank`` that do not sit right before their own stage-0 forward."""
    acts = [Action.parse(a) for a in plan.ranks[rank]]
    return {
        a
        for k, a in enumerate(acts)
        if a.op is Op.ENCODER and not (k + 1 < len(acts) and acts[k + 1] == Action(0, Op.FORWARD, a.mb))
    }
