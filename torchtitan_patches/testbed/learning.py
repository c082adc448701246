"""The testbed's record type and learner (torch-free, so the benchmarks replay records through
the very code the trainer ran)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from torchtitan_patches.testbed.runs import Twin
from pipetune.serve.learner import Learned, Learner
from pipetune.calibrate.pairs import PairCalibrator
from pipetune.data.batch import BatchMeta
from pipetune.plan.data_parallel.replicas import ReplicaPlans
from pipetune.records import StepKind, StepRecord


@dataclass(kw_only=True)
class TestbedRecord(StepRecord):
    """A ``StepRecord`` that also says which twin a run was and which replayed job's plan it ran
    (``replay_of``: its index in ``[pipetune.replay.path, *testbed.side_by_side]``)."""

    __test__ = False  # not a pytest test class
    twin: Twin | None = None
    replay_of: int | None = None

    ENUMS: ClassVar = {**StepRecord.ENUMS, "twin": Twin}


class PairLearner(Learner):
    """A ``Learner`` whose calibrator is a ``PairCalibrator``: twins' records measure kappa (serial
    and tuned twins) and the per-call overhead (size twins) instead of entering the window."""

    calibrator: PairCalibrator | None

    def observe(self, records: Sequence[TestbedRecord], plans: ReplicaPlans, meta: BatchMeta) -> Learned:
        """A step's run (``Learner.observe``), or one twin's (the testbed runs one replica)."""
        if records[0].twin is None:
            return super().observe(records, plans, meta)
        (record,), (plan,) = records, plans.plans
        if record.cold or self.calibrator is None:  # a size's first run pays one-off costs
            return Learned()
        fitted = self.calibrator.observe_serial(self.measured(record, plan, meta), size_twin=record.twin is Twin.SIZE,
                                                tuned=record.twin is Twin.TUNED)
        record.contention, record.call_overhead_s = self.calibrator.contention, self.calibrator.overhead
        return Learned(fitted[0] if fitted else None)


def twin_kind(twin: Twin) -> StepKind:
    """The kind a twin's record carries: the kind of plan it is the serial run of."""
    return StepKind.TUNED if twin is Twin.TUNED else StepKind.CALIBRATION
