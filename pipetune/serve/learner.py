"""What a replica's lead rank learns from each run of its plan: the online refit, the per-mbs correction and the
guard's judgement.

The trainer calls ``Learner.observe`` after every step, and the benchmarks replay a job's records
through the same call, so a re-analysis learns exactly what the job learnt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipetune.calibrate.correction import FamilyCorrection
from pipetune.calibrate.online import MeasuredStep, OnlineCalibrator
from pipetune.cost.cost_model import CostModel
from pipetune.cost.latency_table import LatencyTable
from pipetune.data.batch import BatchMeta
from pipetune.serve.guard import Decision, Guard, GuardState, PlanKind
from pipetune.plan.plan import IterationPlan
from pipetune.plan.data_parallel.replicas import ReplicaPlans
from pipetune.records import StepKind, StepRecord


def call_overhead_s(table: LatencyTable) -> float:
    """Fixed seconds of one stage forward + backward call."""
    return table.fixed("fwd") + table.fixed("bwd")


@dataclass(frozen=True)
class Learned:
    """What changed: the model every planner prices with from now on, the per-mbs factors the
    planner compares sizes with, and the guard's state before and its decision (``None``: no
    change, or not judged)."""

    cost: CostModel | None = None
    factors: dict[int, float] | None = None
    guard: tuple[GuardState, Decision] | None = None


class Learner:
    """A lead's learning: ``calibrator`` refits the profiled model (``profiled``) to recent steps,
    ``correction`` tracks each micro-batch size's bias, ``guard`` judges pipetune's plans against
    the baseline. Each part may be ``None`` (off)."""

    def __init__(self, profiled: CostModel, *, calibrator: OnlineCalibrator | None = None,
                 correction: FamilyCorrection | None = None, guard: Guard | None = None):
        self.profiled, self.calibrator, self.correction, self.guard = profiled, calibrator, correction, guard

    def measured(self, record: StepRecord, plan: IterationPlan, meta: BatchMeta) -> MeasuredStep:
        return MeasuredStep.from_timelines(self.profiled, [record.timed_actions()], plan, meta, record.measured_s, record.replica)

    def observe(self, records: Sequence[StepRecord], plans: ReplicaPlans, meta: BatchMeta) -> Learned:
        """Learn from the step's runs of ``plans`` on batch ``meta`` (one record per data-parallel
        replica, in replica order) and note it in the records. The job's first step (one-off
        warm-up costs) and replays teach nothing; a size's first step (``cold``) refits the window
        but does not anchor later fits. Every replica's timeline feeds the refit and the per-mbs
        correction; the guard judges the step, which lasts as long as its slowest replica."""
        first = records[0]
        if first.step == 1 or first.kind is StepKind.REPLAY:
            return Learned()
        cost = factors = judged = None
        if self.calibrator is not None:
            runs = [self.measured(r, p, m) for r, p, m in zip(records, plans.plans, plans.metas(meta))]
            cost, _ = self.calibrator.update(*runs, calibration=first.kind is StepKind.CALIBRATION and not any(r.cold for r in records))
            for r in records:
                r.contention, r.call_overhead_s = cost.table.contention, call_overhead_s(cost.table)
        if self.correction is not None:
            for r in records:
                self.correction.observe(r.mbs, r.measured_s, r.predicted_s)
            factors = self.correction.factors()
        if self.guard is not None and first.kind in (StepKind.TUNED, StepKind.BASELINE):
            kind = PlanKind(first.kind.value)
            before = self.guard.state
            ran_s = first.tuned_predicted_s if kind is PlanKind.TUNED else first.baseline_predicted_s
            d = self.guard.observe(kind, max(r.measured_s for r in records), ran_s, first.baseline_predicted_s)
            for r in records:
                r.guard, r.guard_advantage = d.state.value, d.advantage
            judged = (before, d)
        return Learned(cost, factors, judged)

    def state_dict(self) -> dict:
        return {name: part.state_dict() if part is not None else None
                for name, part in (("calibrator", self.calibrator), ("correction", self.correction), ("guard", self.guard))}

    def load_state_dict(self, state: dict) -> Learned:
        """Restore every part that is on and saved; returns the model and factors to plan with."""
        for name in ("correction", "guard"):
            part = getattr(self, name)
            if part is not None and state.get(name) is not None:
                part.load_state_dict(state[name])
        fitted = None
        if self.calibrator is not None and state.get("calibrator") is not None:
            fitted = self.calibrator.load_state_dict(state["calibrator"])
        return Learned(fitted[0] if fitted else None, self.correction.factors() if self.correction is not None else None)
