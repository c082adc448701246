"""Calibration from the runtime's own action timelines (what DIP calibrates on): online on a
sliding window of steps anchored by the calibration steps, or leaving each plan out to measure
the simulator's accuracy. Timelines of split backwards (zero-bubble plans) also fit how each
backward splits into ``I`` and ``W``, so the planner places ``W`` with measured shares. Pair-based
fits of terms a window cannot pin (the CPU testbed's contention and per-call overhead) extend this
in ``pipetune.calibrate.pairs``."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from pipetune.calibrate.action_fit import CalibrationReport, Design, Observation, Observed, Part, calibrate_design
from pipetune.cost.cost_model import CostModel
from pipetune.cost.stage_layout import StageLayout
from pipetune.cost.latency_table import CURVES, LatencyTable
from pipetune.data.batch import BatchMeta
from pipetune.plan.plan import IterationPlan
from pipetune.schedule.table import Op
from pipetune.simulate.contention import overlap_with_others
from pipetune.simulate.jitter import expected_time
from pipetune.simulate.dag import CompiledSchedule
from pipetune.simulate.simulator import SimResult, TimedAction, evaluate, simulate


def timeline_observations(timeline: list[TimedAction], plan: IterationPlan, meta: BatchMeta) -> list[Observation]:
    """Per micro-batch and backbone stage, its forward + backward time (a split backward's ``I``
    and ``W`` included) and, for a split backward, its ``I`` alone (``Part.INPUT_GRAD``: what
    calibration fits the I/W split with); per encoder action on images, its time (forward or
    backward, on its chunk, at the sub-microbatch's charged image count). A stage's forward and
    backward are summed because where the bookkeeping between them is charged is arbitrary; their
    sum is not. Each carries the seconds it overlapped other ranks' actions (the contention fit,
    ``pipetune.simulate.contention``). Activation copies (offload) run beside the compute and are
    left out of both."""
    shapes = plan.shapes(meta)
    timeline = [t for t in timeline if not t.action.op.is_copy]
    overlap = overlap_with_others([t.start for t in timeline], [t.end for t in timeline])
    work: dict[tuple[int, int], list[float]] = {}
    out, inputs = [], []
    for t, shared in zip(timeline, overlap.tolist()):
        a = t.action
        if a.is_encoder:
            j = plan.sub_mb_parent[a.unit]
            one = shapes.take([j])
            images = plan.image_sub_batch or int(one.images[0])
            if one.images[0]:
                out.append(Observation(replace(one, images=np.array([images])), t.end - t.start, stage=a.chunk, kind=Observed.ENCODER,
                                       part=Part.FWD if a.op is Op.FORWARD else Part.BWD, concurrent_s=shared))
        else:
            acc = work.setdefault((a.chunk, a.unit), [0.0, 0.0])
            acc[0] += t.end - t.start
            acc[1] += shared
            if a.op is Op.BACKWARD_INPUT:
                inputs.append(Observation(shapes.take([a.unit]), t.end - t.start, stage=a.chunk, part=Part.INPUT_GRAD, concurrent_s=shared))
    out += [Observation(shapes.take([mb]), sec, stage=s, concurrent_s=shared) for (s, mb), (sec, shared) in sorted(work.items())]
    return out + inputs


@dataclass(frozen=True)
class MeasuredStep:
    """One executed plan: the calibration rows of its action times (against the profiled curves)
    and its measured iteration time."""

    design: Design
    plan: IterationPlan
    meta: BatchMeta
    measured_s: float
    replica: int = 0

    @property
    def key(self) -> tuple[int, int]:
        """Which run this is: batch step and data-parallel replica."""
        return self.plan.step, self.replica

    @classmethod
    def from_timelines(
        cls, profiled: CostModel, timelines: list[list[TimedAction]], plan: IterationPlan, meta: BatchMeta, measured_s: float,
        replica: int = 0,
    ) -> "MeasuredStep":
        """One or more runs of ``plan`` (``measured_s`` summarises their iteration times)."""
        obs = [o for t in timelines for o in timeline_observations(t, plan, meta)]
        return cls(Design.of(profiled, obs), plan, meta, measured_s, replica)

    def slowed(self, factor: float) -> "MeasuredStep":
        """This step as a machine ``factor`` times slower would have run it."""
        return replace(self, design=replace(self.design, y=factor * self.design.y), measured_s=factor * self.measured_s)


def simulate_plan(cost: CostModel, plan: IterationPlan, meta: BatchMeta) -> SimResult:
    """``plan`` on ``meta``'s batch, timed by ``cost``."""
    return simulate(plan.table(), plan.latencies(cost, meta))


def plan_makespan(cost: CostModel, plan: IterationPlan, meta: BatchMeta, dag: CompiledSchedule) -> float:
    """``simulate_plan(cost, plan, meta).makespan`` on ``dag``, ``plan``'s compiled schedule (for a
    caller timing one plan under many models: compiled once), without the per-action detail: the
    same sums and maxima (``evaluate`` of the plan's one order)."""
    return float(evaluate(dag, plan.latencies(cost, meta), np.arange(plan.num_micro_batches)).makespan[0])


def fit_steps(base: CostModel, steps: Sequence[MeasuredStep], *, anchors: Sequence[MeasuredStep] = (), jitter_draws: int = 0,
              fit_contention: bool = True, fit_overhead: bool = True) -> tuple[CostModel, CalibrationReport]:
    """``base``'s table fitted to ``steps``: per-component scales, per-call overheads, contention
    (unless ``fit_contention=False``: ``base``'s is held), the variability model and, where split
    backwards ran, the I/W split from the action times, then every component scaled by the median
    ratio of measured to predicted iteration time (``makespan_factor``).

    ``anchors``, earlier steps of other shapes, pin how cost grows with shape; ``steps`` how fast
    the machine runs now. The anchors are first brought to that speed (``MeasuredStep.slowed`` by
    the median ratio of ``steps``' measured times to a fit of the anchors alone) and then fitted
    with ``steps``: at their own speed, a machine that has slowed since would read as ``steps``'
    shapes costing more (their per-call overheads absorb it), not as every shape costing more.

    The per-action fit predicts each action's typical time, but an iteration is a longest path
    through actions that jitter: a late message delays everything behind it while an early one
    gains nothing, so simulating typical times comes out short (by 2-4 % on the CPU test machine).
    With ``jitter_draws`` (pass the planner's ``PlannerConfig.jitter_draws``) and a fitted
    variability model, the prediction is the expected iteration time over that many draws of
    per-action noise, which accounts for part of that shortfall and, unlike a common factor, for
    its dependence on the plan; with 0, the deterministic simulation. A common factor leaves the
    ranking of plans as it was."""
    if anchors and steps:
        then = fit_steps(base, anchors, fit_contention=fit_contention, fit_overhead=fit_overhead)[0]
        drift = float(np.median([step.measured_s / simulate_plan(then, step.plan, step.meta).makespan for step in steps]))
        anchors = [step.slowed(drift) for step in anchors]
    table, report = calibrate_design(base.table, Design.stack([step.design for step in [*steps, *anchors]]), fit_contention=fit_contention,
                                     fit_overhead=fit_overhead)
    cost = CostModel(table, base.layout, recompute_encoder=base.recompute_encoder)
    variability = table.variability if jitter_draws else None

    def predicted(step: MeasuredStep) -> float:
        if variability is None:
            return simulate_plan(cost, step.plan, step.meta).makespan
        lat = step.plan.latencies(cost, step.meta)
        return expected_time(step.plan.table(), lat, variability, jitter_draws, step.plan.step)

    factor = float(np.median([step.measured_s / predicted(step) for step in steps]))
    table = replace(table, scales={n: factor * table.scale(n) for n in CURVES},
                    overhead={k: factor * v for k, v in table.overhead.items()},
                    variability=None if table.variability is None else table.variability.scaled(factor))
    return CostModel(table, base.layout, recompute_encoder=base.recompute_encoder), replace(report, makespan_factor=factor)


def _plan_key(step: MeasuredStep) -> tuple:
    return step.plan.micro_batches, step.plan.ranks


def distinct_plans(steps: Sequence[MeasuredStep]) -> int:
    return len({_plan_key(s) for s in steps})


def held_out_times(base: CostModel, steps: Sequence[MeasuredStep]) -> list[float]:
    """Each step's simulated iteration time under ``base`` fitted to the other steps, leaving out
    every run of the same plan: the simulator's accuracy once calibrated on this machine, without
    having seen the plan it predicts."""
    if distinct_plans(steps) < 2:
        raise ValueError(f"held-out calibration needs runs of at least two different plans, got {distinct_plans(steps)}")
    keys = [_plan_key(s) for s in steps]
    return [simulate_plan(fit_steps(base, [s for s, key in zip(steps, keys) if key != keys[k]])[0], step.plan, step.meta).makespan
            for k, step in enumerate(steps)]


class OnlineCalibrator:
    """Refits the profiled table to the last ``window`` runs after every step (``fit_steps``; a
    step of ``D`` data-parallel replicas adds ``D`` runs, so the trainer sizes the window in steps
    times ``D``).

    Machine speed drifts (other jobs, clocks, thermal limits) and the micro-batch sizes in use
    change, so a one-off calibration ages; refitting on a sliding window keeps the planner's
    predictions close to what the pipeline currently does. Always refits from the profiled base
    table, so errors do not compound. ``jitter_draws``: the planner's (see ``fit_steps``).

    Every fit is anchored by the calibration steps' runs (every micro-batch size; ``fit_steps``'
    ``anchors``): a window of the planner's own plans holds one or two sizes, and fitted on those
    alone the model extrapolates to the other sizes (the ones the guard's baseline runs) through
    the table's shape. The anchors shape the component fit only; the machine's current speed still
    comes from the window. Callers leave out each size's first step (``update``).

    The contention kappa (``pipetune.simulate.contention``) is held at the table's value unless
    ``fit_contention``: ranks on separate GPUs do not share compute, and in a window of one plan
    family kappa trades against the scales. ``contention`` and ``overhead`` (seconds per stage
    forward + backward call), once set (``pipetune.calibrate.pairs`` measures them on pairs of
    runs), are held in every fit.
    """

    def __init__(self, base: LatencyTable, layout: StageLayout, window: int, *, jitter_draws: int = 0,
                 recompute_encoder: bool = False, fit_contention: bool = False):
        self.base = CostModel(base, layout, recompute_encoder=recompute_encoder)
        self.steps: deque[MeasuredStep] = deque(maxlen=window)
        self.jitter_draws = jitter_draws
        self.fit_contention = fit_contention
        self.by_step: dict[tuple[int, int], dict[str, MeasuredStep]] = {}  # calibration runs, by (step, replica) and how they ran
        self.contention: float | None = None
        self.overhead: float | None = None

    def update(self, *runs: MeasuredStep, calibration: bool = False) -> tuple[CostModel, CalibrationReport]:
        """Add one step's runs (one per data-parallel replica) and refit once. ``calibration``: a
        calibration step, whose runs anchor every fit; pass ``False`` for a size's first step
        (one-off costs)."""
        self.steps.extend(runs)
        if calibration:
            for run in runs:
                self.add_calibration_run(run, "pipelined")
        return self.fit()

    def add_calibration_run(self, step: MeasuredStep, how: str) -> None:
        self.by_step.setdefault(step.key, {})[how] = step

    @property
    def calibration_runs(self) -> list[MeasuredStep]:
        return [run for same in self.by_step.values() for run in same.values()]

    def held(self) -> CostModel:
        """The base model with the terms measured on pairs so far."""
        table = self.base.table
        if self.contention is not None:
            table = replace(table, contention=self.contention)
        if self.overhead is not None:
            table = with_overhead(table, self.overhead)
        return CostModel(table, self.base.layout, recompute_encoder=self.base.recompute_encoder)

    def fit(self) -> tuple[CostModel, CalibrationReport]:
        """The base table fitted to the window, anchored by the calibration runs."""
        return fit_steps(self.held(), self.steps, anchors=self.anchors(), jitter_draws=self.jitter_draws,
                         fit_contention=self.fit_contention and self.contention is None, fit_overhead=self.overhead is None)

    def anchors(self) -> list[MeasuredStep]:
        """The calibration runs not in the window: every fit's anchors."""
        return [run for run in self.calibration_runs if not any(run is step for step in self.steps)]

    def state_dict(self) -> dict:
        return {"window": list(self.steps), "by_step": self.by_step, "contention": self.contention, "overhead": self.overhead}

    def load_state_dict(self, state: dict) -> tuple[CostModel, CalibrationReport] | None:
        """Restore and refit (``None``: nothing measured yet)."""
        self.steps.clear()
        self.steps.extend(state["window"])
        self.by_step = dict(state["by_step"])
        self.contention, self.overhead = state["contention"], state["overhead"]
        return self.fit() if self.steps else None


def with_overhead(table: LatencyTable, seconds: float) -> LatencyTable:
    """``table`` whose stage forward + backward calls pay ``seconds`` of fixed cost, half each (rows
    of a stage's forward + backward cannot tell the halves apart)."""
    return replace(table, overhead={"fwd_s": seconds / 2, "bwd_s": seconds / 2})
