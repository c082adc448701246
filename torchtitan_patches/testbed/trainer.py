"""``TestbedTrainer``: ``PipeTuneTrainer`` with the CPU testbed's measurement runs and heap reserve.

What each costs, per job on 2 CPU ranks: a serial twin about 1.2 pipelined steps (every
calibration step of several micro-batches, and every ``tuned_twin_every``-th later step); a size
twin one more serial run per ``max_mbs`` calibration steps; a side-by-side replay one run per
further job; the heap reserve ``heap_reserve_gib`` of resident memory per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

from torchtitan_patches.testbed.learning import PairLearner, TestbedRecord, twin_kind
from torchtitan_patches.testbed.runs import Twin, first_run, has_size_twin, rotated, twin_of
from pipetune.calibrate.pairs import PairCalibrator
from pipetune.data.batch import BatchMeta
from pipetune.plan.plan import IterationPlan
from pipetune.serve.plan_source import load_replay
from pipetune.plan.data_parallel.replicas import ReplicaPlans
from pipetune.records import StepKind
from torchtitan_patches.compat.cpu_allocator import retain_freed_memory
from torchtitan_patches.settings import PipeTuneSettings
from torchtitan_patches.titan.model_parts import replicas_of
from torchtitan_patches.titan.run_outcome import Run
from torchtitan_patches.trainer import PipeTuneTrainer


class TestbedSettings(Configurable):
    """The ``testbed`` config section."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        heap_reserve_gib: float = 1.5
        """Heap each rank touches before training and keeps (``compat.cpu_allocator``), so steps
        do not pay page faults while the heap grows to the job's peak: those follow the run's
        history, not the plan, and would mislead the online calibration. Size it to the ranks' peak
        memory (TorchTitan's memory monitor logs peak resident memory on CPU). 0: off."""

        serial_twins: bool = True
        """Calibration steps of several micro-batches also run their plan serially, and those of the
        smallest size also the batch at the largest size serially; the calibration measures kappa
        and the per-call overhead on those pairs and holds them (``pipetune.calibrate.pairs``).
        Co-located layouts only."""

        tuned_twin_every: int = 0
        """After calibration, every Nth step whose plan is pipetune's also runs it serially, and
        kappa is measured on the recent tuned twins once there are a few. 0: off."""

        side_by_side: list[str] = field(default_factory=list)
        """Further jobs' ``steps.jsonl`` (recording the same batches as ``pipetune.replay.path``):
        every step runs each job's plan of its batch back to back, the one that runs first rotating
        with the step, and keeps the last run's gradients. Plans timed seconds apart are compared
        without the machine's drift between jobs."""

        def __post_init__(self) -> None:
            if self.heap_reserve_gib < 0 or self.tuned_twin_every < 0:
                raise ValueError(f"testbed.heap_reserve_gib and testbed.tuned_twin_every must be >= 0, got "
                                 f"{self.heap_reserve_gib} and {self.tuned_twin_every}")


def load_side_by_side(first: str, paths: list[str]) -> list[dict[int, str]]:
    """``load_replay`` of each of ``paths``; they must record the same batches as ``first`` (the
    ``pipetune.replay.path`` they run beside)."""
    if not paths:
        return []
    want = load_replay(first).keys()
    replays = [load_replay(path) for path in paths]
    for path, got in zip(paths, replays):
        if got.keys() != want:
            raise ValueError(f"testbed.side_by_side: {path} records batches {min(got)}..{max(got)} ({len(got)}) but "
                             f"{first} records {min(want)}..{max(want)} ({len(want)}); files replayed side by side must "
                             "record the same batches")
    return replays


@dataclass(frozen=True)
class TestbedRun(Run):
    __test__ = False  # not a pytest test class
    twin: Twin | None = None
    replay_of: int | None = None


class TestbedTrainer(PipeTuneTrainer):
    __test__ = False  # not a pytest test class

    @dataclass(kw_only=True, slots=True)
    class Config(PipeTuneTrainer.Config):
        testbed: TestbedSettings.Config = field(default_factory=TestbedSettings.Config)

    record_class = TestbedRecord

    def __init__(self, config: Config):
        tb = config.testbed
        if tb.side_by_side and not config.pipetune.replay.path:
            raise ValueError("testbed.side_by_side replays beside pipetune.replay.path: set that to the first job's steps.jsonl")
        reserve = int(tb.heap_reserve_gib * 2**30)
        if not torch.cuda.is_available() and not retain_freed_memory(reserve) and reserve:
            logger.warning(f"testbed: could not keep and touch {tb.heap_reserve_gib:.1f} GiB of heap (no glibc mallopt, or the "
                           "memory is not there); steps pay page faults while the heap grows, and the calibration sees them")
        if replicas_of(config) != 1 or config.parallelism.tensor_parallel_degree != 1:
            raise ValueError("the CPU testbed runs one pipeline of one rank per stage: set parallelism.data_parallel_shard_degree, "
                             "data_parallel_replicate_degree and tensor_parallel_degree to 1 (or use PipeTuneTrainer's configs "
                             "for data and tensor parallelism)")
        self.beside = load_side_by_side(config.pipetune.replay.path, tb.side_by_side)
        super().__init__(config)

    def _learner(self, pt: PipeTuneSettings.Config) -> PairLearner:
        core = super()._learner(pt)
        window = pt.calibration.online_window
        calibrator = PairCalibrator(self.table, self.layout, window, jitter_draws=pt.jitter_draws) if window else None
        return PairLearner(self.profiled, calibrator=calibrator, correction=core.correction, guard=core.guard)

    def runs(self, batch, plan: IterationPlan) -> list[Run]:
        tb, pt = self.config.testbed, self.config.pipetune
        replaying = bool(pt.replay.path)
        runs = [TestbedRun(batch, plan, replay_of=0 if self.beside else None)]
        runs += [TestbedRun(b, p, extra=True, replay_of=k) for k, (b, p) in enumerate(self._beside(batch.step), 1)]
        twin = twin_of(batch.step, plan, calibrate_steps=pt.calibration.steps, serial_twins=tb.serial_twins,
                       tuned_twin_every=tb.tuned_twin_every, replaying=replaying)
        if twin is not None:
            runs.append(TestbedRun(batch, plan.serialised(), extra=True, twin=twin))
            runs += [TestbedRun(b, p, extra=True, twin=Twin.SIZE) for b, p in self._size_twin(batch.step)]
        first = first_run(batch.step, calibrate_steps=pt.calibration.steps, tuned_twin_every=tb.tuned_twin_every, replaying=replaying)
        return rotated(runs, first)

    def _size_twin(self, step: int) -> list[tuple]:
        """Batch ``step`` planned at the calibration's largest size on the serial schedule, where it
        is a calibration batch of the smallest size (rank 0 knows the sizes)."""
        plans = []
        if self.rank == 0 and has_size_twin(step, calibrate_steps=self.source.calibrate_steps, sizes=len(self.source.calibration)):
            plans = [self.source.calibration[-1].plan(self.dataloader.inner.meta(step)).serialised().to_json()]
        return self._sent_from_rank0(step, plans)

    def _beside(self, step: int) -> list[tuple]:
        """The plans of batch ``step`` in the ``side_by_side`` files, with the batch packed as each says."""
        return self._sent_from_rank0(step, [r[step][0] for r in self.beside] if self.beside and self.rank == 0 else [])

    def _sent_from_rank0(self, step: int, plans: list[str]) -> list[tuple]:
        """Rank 0's ``plans`` of batch ``step`` (JSON), sent to every rank over the control group,
        each with the batch packed as it says."""
        box = [plans if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        loader = self.dataloader.inner
        meta: BatchMeta = loader.meta(step)
        received = [IterationPlan.from_json(js, batch_ids=meta.table.ids) for js in box[0]]
        return [(loader.pack(meta, [list(mb) for mb in p.micro_batches]), p) for p in received]

    def run_fields(self, run: TestbedRun) -> dict:
        return {**super().run_fields(run), "twin": run.twin, "replay_of": run.replay_of}

    def _learn(self, run: TestbedRun, records: list[TestbedRecord]) -> None:
        if run.twin is None and not run.replay_of:
            return super()._learn(run, records)
        (record,) = records
        if run.replay_of:  # a further job's plan: timed, not learnt from
            record.kind, record.tuned_predicted_s, record.baseline_predicted_s = StepKind.REPLAY, run.plan.predicted_s, float("nan")
            return
        record.kind, record.tuned_predicted_s, record.baseline_predicted_s = twin_kind(run.twin), float("nan"), float("nan")
        self._apply(self.learner.observe(records, ReplicaPlans(run.batch.step, (run.plan,)), self.dataloader.inner.meta(run.batch.step)))
