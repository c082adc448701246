"""Rank 0's source of every step's plan in a ``PipeTuneTrainer`` job (torch-free).

Which plan a step runs, in order of precedence:

1. ``replay``: a plan recorded by an earlier job of the same configuration (its ``steps.jsonl``),
   validated against this step's batch: the same plans timed again (benchmarks repeat runs so)
   or a run's plans reproduced.
2. Calibration steps (the first ``calibrate_steps`` batches): balanced plans cycling through every
   micro-batch size, so the online calibration has seen each size's per-call costs before the
   planner compares sizes by them. They train like any other step.
3. Otherwise the job's planner (``AsyncPlanner``, planning ahead), unless the measured guard
   (``pipetune.plan.guard``, pipetune mode only) asks for the baseline: the best fixed
   configuration (packer and micro-batch size chosen once on sampled batches), which is also
   planned for every batch so that the guard compares both predictions on the same batch.

For the guard, both plans of a batch are priced by the same model: the calibration's current one
(deterministic simulation). The tuned plan's own ``predicted_s`` was made ``plan_ahead`` batches
earlier by an older model, and right after the calibration steps the model moves by several per
cent a step; comparing it with a baseline priced now made the guard fall back on that
difference alone.
Per step it keeps a ``StepPlan`` (which kind ran, both prices) for the trainer's record.

Every planner here plans a step for all data-parallel replicas (``ReplicaPlanner``), so a step's
plan is a ``ReplicaPlans`` (one plan with a single replica) and its price is its slowest
replica's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipetune.data.batch import BatchMeta
from pipetune.plan.async_planner import AsyncPlanner
from pipetune.plan.guard import Guard, PlanKind
from pipetune.plan.plan import IterationPlan, PlanError
from pipetune.plan.replicas import ReplicaPlanner, ReplicaPlans
from pipetune.calibrate.online import simulate_plan
from pipetune.cost import CostModel
from pipetune.records import StepKind, StepRecord


@dataclass(frozen=True)
class StepPlan:
    """What rank 0 decided for one step: the replicas' plans, why they run, and the predicted
    time of the job's own plans and of the baseline's for the same batch (with a guard: both by
    the current model; ``nan`` where not planned)."""

    plans: ReplicaPlans
    kind: StepKind
    tuned_predicted_s: float
    baseline_predicted_s: float


def load_replay(path: str | Path) -> dict[int, list[str]]:
    """Plans by batch step, one per replica in replica order, from a job's ``steps.jsonl`` (the
    step's own runs: ``extra_run`` records of an extension, such as the CPU testbed's twins, left
    out)."""
    out: dict[int, dict[int, str]] = {}
    try:
        records = StepRecord.read(path)
    except ValueError as e:
        raise ValueError(f"pipetune.replay: {e}") from None
    for r in records:
        if r.extra_run:
            continue
        if r.replica in out.setdefault(r.batch, {}):
            raise ValueError(f"pipetune.replay: {path} records batch {r.batch} twice; give one job's steps.jsonl")
        out[r.batch][r.replica] = r.plan
    if not out:
        raise ValueError(f"pipetune.replay: {path} holds no step records; give the steps.jsonl of a job that ran")
    for batch, plans in out.items():
        if sorted(plans) != list(range(len(plans))):
            raise ValueError(f"pipetune.replay: {path} records replicas {sorted(plans)} of batch {batch}; every replica's plan is needed")
    return {batch: [plans[r] for r in range(len(plans))] for batch, plans in out.items()}


def simulated_s(cost: CostModel, plans: ReplicaPlans, meta: BatchMeta) -> float:
    """The step's time by ``cost``: its slowest replica's simulated time."""
    return max(simulate_plan(cost, p, m).makespan for p, m in zip(plans.plans, plans.metas(meta)))


class PlanSource:
    def __init__(self, tuned: AsyncPlanner | None, *, baseline: ReplicaPlanner | None = None, calibration: list[ReplicaPlanner] = (),
                 calibrate_steps: int = 0, guard: Guard | None = None, replay: dict[int, list[str]] | None = None):
        if guard is not None and baseline is None:
            raise ValueError("the guard needs a baseline planner")
        self.tuned, self.baseline, self.calibration = tuned, baseline, list(calibration)
        self.calibrate_steps = calibrate_steps if self.calibration else 0
        self.guard, self.replay = guard, replay
        self.decided: dict[int, StepPlan] = {}

    def __call__(self, meta: BatchMeta) -> ReplicaPlans:
        step = self._decide(meta)
        self.decided[meta.step] = step
        return step.plans

    def _decide(self, meta: BatchMeta) -> StepPlan:
        nan = float("nan")
        if self.replay is not None:
            if meta.step not in self.replay:
                raise PlanError(f"pipetune.replay has no plan for batch {meta.step}; record a job with at least as many steps")
            plans = ReplicaPlans(meta.step, tuple(IterationPlan.from_json(p) for p in self.replay[meta.step])).validate(meta.table.ids)
            return StepPlan(plans, StepKind.REPLAY, plans.predicted_s, nan)
        if meta.step < self.calibrate_steps:
            plan = self.calibration[meta.step % len(self.calibration)].plan(meta)
            return StepPlan(plan, StepKind.CALIBRATION, nan, nan)
        tuned = self.tuned.plan(meta)
        if self.guard is None:
            return StepPlan(tuned, StepKind.TUNED, tuned.predicted_s, nan)
        base = self.baseline.plan(meta)
        cost = self.baseline.cost  # the current model (set_cost reaches every planner after each step)
        tuned_s, base_s = (simulated_s(cost, p, meta) for p in (tuned, base))
        if self.guard.choose() is PlanKind.BASELINE:
            return StepPlan(base, StepKind.BASELINE, tuned_s, base_s)
        return StepPlan(tuned, StepKind.TUNED, tuned_s, base_s)

    def pop(self, batch_step: int) -> StepPlan:
        return self.decided.pop(batch_step)
