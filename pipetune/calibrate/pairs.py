"""The CPU testbed's pair-based fits: terms measured on two runs of one batch seconds apart, then
held in every window fit (``PairCalibrator``).

On a machine whose pipeline ranks share CPU cores, work runs ``1 + kappa`` times slower while
another rank computes (``pipetune.simulate.contention``), and what splitting a batch into more
micro-batches costs (a per-call overhead) hides behind that contention. A window of the planner's
own plans cannot pin either: its plans overlap alike, so kappa trades against the scales. Two runs
of one batch can: a plan and its *serial twin* (the same actions, no two ranks computing at once,
``IterationPlan.serialised``) differ by contention alone, and a serial run at the smallest and at
the largest micro-batch size (a *size twin*) by the per-call overhead alone. GPUs, whose ranks do
not share compute, need none of this; the testbed (``torchtitan_patches/testbed``) switches it on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from enum import Enum

import numpy as np

from pipetune.calibrate.action_fit import CONTENTION_GRID, OVERHEAD_GRID, Design, calibrate_design
from pipetune.calibrate.online import MeasuredStep, OnlineCalibrator, plan_makespan, with_overhead
from pipetune.cost.cost_model import CostModel
from pipetune.simulate.dag import compile_schedule


def _best_ratio_fit(base: CostModel, design: Design, pairs: Sequence[tuple[MeasuredStep, MeasuredStep]], grid,
                    held, *, fit_contention: bool, fit_overhead: bool, penalty=np.square) -> float:
    """The value on ``grid`` whose model (``held(table, value)``, then fitted to ``design``'s rows)
    best predicts each pair's measured ratio of iteration times (least ``penalty`` of the log
    ratios' errors). Each run's schedule is compiled once, not once per value."""
    measured = np.log([a.measured_s / b.measured_s for a, b in pairs])
    compiled = [[(run, compile_schedule(run.plan.table())) for run in pair] for pair in pairs]

    def loss(value: float) -> float:
        table, _ = calibrate_design(held(base.table, value), design, fit_contention=fit_contention, fit_overhead=fit_overhead)
        cost = CostModel(table, base.layout, recompute_encoder=base.recompute_encoder)
        ratio = [plan_makespan(cost, a.plan, a.meta, da) / plan_makespan(cost, b.plan, b.meta, db) for (a, da), (b, db) in compiled]
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
    iteration times: replayed along their dependencies, a serial run's action times exceeded its
    measured iteration time by up to 3 % beside one CPU-bound process, and kappa fitted to the
    action times came out 0.30-0.50 where the ratios of the same runs wanted 0.50-0.75."""
    if not twins:
        raise ValueError("twin_contention needs at least one (pipelined, serial) pair of runs")
    return _best_ratio_fit(base, Design.stack([run.design for run in runs]), twins, CONTENTION_GRID.tolist(),
                           lambda table, kappa: replace(table, contention=kappa), fit_contention=False, fit_overhead=fit_overhead)


def size_overhead(base: CostModel, runs: Sequence[MeasuredStep], pairs: Sequence[tuple[MeasuredStep, MeasuredStep]], *,
                  fit_contention: bool = False) -> float:
    """The fixed seconds per stage forward + backward call (on ``OVERHEAD_GRID``, in units of the
    median stage row of ``runs``) whose model, ``base`` fitted to ``runs`` with it held (and kappa
    held unless ``fit_contention``), best predicts each ``(small, large)`` pair's measured ratio
    of iteration times: one batch run serially at the smallest and at the largest micro-batch
    size, seconds apart.

    What splitting a batch into more micro-batches costs is a per-call overhead against a
    per-token cost, which action times of similar sizes cannot tell apart (they trade one for the
    other), and the contention of pipelined runs blurs it further; two serial runs of one batch
    seconds apart carry neither contention nor the machine's drift (their ratios scattered by
    about 1 % under load, where single runs scattered by 5 % from step to step). Least absolute
    deviations, not squares: one batch whose large run pays one-off costs (page faults while the
    heap grows, which the testbed's heap reserve absorbs) would otherwise set the overhead alone.
    Limits: the overhead is one number fitted on a few calibration batches."""
    if not pairs:
        raise ValueError("size_overhead needs at least one (small, large) pair of serial runs")
    design = Design.stack([run.design for run in runs])
    unit = float(np.median(design.y[design.stage_work_rows()]))
    return unit * _best_ratio_fit(base, design, pairs, OVERHEAD_GRID.tolist(), lambda table, o: with_overhead(table, o * unit),
                                  fit_contention=fit_contention, fit_overhead=False, penalty=np.abs)


TUNED_TWINS_MIN = 3  # tuned twins before kappa is measured on them alone
TUNED_TWIN_WINDOW = 8  # the most recent tuned twins it is measured on


class Run(str, Enum):
    """How a run executed its batch."""

    PIPELINED = "pipelined"  # the step's plan, as scheduled
    SERIAL = "serial"  # the same plan on the serial schedule: its twin
    SIZE_TWIN = "size twin"  # the batch at the calibration's largest micro-batch size, serially


class PairCalibrator(OnlineCalibrator):
    """``OnlineCalibrator`` that measures kappa and the per-call overhead on pairs of runs and
    holds them:

    * kappa: ``twin_contention`` on the (pipelined, serial) twins of calibration steps; once
      ``TUNED_TWINS_MIN`` of the planner's own plans have been run serially too (tuned twins,
      ``observe_serial(tuned=True)``), on the last ``TUNED_TWIN_WINDOW`` of those alone, since one
      kappa does not price every plan family's contention alike (beside a CPU-bound process the
      calibration's balanced plans wanted 0.45 where pipetune's plans wanted 0.54). One twin's
      ratio scatters by about 3.4 % under such load, so 8 tuned twins pin kappa to about 0.03.
    * the per-call overhead: ``size_overhead`` on the (serial, size twin) pairs.

    Until a pair is in, the window fits kappa (``fit_contention``). Serial runs never enter the
    window, which prices the planner's plans; those of calibration steps anchor the fits.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, fit_contention=True, **kwargs)
        self.tuned_twins: deque[tuple[MeasuredStep, MeasuredStep]] = deque(maxlen=TUNED_TWIN_WINDOW)  # (pipelined, serial)
        self._tuned_runs: dict[Run, MeasuredStep] = {}  # the latest planner's step's runs, until paired

    def update(self, *runs: MeasuredStep, calibration: bool = False):
        if not calibration:
            for run in runs:
                self._add_tuned_run(run, Run.PIPELINED)
        return super().update(*runs, calibration=calibration)

    def observe_serial(self, step: MeasuredStep, *, size_twin: bool = False, tuned: bool = False):
        """Add a calibration step's plan run serially, or with ``size_twin`` its batch at the
        largest size run serially, or with ``tuned`` a planner's step's plan run serially (paired
        with that step's ``update``, before or after it); re-measure what its pairs measure and
        refit (``None`` while the window is empty)."""
        if tuned:
            self._add_tuned_run(step, Run.SERIAL)
        else:
            self.add_calibration_run(step, (Run.SIZE_TWIN if size_twin else Run.SERIAL).value)
        return self.fit() if self.steps else None

    def add_calibration_run(self, step: MeasuredStep, how: str) -> None:
        super().add_calibration_run(step, how)
        same = self.by_step[step.key]
        if Run.SERIAL.value not in same:
            return
        new_twin = how != Run.SIZE_TWIN.value and Run.PIPELINED.value in same
        new_size_pair = how != Run.PIPELINED.value and Run.SIZE_TWIN.value in same
        if new_size_pair:
            self.overhead = size_overhead(self.held(), self.calibration_runs, self.size_pairs, fit_contention=self.contention is None)
        if new_twin or new_size_pair:
            self._measure_contention()

    @property
    def twins(self) -> list[tuple[MeasuredStep, MeasuredStep]]:
        """(pipelined, serial) runs of one calibration plan."""
        return self._pairs(Run.PIPELINED, Run.SERIAL)

    @property
    def size_pairs(self) -> list[tuple[MeasuredStep, MeasuredStep]]:
        """(serial, size twin) runs of one batch."""
        return self._pairs(Run.SERIAL, Run.SIZE_TWIN)

    def _pairs(self, a: Run, b: Run) -> list[tuple[MeasuredStep, MeasuredStep]]:
        return [(same[a.value], same[b.value]) for same in self.by_step.values() if a.value in same and b.value in same]

    def _add_tuned_run(self, step: MeasuredStep, how: Run) -> None:
        if any(run.plan.step != step.plan.step for run in self._tuned_runs.values()):
            self._tuned_runs = {}
        self._tuned_runs[how] = step
        if len(self._tuned_runs) == 2:
            self.tuned_twins.append((self._tuned_runs[Run.PIPELINED], self._tuned_runs[Run.SERIAL]))
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

    def state_dict(self) -> dict:
        return {**super().state_dict(), "tuned_twins": list(self.tuned_twins)}

    def load_state_dict(self, state: dict):
        self.tuned_twins.clear()
        self.tuned_twins.extend(state["tuned_twins"])
        return super().load_state_dict(state)
