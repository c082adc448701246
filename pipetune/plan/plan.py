"""``IterationPlan``: everything the runtime needs to execute one iteration, and nothing it must recompute."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from pipetune.cost.cost_model import MicroBatchShapes
from pipetune.data.batch import BatchMeta
from pipetune.packing.packing import Packing
from pipetune.schedule.schedules import SCHEDULES, place_encoders
from pipetune.schedule.table import Action, ScheduleTable

PLAN_FORMAT = "pipetune.iteration_plan"
PLAN_VERSION = 1


class PlanError(ValueError):
    """A plan that must not be executed; the message says why."""


@dataclass(frozen=True)
class IterationPlan:
    """One iteration: micro-batches (sample ids; index = micro-batch id), execution order, and
    each rank's action list (``0E3`` = encoder of micro-batch 3, possibly pre-computed).

    ``predicted_s`` / ``lower_bound_s`` come from the simulator: ``predicted_s`` is the expected
    iteration time under per-action jitter when the planner drew jitter (``PlannerConfig.jitter_draws``
    with a table that has a variability model), else the deterministic simulation; the bound is
    always deterministic (and below both). ``estimate`` says whether the latencies behind them were
    analytical. ``fallback`` marks a plan returned because the search
    ran out of time.
    """

    step: int
    mode: str
    mbs: int
    max_seq_len: int
    num_stages: int
    micro_batches: tuple[tuple[int, ...], ...]
    order: tuple[int, ...]
    ranks: tuple[tuple[str, ...], ...]
    stage_rank: tuple[int, ...]
    encoder: bool
    predicted_s: float
    lower_bound_s: float
    peak_bytes: tuple[float, ...]
    estimate: bool
    search_s: float = 0.0
    fallback: bool = False

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

    def table(self) -> ScheduleTable:
        return ScheduleTable(
            num_stages=self.num_stages,
            num_micro_batches=self.num_micro_batches,
            stage_rank=self.stage_rank,
            ranks=tuple(tuple(Action.parse(a) for a in r) for r in self.ranks),
            encoder=self.encoder,
            name=self.mode,
        )

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
        raw = json.loads(text)
        if raw.get("format") != PLAN_FORMAT or raw.get("version") != PLAN_VERSION:
            raise PlanError(f"not a version-{PLAN_VERSION} pipetune iteration plan")
        raw.pop("format")
        raw.pop("version")
        try:
            plan = cls(
                **{
                    **raw,
                    "micro_batches": tuple(tuple(int(x) for x in mb) for mb in raw["micro_batches"]),
                    "order": tuple(int(x) for x in raw["order"]),
                    "ranks": tuple(tuple(r) for r in raw["ranks"]),
                    "stage_rank": tuple(raw["stage_rank"]),
                    "peak_bytes": tuple(raw["peak_bytes"]),
                }
            )
        except (KeyError, TypeError) as e:
            raise PlanError(f"iteration plan is malformed: {e}") from e
        return plan.validate(batch_ids)


def build_plan(
    *,
    step: int,
    micro_batches,
    order,
    num_stages: int,
    encoder: bool,
    mbs: int,
    max_seq_len: int,
    mode: str = "manual",
    schedule: str = "1f1b",
    encoder_before: dict[int, int] | None = None,
    predicted_s: float = 0.0,
    lower_bound_s: float = 0.0,
    peak_bytes: tuple[float, ...] = (),
    estimate: bool = False,
    search_s: float = 0.0,
    fallback: bool = False,
) -> IterationPlan:
    """A plan from its decisions: sample-id micro-batches, their order, encoder placements
    (``encoder_before[mb]`` = position in stage 0's rank list, see ``place_encoders``)."""
    order = [int(x) for x in order]
    table = SCHEDULES[schedule](num_stages, order, encoder=encoder)
    if encoder and encoder_before:
        table = place_encoders(table, encoder_before)
    return IterationPlan(
        step=step,
        mode=mode,
        mbs=mbs,
        max_seq_len=max_seq_len,
        num_stages=num_stages,
        micro_batches=tuple(tuple(int(x) for x in mb) for mb in micro_batches),
        order=tuple(order),
        ranks=tuple(tuple(str(a) for a in r) for r in table.ranks),
        stage_rank=table.stage_rank,
        encoder=encoder,
        predicted_s=predicted_s,
        lower_bound_s=lower_bound_s,
        peak_bytes=tuple(peak_bytes),
        estimate=estimate,
        search_s=search_s,
        fallback=fallback,
    )
