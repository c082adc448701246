"""A replica's source of every step's plan in a ``PipeTuneTrainer`` job (torch-free); each
data-parallel replica's lead rank holds one and plans its own share (``ReplicaShare``).

Which plan a step runs, in order of precedence:

1. ``replay``: a plan recorded by an earlier job of the same configuration (its ``steps.jsonl``),
   validated against this step's batch: the same plans timed again (benchmarks repeat runs so)
   or a run's plans reproduced (this replica's, of a job at the same data-parallel degree).
2. Calibration steps (the first ``calibrate_steps`` batches): balanced plans cycling through every
   micro-batch size, so the online calibration has seen each size's per-call costs before the
   planner compares sizes by them. They train like any other step.
3. Otherwise the job's planner (``AsyncPlanner``, planning ahead), unless the measured guard
   (``pipetune.serve.guard``, pipetune mode only) asks for the baseline: the best fixed
   configuration (packer and micro-batch size chosen once on sampled batches), which is also
   planned for every batch so that the guard compares both predictions on the same batch. When
   the job's planner fails (its process died or stopped answering), the step runs the
   planner's fallback (the balanced packing at the last good micro-batch size), and
   ``StepPlan.fallback_reason`` says why; so does a search that passed its budget.

Whatever runs, every plan of a step packs this replica's share of one split (the job's, see
``ReplicaShare``), so the replicas' plans partition the batch even when one replica falls back,
replays or runs the baseline and the others do not.

For the guard, both plans of a batch are priced by the same model: the calibration's current one
(deterministic simulation). The tuned plan's own ``predicted_s`` was made ``plan_ahead`` batches
earlier by an older model, and right after the calibration steps the model moves by several per
cent a step; comparing it with a baseline priced now made the guard fall back on that
difference alone.
Per step it keeps a ``StepPlan`` (which kind ran, both prices) for the trainer's record.

A step's plan is a ``SharePlan``: this replica's one plan and its share's metadata, which the
planner process cut from the global batch, so the lead never reads the global batch itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipetune.data.batch import BatchMeta
from pipetune.serve.async_planner import AsyncPlanner
from pipetune.serve.guard import Guard, PlanKind
from pipetune.plan.plan import IterationPlan, PlanError
from pipetune.plan.search.planner import Planner
from pipetune.plan.data_parallel.replicas import ReplicaPlans, ReplicaShare, SharePlan
from pipetune.calibrate.online import simulate_plan
from pipetune.cost import CostModel
from pipetune.records import StepKind, StepRecord


@dataclass(frozen=True)
class StepPlan:
    """What a replica decided for one step: its plan of its share, why it runs, the predicted time
    of the job's own plan and of the baseline's for the same share (with a guard: both by the
    current model; ``nan`` where not planned), and why it is a fallback plan (``""``: it is not)."""

    plan: SharePlan
    kind: StepKind
    tuned_predicted_s: float
    baseline_predicted_s: float
    fallback_reason: str = ""


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
    """``tuned``: an ``AsyncPlanner`` of a ``SharePlanner`` of ``share``, whose process reads and
    splits each global batch and returns this replica's share with its plan; ``baseline`` and
    ``calibration`` are plain planners given that share. ``read``: batch metadata by step, read
    here only where the planner process cannot give the share (a replay, or a fallback after the
    process failed)."""

    def __init__(self, tuned: AsyncPlanner | None, *, read: Callable[[int], BatchMeta], share: ReplicaShare = ReplicaShare(1),
                 baseline: Planner | None = None, calibration: list[Planner] = (), calibrate_steps: int = 0, guard: Guard | None = None,
                 replay: dict[int, list[str]] | None = None):
        if guard is not None and baseline is None:
            raise ValueError("the guard needs a baseline planner")
        self.tuned, self.read, self.share, self.baseline, self.calibration = tuned, read, share, baseline, list(calibration)
        self.calibrate_steps = calibrate_steps if self.calibration else 0
        self.guard, self.replay = guard, replay
        self.decided: dict[int, StepPlan] = {}

    def __call__(self, step: int) -> SharePlan:
        decided = self._decide(step)
        self.decided[step] = decided
        return decided.plan

    def _decide(self, step: int) -> StepPlan:
        nan = float("nan")
        if self.replay is not None:
            return self._replayed(step)
        why = ""
        try:
            tuned = self.tuned.plan_step(step)
            if tuned.plan.fallback:
                why = "the search passed its time budget (pipetune.budget_s)"
        except PlanError as e:
            why = str(e)
            tuned = self.tuned.planner.fallback(self.read(step), why)
        share = tuned.share
        if step < self.calibrate_steps:  # the job's plan came for its share only
            plan = self.calibration[step % len(self.calibration)].plan(share)
            return StepPlan(self.share.plans(share, plan), StepKind.CALIBRATION, nan, nan)
        if self.guard is None:
            return StepPlan(tuned, StepKind.TUNED, tuned.predicted_s, nan, why)
        base = self.share.plans(share, self.baseline.plan(share))
        cost = self.baseline.cost  # the current model (set_cost reaches every planner after each step)
        tuned_s, base_s = (simulated_s(cost, p.plans, share) for p in (tuned, base))
        if self.guard.choose() is PlanKind.BASELINE:
            return StepPlan(base, StepKind.BASELINE, tuned_s, base_s)
        return StepPlan(tuned, StepKind.TUNED, tuned_s, base_s, why)

    def _replayed(self, step: int) -> StepPlan:
        recorded = self.replay.get(step)
        if recorded is None:
            raise PlanError(f"pipetune.replay has no plan for batch {step}; record a job with at least as many steps")
        if len(recorded) != self.share.replicas:
            raise PlanError(f"pipetune.replay recorded {len(recorded)} data-parallel replicas at batch {step}, this job runs "
                            f"{self.share.replicas}; a replayed job must have the same data-parallel degree")
        meta = self.read(step)
        plan = IterationPlan.from_json(recorded[self.share.replica])
        ReplicaPlans(step, (plan,), self.share.replica, self.share.replicas).validate(meta.table.ids)
        out = self.share.plans(meta.share(plan.sample_ids()), plan)
        return StepPlan(out, StepKind.REPLAY, out.predicted_s, float("nan"))

    def pop(self, batch_step: int) -> StepPlan:
        return self.decided.pop(batch_step)
