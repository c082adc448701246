"""``IterationPlan``: everything the runtime needs to execute one iteration, and nothing it must recompute."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

from pipetune.cost.cost_model import CostModel, MicroBatchShapes
from pipetune.data.batch import BatchMeta
from pipetune.packing.groups import Packing
from pipetune.plan.mode import Mode
from pipetune.schedule.schedules import Schedule, place_encoders, serial
from pipetune.schedule.table import Action, Op, Placed, Placement, ScheduleError, ScheduleTable
from pipetune.simulate.simulator import Latencies

PLAN_FORMAT = "pipetune.iteration_plan"
PLAN_VERSION = 2


class PlanError(ValueError):
    """A plan that must not be executed; the message says why."""


@dataclass(frozen=True)
class IterationPlan(Placed):
    """One iteration: micro-batches (sample ids; index = micro-batch id), their order, where every
    model chunk runs (``placement``), the encoder's sub-microbatches, and each rank's action list
    (``pipetune.schedule.table``: ``0F3``, ``1B0`` backbone; ``E0F3``, ``E2B1`` encoder chunks).

    Sub-microbatch ``k`` holds images of micro-batch ``sub_mb_parent[k]``, numbered micro-batch by
    micro-batch. With ``image_sub_batch == 0`` (co-located layout) sub-microbatch ``k`` is all of
    micro-batch ``k``'s images; with ``image_sub_batch = B`` (separated layout) the ``i``-th
    sub-microbatch of a micro-batch holds its images ``i*B .. i*B + B - 1`` (the last one fewer,
    padded to ``B`` by the runtime): ``image_ranges`` lists them for a batch.

    ``order`` is the micro-batch order the schedule follows (the segment priorities of a
    separated plan). ``predicted_s`` / ``lower_bound_s`` come from the simulator: ``predicted_s``
    is the expected iteration time under per-action jitter when the planner drew jitter
    (``PlannerConfig.jitter_draws`` with a table that has a variability model), else the
    deterministic simulation; the bound is always deterministic (and below both). ``estimate``
    says whether the latencies behind them were analytical. ``fallback`` marks a plan returned
    because the search ran out of time. ``mode`` names the planner mode that made the plan; ``None``
    marks one built by hand (``plan_from_table`` without a mode).
    """

    step: int
    mode: Mode | None
    mbs: int
    max_seq_len: int
    micro_batches: tuple[tuple[int, ...], ...]
    order: tuple[int, ...]
    ranks: tuple[tuple[str, ...], ...]
    placement: Placement
    sub_mb_parent: tuple[int, ...]
    image_sub_batch: int
    predicted_s: float
    lower_bound_s: float
    peak_bytes: tuple[float, ...]
    estimate: bool
    search_s: float = 0.0
    fallback: bool = False

    def __post_init__(self) -> None:
        if self.mode is not None:
            object.__setattr__(self, "mode", Mode(self.mode))

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches)

    def sample_ids(self) -> list[int]:
        return [s for mb in self.micro_batches for s in mb]

    def shapes(self, meta: BatchMeta) -> MicroBatchShapes:
        """The cost model's view of this plan's micro-batches (``meta`` = the batch it packs)."""
        row = {int(s): k for k, s in enumerate(meta.table.ids)}
        packing = Packing.from_groups([[row[s] for s in mb] for mb in self.micro_batches], self.mbs * self.max_seq_len)
        return MicroBatchShapes.from_packing(meta.table, packing)

    def latencies(self, cost: CostModel, meta: BatchMeta) -> Latencies:
        """Every action's time under ``cost``, at this plan's image sub-microbatch size (the
        separated planner picks it per batch; ``cost``'s layout holds one)."""
        if self.separated and self.image_sub_batch != cost.layout.image_sub_batch:
            cost = cost.with_layout(replace(cost.layout, image_sub_batch=self.image_sub_batch))
        return Latencies.from_costs(cost.stage_costs(self.shapes(meta)))

    def table(self) -> ScheduleTable:
        """The schedule (split backward when its lists hold ``I`` actions)."""
        ranks = tuple(tuple(Action.parse(a) for a in r) for r in self.ranks)
        return ScheduleTable(
            placement=self.placement,
            num_micro_batches=self.num_micro_batches,
            ranks=ranks,
            sub_mb_parent=self.sub_mb_parent,
            name=str(self.mode or ""),
            split_backward=any(a.op is Op.BACKWARD_INPUT for r in ranks for a in r),
        )

    @property
    def has_serial_twin(self) -> bool:
        """Whether ``serialised`` is another schedule of this plan that contention can be measured
        against: co-located with one chunk per rank and whole backwards (the serial table runs the
        same actions) and of several micro-batches (one micro-batch already runs serially)."""
        return (self.num_micro_batches > 1 and not self.separated and self.placement.chunks_per_rank == 1
                and not self.table().split_backward)

    def serialised(self) -> "IterationPlan":
        """The same micro-batches in the same order on the ``serial`` schedule: the same actions
        with no two ranks computing at once (what the online calibration compares with this plan
        to measure contention). Co-located plans with stage ``s`` on rank ``s`` only."""
        p = self.placement
        table = serial(p.num_stages, self.order, encoder=self.encoder, encoder_trained=p.encoder_trained)
        if table.placement != p:
            raise PlanError(f"step {self.step}: only a co-located plan with stage s on rank s runs serially; this one places "
                            f"backbone chunks on ranks {list(p.backbone)} and encoder chunks on {list(p.encoder)}")
        return replace(self, ranks=tuple(tuple(str(a) for a in r) for r in table.ranks), predicted_s=float("nan"),
                       lower_bound_s=float("nan"))

    def image_ranges(self, images_per_mb) -> list[tuple[int, int, int]]:
        """``(micro-batch, first image, images)`` of every sub-microbatch, given each micro-batch's
        image count; ``PlanError`` when the sub-microbatches do not cover those images exactly."""
        counts = [int(n) for n in images_per_mb]
        if len(counts) != self.num_micro_batches:
            raise PlanError(f"step {self.step}: image counts for {len(counts)} micro-batches, the plan has {self.num_micro_batches}")
        out = []
        for j, k in enumerate(_groups(self.sub_mb_parent, self.num_micro_batches)):
            B = self.image_sub_batch
            want = 1 if B == 0 else -(-counts[j] // B)
            if len(k) != want:
                raise PlanError(f"step {self.step}: micro-batch {j} has {counts[j]} images, so it needs {want} sub-microbatches "
                                f"({'one per micro-batch' if B == 0 else f'of {B} images'}); the plan gives it {len(k)}")
            out += [(j, 0, counts[j])] if B == 0 else [(j, i * B, min(B, counts[j] - i * B)) for i in range(len(k))]
        return out

    def validate(self, batch_ids=None) -> "IterationPlan":
        """Check internal consistency (and, given the batch's sample ids, that it covers them once)."""
        m = self.num_micro_batches
        if m == 0 or any(len(mb) == 0 for mb in self.micro_batches):
            raise PlanError(f"step {self.step}: plan has an empty micro-batch or none at all")
        if sorted(self.order) != list(range(m)):
            raise PlanError(f"step {self.step}: order {list(self.order)} is not a permutation of the {m} micro-batches")
        ids = self.sample_ids()
        if len(set(ids)) != len(ids):
            raise PlanError(f"step {self.step}: a sample appears in two micro-batches")
        if batch_ids is not None and sorted(ids) != sorted(int(i) for i in batch_ids):
            missing = sorted(set(int(i) for i in batch_ids) - set(ids))
            extra = sorted(set(ids) - set(int(i) for i in batch_ids))
            raise PlanError(f"step {self.step}: plan does not cover the batch (missing {missing[:5]}, extra {extra[:5]})")
        if self.image_sub_batch < 0:
            raise PlanError(f"step {self.step}: image_sub_batch must be >= 0, got {self.image_sub_batch}")
        if self.encoder and self.placement.colocated_encoder and (self.image_sub_batch or self.sub_mb_parent != tuple(range(m))):
            raise PlanError(f"step {self.step}: the co-located layout has one sub-microbatch per micro-batch (sub_mb_parent 0..{m - 1}, "
                            f"image_sub_batch 0), got sub_mb_parent {list(self.sub_mb_parent)[:8]} and image_sub_batch {self.image_sub_batch}")
        if self.separated and self.image_sub_batch < 1:
            raise PlanError(f"step {self.step}: a separated plan needs image_sub_batch >= 1 (images per sub-microbatch)")
        if len(self.peak_bytes) not in (0, self.placement.num_ranks):
            raise PlanError(f"step {self.step}: peak_bytes has {len(self.peak_bytes)} entries for {self.placement.num_ranks} ranks")
        try:
            self.table().validate()
        except ValueError as e:
            raise PlanError(f"step {self.step}: {e}") from e
        return self

    def to_json(self) -> str:
        return json.dumps({"format": PLAN_FORMAT, "version": PLAN_VERSION, **asdict(self)})

    @classmethod
    def from_json(cls, text: str, batch_ids=None) -> "IterationPlan":
        """Parse and validate (against the batch's sample ids, when given)."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"iteration plan is not JSON: {e}") from None
        if not isinstance(raw, dict) or raw.get("format") != PLAN_FORMAT or raw.get("version") != PLAN_VERSION:
            raise PlanError(f"not a version-{PLAN_VERSION} pipetune iteration plan")
        raw.pop("format")
        raw.pop("version")
        try:
            p = raw["placement"]
            plan = cls(
                **{
                    **raw,
                    "micro_batches": tuple(tuple(int(x) for x in mb) for mb in raw["micro_batches"]),
                    "order": tuple(int(x) for x in raw["order"]),
                    "ranks": tuple(tuple(r) for r in raw["ranks"]),
                    "placement": Placement(tuple(p["backbone"]), tuple(p["encoder"]), bool(p["encoder_trained"])),
                    "sub_mb_parent": tuple(int(x) for x in raw["sub_mb_parent"]),
                    "image_sub_batch": int(raw["image_sub_batch"]),
                    "peak_bytes": tuple(raw["peak_bytes"]),
                }
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"iteration plan is malformed: {type(e).__name__}: {e}") from None
        return plan.validate(batch_ids)


def _groups(parent, m: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(m)]
    for k, j in enumerate(parent):
        out[j].append(k)
    return out


def plan_from_table(
    table: ScheduleTable,
    *,
    step: int,
    micro_batches,
    order,
    mbs: int,
    max_seq_len: int,
    image_sub_batch: int = 0,
    mode: Mode | None = None,
    predicted_s: float = 0.0,
    lower_bound_s: float = 0.0,
    peak_bytes: tuple[float, ...] = (),
    estimate: bool = False,
    search_s: float = 0.0,
    fallback: bool = False,
) -> IterationPlan:
    """A plan that runs ``table`` on these sample-id micro-batches."""
    return IterationPlan(
        step=step,
        mode=mode,
        mbs=mbs,
        max_seq_len=max_seq_len,
        micro_batches=tuple(tuple(int(x) for x in mb) for mb in micro_batches),
        order=tuple(int(x) for x in order),
        ranks=tuple(tuple(str(a) for a in r) for r in table.ranks),
        placement=table.placement,
        sub_mb_parent=table.sub_mb_parent,
        image_sub_batch=image_sub_batch,
        predicted_s=predicted_s,
        lower_bound_s=lower_bound_s,
        peak_bytes=tuple(peak_bytes),
        estimate=estimate,
        search_s=search_s,
        fallback=fallback,
    )


def build_plan(
    *,
    step: int,
    micro_batches,
    order,
    num_stages: int,
    encoder: bool,
    mbs: int,
    max_seq_len: int,
    encoder_trained: bool = False,
    schedule: Schedule = Schedule.ONE_F_ONE_B,
    chunks_per_rank: int = 1,
    split_backward: bool = False,
    encoder_before: dict[int, int] | None = None,
    **fields,
) -> IterationPlan:
    """A co-located plan from its decisions: sample-id micro-batches, their order, encoder
    placements (``encoder_before[mb]`` = position in stage 0's rank list, see ``place_encoders``);
    ``fields``: the other ``plan_from_table`` arguments (mode, predictions, ...)."""
    try:
        table = Schedule(schedule).build(num_stages, order, encoder=encoder, encoder_trained=encoder_trained,
                                         chunks_per_rank=chunks_per_rank, split_backward=split_backward)
        if encoder and encoder_before:
            table = place_encoders(table, encoder_before)
    except ScheduleError as e:
        raise PlanError(f"step {step}: {e}") from e
    return plan_from_table(table, step=step, micro_batches=micro_batches, order=order, mbs=mbs, max_seq_len=max_seq_len, **fields)
