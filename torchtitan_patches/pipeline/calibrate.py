"""Calibration from the runtime's own action timelines (what DIP calibrates on): once, online, or
leaving each plan out to measure the simulator's accuracy."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

import numpy as np

from pipetune.cost.calibration import (CONTENTION_GRID, OVERHEAD_GRID, CalibrationReport, Design, Observation, Observed, Part,
                                       calibrate_design)
from pipetune.cost.cost_model import CostModel
from pipetune.cost.latency_table import CURVES, LatencyTable
from pipetune.cost.stage_layout import StageLayout
from pipetune.data.batch import BatchMeta
from pipetune.plan.plan import IterationPlan
from pipetune.schedule.table import Op
from pipetune.simulate.contention import overlap_with_others
from pipetune.simulate.jitter import expected_time
from pipetune.simulate.simulator import Latencies, SimResult, TimedAction, simulate


def timeline_observations(timeline: list[TimedAction], plan: IterationPlan, meta: BatchMeta) -> list[Observation]:
    """Per micro-batch and backbone stage, its forward + backward time; per encoder action on
    images, its time (forward or backward, on its chunk, at the sub-microbatch's charged image
    count). A stage's forward and backward are summed because where the bookkeeping between them
    is charged is arbitrary; their sum is not. Each carries the seconds it overlapped other ranks'
    actions (the contention fit, ``pipetune.simulate.contention``)."""
    shapes = plan.shapes(meta)
    overlap = overlap_with_others([t.start for t in timeline], [t.end for t in timeline])
    work: dict[tuple[int, int], list[float]] = {}
    out = []
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
    out += [Observation(shapes.take([mb]), sec, stage=s, concurrent_s=shared) for (s, mb), (sec, shared) in sorted(work.items())]
    return out


@dataclass(frozen=True)
class MeasuredStep:
    """One executed plan: the calibration rows of its action times (against the profiled curves)
    and its measured iteration time."""

    design: Design
    plan: IterationPlan
    meta: BatchMeta
    measured_s: float

    @classmethod
    def from_timelines(
        cls, profiled: CostModel, timelines: list[list[TimedAction]], plan: IterationPlan, meta: BatchMeta, measured_s: float
    ) -> "MeasuredStep":
        """One or more runs of ``plan`` (``measured_s`` summarises their iteration times)."""
        obs = [o for t in timelines for o in timeline_observations(t, plan, meta)]
        return cls(Design.of(profiled, obs), plan, meta, measured_s)

    def slowed(self, factor: float) -> "MeasuredStep":
        """This step as a machine ``factor`` times slower would have run it."""
        return replace(self, design=replace(self.design, y=factor * self.design.y), measured_s=factor * self.measured_s)


def simulate_plan(cost: CostModel, plan: IterationPlan, meta: BatchMeta) -> SimResult:
    """``plan`` on ``meta``'s batch, timed by ``cost``."""
    return simulate(plan.table(), Latencies.from_costs(cost.stage_costs(plan.shapes(meta))))


def fit_steps(base: CostModel, steps: Sequence[MeasuredStep], *, anchors: Sequence[MeasuredStep] = (), jitter_draws: int = 0,
              fit_contention: bool = True, fit_overhead: bool = True) -> tuple[CostModel, CalibrationReport]:
    """``base``'s table fitted to ``steps``: per-component scales, per-call overheads, contention
    (unless ``fit_contention=False``: ``base``'s is held) and the variability model from the action
    times, then every component scaled by the median ratio of measured to predicted iteration time
    (``makespan_factor``).

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
        lat = Latencies.from_costs(cost.stage_costs(step.plan.shapes(step.meta)))
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


def _best_ratio_fit(base: CostModel, design: Design, pairs: Sequence[tuple[MeasuredStep, MeasuredStep]], grid,
                    held, *, fit_contention: bool, fit_overhead: bool, penalty=np.square) -> float:
    """The value on ``grid`` whose model (``held(table, value)``, then fitted to ``design``'s rows)
    best predicts each pair's measured ratio of iteration times (least ``penalty`` of the log
    ratios' errors)."""
    measured = np.log([a.measured_s / b.measured_s for a, b in pairs])

    def loss(value: float) -> float:
        table, _ = calibrate_design(held(base.table, value), design, fit_contention=fit_contention, fit_overhead=fit_overhead)
        cost = CostModel(table, base.layout, recompute_encoder=base.recompute_encoder)
        ratio = [simulate_plan(cost, a.plan, a.meta).makespan / simulate_plan(cost, b.plan, b.meta).makespan for a, b in pairs]
        return float(np.sum(penalty(np.log(ratio) - measured)))

    return float(min(grid, key=loss))


def twin_contention(base: CostModel, runs: Sequence[MeasuredStep], twins: Sequence[tuple[MeasuredStep, MeasuredStep]], *,
                    fit_overhead: bool = True) -> float:
    """The contention kappa (on ``CONTENTION_GRID``) whose model, ``base`` fitted to ``runs`` with
    kappa held (and ``base``'s per-call overhead too, with ``fit_overhead=False``), best predicts
    each ``(pipelined, serial)`` twin's measured ratio of iteration times (least squares of log
    ratios).

    The ratio, not the action times: what contention costs a plan is how much longer its
    overlapped iteration takes, and on a loaded CPU the action times do not add up to the
    iteration times. Replayed along their dependencies, a serial run's recorded action times
    exceeded its measured iteration time by 0.2-3.0 % beside one CPU-bound process (0.0 % on a
    quiet machine), and kappa fitted to the action times came out 0.30-0.50 on the pairs of
    ``benchmarks/sim_vs_real.py``'s background runs, where their ratios want 0.50-0.75."""
    if not twins:
        raise ValueError("twin_contention needs at least one (pipelined, serial) pair of runs")
    return _best_ratio_fit(base, Design.stack([run.design for run in runs]), twins, CONTENTION_GRID.tolist(),
                           lambda table, kappa: replace(table, contention=kappa), fit_contention=False, fit_overhead=fit_overhead)


def with_overhead(table: LatencyTable, seconds: float) -> LatencyTable:
    """``table`` whose stage forward + backward calls pay ``seconds`` of fixed cost, half each (rows
    of a stage's forward + backward cannot tell the halves apart)."""
    return replace(table, overhead={"fwd_s": seconds / 2, "bwd_s": seconds / 2})


def size_overhead(base: CostModel, runs: Sequence[MeasuredStep], pairs: Sequence[tuple[MeasuredStep, MeasuredStep]], *,
                  fit_contention: bool = False) -> float:
    """The fixed seconds per stage forward + backward call (on ``OVERHEAD_GRID``, in units of the
    median stage row of ``runs``) whose model, ``base`` fitted to ``runs`` with it held (and kappa
    held unless ``fit_contention``), best predicts each ``(small, large)`` pair's measured ratio
    of iteration times: one batch run serially at the smallest and at the largest micro-batch
    size, seconds apart.

    What splitting a batch into more micro-batches costs is a per-call overhead against a
    per-token cost, which action times of similar sizes cannot tell apart (they trade one for the
    other), and the contention of pipelined runs blurs it further. Beside one CPU-bound process
    the window's fit put it at zero and priced one micro-batch of 4 sequences 3.5-3.8 % too dear
    against the same batch as micro-batches of 1, run serially (``benchmarks/sim_vs_real.py``,
    background run 10's replays); those pairs' ratios scattered by 1.1 % (15 batches), where
    single runs at one size scattered by 5 % from step to step. Least absolute deviations, not
    squares: one calibration batch of background run 11 ran at mbs 4 1.25-1.35x its serial mbs-1
    time in all three jobs, where the others ran 0.97-1.03x (page faults while the heap grew,
    which the CPU heap reserve, ``torchtitan_patches.cpu_allocator``, now absorbs: with it that
    batch ran 1.01x and every pair of background run 12 0.97-1.05x). Limits: the overhead is one
    number fitted on a few calibration batches."""
    if not pairs:
        raise ValueError("size_overhead needs at least one (small, large) pair of serial runs")
    design = Design.stack([run.design for run in runs])
    unit = float(np.median(design.y[design.stage_work_rows()]))
    return unit * _best_ratio_fit(base, design, pairs, OVERHEAD_GRID.tolist(), lambda table, o: with_overhead(table, o * unit),
                                  fit_contention=fit_contention, fit_overhead=False, penalty=np.abs)


TUNED_TWINS_MIN = 3  # tuned twins before kappa is measured on them alone (``OnlineCalibrator``)
TUNED_TWIN_WINDOW = 8  # the most recent tuned twins it is measured on


class CalibrationRun(Enum):
    """How a step ran its batch (``OnlineCalibrator``)."""

    PIPELINED = "pipelined"  # the step's plan, as scheduled
    SERIAL = "serial"  # the same plan on the serial schedule: its twin
    SIZE_TWIN = "size twin"  # the batch at the calibration's largest micro-batch size, serially


class OnlineCalibrator:
    """Refits the profiled table to the last ``window`` steps after every step (``fit_steps``).

    Machine speed drifts (noisy neighbours, frequency scaling) and the micro-batch sizes in use
    change, so a one-off calibration ages; refitting on a sliding window keeps the planner's
    predictions close to what the pipeline currently does. Always refits from the profiled base
    table, so errors do not compound. ``jitter_draws``: the planner's (see ``fit_steps``).

    Two terms are measured on pairs of runs of one batch, seconds apart, and then held in every
    window's fit, because a window of the planner's own plans cannot pin them:

    * the contention kappa, when calibration steps also ran their plans serially
      (``observe_serial``): ``twin_contention`` on the (pipelined, serial) twins. The planner's
      plans overlap alike, so kappa trades against the scales, and a kappa fitted too low there
      priced a one-micro-batch plan 10-20 % too slow under a CPU-bound neighbour (predicted cut vs
      ``original`` off by 10 points, ``benchmarks/sim_vs_real.py``). A serial run times the same
      actions as its pipelined twin without overlap, so their ratio is kappa's alone. Once
      ``TUNED_TWINS_MIN`` of the planner's own plans have been run serially too (tuned twins,
      ``observe_serial(tuned=True)``), kappa is measured on the last ``TUNED_TWIN_WINDOW`` of
      those alone: one number does not price every plan family's contention alike, and beside
      a CPU-bound process the calibration's balanced plans wanted kappa 0.45 where pipetune's
      plans wanted 0.54 (background run 12); measured on tuned twins, every predicted cut of
      background run 13 came within 1.2 points of the measured one. Limits: one twin's ratio
      scattered by 3.4 % beside a CPU-bound process, so 8 tuned twins pin their mean ratio to
      about 1.2 %, some 0.03 of kappa (background run 13).
    * the per-call overhead, when such steps also ran the batch serially at the largest size
      (``observe_serial(size_twin=True)``): ``size_overhead`` on the (serial, size twin) pairs.
      Both runs are serial, so their ratio is what more, smaller micro-batches cost, free of
      contention and of the machine's speed.

    Every fit is anchored by the calibration runs (all of them, every micro-batch size;
    ``fit_steps``' ``anchors``): a window of the planner's own plans holds one or two sizes, and
    fitted on those alone the model priced ``original``'s one micro-batch of 4 samples 3-5 % too
    cheap on three of six mixes (predicted cut vs ``original`` off by 4.6 points, background run 9 of
    ``benchmarks/sim_vs_real.py`` re-analysed). The anchors shape the component fit only; the
    machine's current speed still comes from the window (the makespan factor), so drift is
    followed as before. Callers leave out each size's first step (``update``).
    """

    def __init__(self, base: LatencyTable, layout: StageLayout, window: int, *, jitter_draws: int = 0,
                 recompute_encoder: bool = False):
        self.base = CostModel(base, layout, recompute_encoder=recompute_encoder)
        self.steps: deque[MeasuredStep] = deque(maxlen=window)
        self.jitter_draws = jitter_draws
        self.by_step: dict[int, dict[CalibrationRun, MeasuredStep]] = {}  # the calibration runs, by batch step and how they ran
        self.tuned_twins: deque[tuple[MeasuredStep, MeasuredStep]] = deque(maxlen=TUNED_TWIN_WINDOW)  # (pipelined, serial)
        self._tuned_runs: dict[CalibrationRun, MeasuredStep] = {}  # the latest planner's step's runs, until paired
        self.contention: float | None = None  # measured on the twins, then held
        self.overhead: float | None = None  # seconds per stage forward + backward call, measured on the size pairs, then held

    def update(self, step: MeasuredStep, *, calibration: bool = False) -> tuple[CostModel, CalibrationReport]:
        """Add one step and refit. ``calibration``: a calibration step, whose runs anchor every fit
        and pair up as twins; pass ``False`` for a size's first step (one-off costs)."""
        self.steps.append(step)
        if calibration:
            self._add_calibration_run(step, CalibrationRun.PIPELINED)
        else:
            self._add_tuned_run(step, CalibrationRun.PIPELINED)
        return self.fit()

    def observe_serial(self, step: MeasuredStep, *, size_twin: bool = False, tuned: bool = False
                       ) -> tuple[CostModel, CalibrationReport] | None:
        """Add a calibration step's plan run serially (``IterationPlan.serialised``), or with
        ``size_twin`` its batch at the largest size run serially, or with ``tuned`` a planner's
        step's plan run serially (paired with that step's ``update``, before or after it),
        re-measure what its pairs measure and refit the window holding it (``None`` while the
        window is empty). Serial runs do not enter the window, which prices the planner's plans;
        those of calibration steps anchor the fits."""
        if tuned:
            self._add_tuned_run(step, CalibrationRun.SERIAL)
        else:
            self._add_calibration_run(step, CalibrationRun.SIZE_TWIN if size_twin else CalibrationRun.SERIAL)
        return self.fit() if self.steps else None

    @property
    def calibration_runs(self) -> list[MeasuredStep]:
        return [run for same in self.by_step.values() for run in same.values()]

    @property
    def twins(self) -> list[tuple[MeasuredStep, MeasuredStep]]:
        """(pipelined, serial) runs of one calibration plan."""
        return self._pairs(CalibrationRun.PIPELINED, CalibrationRun.SERIAL)

    @property
    def size_pairs(self) -> list[tuple[MeasuredStep, MeasuredStep]]:
        """(serial, size twin) runs of one batch."""
        return self._pairs(CalibrationRun.SERIAL, CalibrationRun.SIZE_TWIN)

    def _pairs(self, a: CalibrationRun, b: CalibrationRun) -> list[tuple[MeasuredStep, MeasuredStep]]:
        return [(same[a], same[b]) for same in self.by_step.values() if a in same and b in same]

    def _add_calibration_run(self, step: MeasuredStep, how: CalibrationRun) -> None:
        same = self.by_step.setdefault(step.plan.step, {})
        same[how] = step
        if CalibrationRun.SERIAL not in same:
            return
        new_twin = how is not CalibrationRun.SIZE_TWIN and CalibrationRun.PIPELINED in same
        new_size_pair = how is not CalibrationRun.PIPELINED and CalibrationRun.SIZE_TWIN in same
        if new_size_pair:
            self.overhead = size_overhead(self.held(), self.calibration_runs, self.size_pairs, fit_contention=self.contention is None)
        if new_twin or new_size_pair:
            self._measure_contention()

    def _add_tuned_run(self, step: MeasuredStep, how: CalibrationRun) -> None:
        if any(run.plan.step != step.plan.step for run in self._tuned_runs.values()):
            self._tuned_runs = {}
        self._tuned_runs[how] = step
        if len(self._tuned_runs) == 2:
            self.tuned_twins.append((self._tuned_runs[CalibrationRun.PIPELINED], self._tuned_runs[CalibrationRun.SERIAL]))
            self._tuned_runs = {}
            self._measure_contention()

    def contention_twins(self) -> list[tuple[MeasuredStep, MeasuredStep]]:
        """The twins kappa is measured on: the recent tuned twins once there are
        ``TUNED_TWINS_MIN``, else every twin."""
        tuned = list(self.tuned_twins)
        return tuned if len(tuned) >= TUNED_TWINS_MIN else self.twins + tuned

    def _measure_contention(self) -> None:
        twins = self.contention_twins()
        if twins:
            self.contention = twin_contention(self.held(), self.calibration_runs, twins, fit_overhead=self.overhead is None)

    def held(self) -> CostModel:
        """The base model with the terms measured on pairs so far."""
        table = self.base.table
        if self.contention is not None:
            table = replace(table, contention=self.contention)
        if self.overhead is not None:
            table = with_overhead(table, self.overhead)
        return CostModel(table, self.base.layout, recompute_encoder=self.base.recompute_encoder)

    def fit(self) -> tuple[CostModel, CalibrationReport]:
        """The base table fitted to the window, anchored by the calibration runs (kappa and the
        per-call overhead held once measured on pairs)."""
        return fit_steps(self.held(), self.steps, anchors=self.anchors(), jitter_draws=self.jitter_draws,
                         fit_contention=self.contention is None, fit_overhead=self.overhead is None)

    def anchors(self) -> list[MeasuredStep]:
        """The calibration runs not in the window: every fit's anchors."""
        return [run for run in self.calibration_runs if not any(run is step for step in self.steps)]

    def state_dict(self) -> dict:
        return {"window": list(self.steps), "by_step": self.by_step, "tuned_twins": list(self.tuned_twins), "contention": self.contention,
                "overhead": self.overhead}

    def load_state_dict(self, state: dict) -> tuple[CostModel, CalibrationReport] | None:
        """Restore and refit (``None``: nothing measured yet). Checkpoints of older versions list
        the calibration runs and the (pipelined, serial) twins among them instead, and hold no
        size twins or tuned twins."""
        self.steps.clear()
        self.steps.extend(state["window"])
        self.by_step = dict(state["by_step"]) if "by_step" in state else self._by_step_of(state)
        self.tuned_twins.clear()
        self.tuned_twins.extend(state.get("tuned_twins", []))
        self.contention, self.overhead = state["contention"], state.get("overhead")
        return self.fit() if self.steps else None

    @staticmethod
    def _by_step_of(old: dict) -> dict[int, dict[CalibrationRun, MeasuredStep]]:
        serial = {id(run) for _, run in old.get("twins", [])}
        by_step: dict[int, dict[CalibrationRun, MeasuredStep]] = {}
        for run in old["calibration_runs"]:
            by_step.setdefault(run.plan.step, {})[CalibrationRun.SERIAL if id(run) in serial else CalibrationRun.PIPELINED] = run
        return by_step
