"""Calibration from the runtime's own action timelines (what DIP calibrates on), once or online."""

from __future__ import annotations

from collections import deque

from pipetune.cost.calibration import CalibrationReport, Observation, calibrate
from pipetune.cost.cost_model import CostModel
from pipetune.cost.table import LatencyTable
from pipetune.data.batch import BatchMeta
from pipetune.plan.plan import IterationPlan
from pipetune.schedule.table import Op
from pipetune.simulate.simulator import TimedAction

def timeline_observations(timeline: list[TimedAction], plan: IterationPlan, meta: BatchMeta) -> list[Observation]:
    """Per micro-batch and stage, its forward + backward time; per micro-batch with images, its
    encoder time. Forward and backward are summed because where the bookkeeping between them is
    charged is arbitrary; their sum is not."""
    shapes = plan.shapes(meta)
    work: dict[tuple[int, int], float] = {}
    out = []
    for t in timeline:
        a = t.action
        if a.op is Op.ENCODER:
            one = shapes.take([a.mb])
            if one.images[0]:
                out.append(Observation(one, t.end - t.start, kind="encoder"))
        else:
            work[(a.stage, a.mb)] = work.get((a.stage, a.mb), 0.0) + t.end - t.start
    out += [Observation(shapes.take([mb]), sec, stage=s) for (s, mb), sec in sorted(work.items())]
    return out


class OnlineCalibrator:
    """Refits the profiled table to the last ``window`` steps after every step.

    Machine speed drifts (noisy neighbours, frequency scaling) and the micro-batch sizes in use
    change, so a one-off calibration ages; refitting on a sliding window keeps the planner's
    predictions close to what the pipeline currently does. Always refits from the profiled base
    table, so errors do not compound.
    """

    def __init__(self, base: LatencyTable, cost: CostModel, window: int):
        self.base = base
        self.layout = cost.layout
        self.base_cost = CostModel(base, cost.layout)
        self.steps: deque[list[Observation]] = deque(maxlen=window)

    def update(self, timeline: list[TimedAction], plan: IterationPlan, meta: BatchMeta) -> tuple[CostModel, CalibrationReport]:
        self.steps.append(timeline_observations(timeline, plan, meta))
        table, report = calibrate(self.base, self.base_cost, [o for step in self.steps for o in step])
        return CostModel(table, self.layout), report
