"""The ``pipetune`` section of a TorchTitan job config (``PipeTuneTrainer.Config.pipetune``).

Sections are TorchTitan ``Configurable.Config`` dataclasses, so every field is a command-line
override as usual (``--pipetune.mode original``, ``--pipetune.guard.probe_every 8``). Defaults are
the ones for GPU clusters; the CPU testbed's settings live in ``torchtitan_patches/testbed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.config import Configurable

from pipetune.calibrate.correction import FamilyCorrection
from pipetune.serve.learner import Learner
from pipetune.calibrate.online import OnlineCalibrator
from pipetune.cost import CostModel
from pipetune.plan import Mode
from pipetune.serve.guard import Guard, GuardConfig
from pipetune.plan.layout.planner_config import PlannerConfig, SplitBackward, check_jitter_draws, separated_excluded

__all__ = ["CalibrationSettings", "GuardSettings", "PipeTuneSettings", "ReplaySettings"]


def _at_least(section: str, config, minimum: int, *names: str) -> None:
    for name in names:
        if getattr(config, name) < minimum:
            raise ValueError(f"pipetune.{section}{name} must be >= {minimum}, got {getattr(config, name)}")


class CalibrationSettings(Configurable):
    """The online calibration: the latency table refitted to recent steps, anchored by
    calibration steps."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        online_window: int = 8
        """Refit the latency table to the last N measured steps after every step (0: off)."""

        steps: int = 0
        """The first N steps train with balanced plans cycling through every micro-batch size, so
        the calibration has measured each size before the planner compares them; their runs
        anchor every later fit (each size's first step excepted: it pays one-off costs)."""

        def __post_init__(self) -> None:
            _at_least("calibration.", self, 0, "online_window", "steps")

        def calibrator(self, profiled: CostModel, *, jitter_draws: int) -> OnlineCalibrator | None:
            """The window holds the runs of the last ``online_window`` steps (of one replica: each
            replica's lead learns from its own runs)."""
            if not self.online_window:
                return None
            return OnlineCalibrator(profiled.table, profiled.layout, self.online_window, jitter_draws=jitter_draws)


class GuardSettings(Configurable):
    """The measured guard (``pipetune.serve.guard``): pipetune's plans run only while measured
    faster than the best fixed configuration."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        enable: bool = True
        """pipetune mode: fall back to the best fixed configuration while pipetune's plans are
        measured slower than it."""

        probe_every: int = 16
        """Steps between baseline probes (one probe step runs the baseline plan)."""

        window: int = 8
        """Tuned steps the guard judges on (it decides once it has ``min(4, window)``)."""

        def __post_init__(self) -> None:
            _at_least("guard.", self, 2, "probe_every")
            _at_least("guard.", self, 1, "window")

        def guard(self) -> Guard:
            return Guard(GuardConfig(probe_every=self.probe_every, window=self.window, min_steps=min(4, self.window)))


class ReplaySettings(Configurable):
    """Run an earlier job's recorded plans instead of planning."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        path: str = ""
        """An earlier job's ``pipetune/steps.jsonl`` (same data set, batch size, seed and sequence
        length; each plan is checked against its batch): the same plans timed again, or a run's
        plans reproduced. Empty: plan."""


class PipeTuneSettings(Configurable):
    """Holder of the ``pipetune`` config section."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        mode: str = "pipetune"
        """Planner mode: original (fixed mbs, arrival order), balanced, reorder or pipetune."""

        latency_table: str = ""
        """Latency table of this device for the model's planning shapes (``python -m
        profiling.prepare_job``)."""

        layout: str = "even"
        """Backbone layers per stage: ``even`` or counts such as ``3,5``; ``separated``: DIP's layout,
        the vision encoder in chunks on every rank and images in fixed-size sub-microbatches (chosen
        by the partitioner); ``auto``: the faster of the best co-located split and ``separated``,
        predicted on sampled batches of the job's data with the latency table, under ``memory_gib``."""

        budget_s: float = 2.0
        """Planning time per batch; past it the balanced plan at the last good mbs is used."""

        plan_ahead: int = 2
        """Batches planned ahead of the one being trained."""

        max_mbs: int = 4
        """Largest micro-batch size (samples) the planner may choose."""

        mbs: int | None = None
        """Micro-batch size of the fixed-size modes (original, balanced); unset (None, as in
        ``PlannerConfig`` and ``pipetune plan --mbs``): the largest that fits."""

        memory_gib: float = 16.0
        """Memory per rank the plans must fit."""

        image_grid: int = 4
        """Patches per image side (pipetune plans with one image size; a multiple of the merge)."""

        freeze_vision_encoder: bool = True
        """Train without the vision encoder's gradients (PipeTune's setting; lets ``E`` run early
        without keeping its graph)."""

        strict_order: bool = False
        """Give every message one tag, so gloo matches messages by order as NCCL does (a check)."""

        count_host_syncs: bool = False
        """Count each step's host-device synchronisations per rank into the step records (a check;
        on CPU it slows the step: ``torchtitan_patches.runtime.host_sync``)."""

        split_backward: str = "off"
        """Split every backbone backward into its input gradient and its weight gradient, which
        plans defer into bubbles (zero-bubble pipelining, ZB-H1's rule): ``off``; ``on``; ``auto``:
        the planner chooses per iteration, whichever is predicted faster within ``memory_gib``. The
        ``InterleavedZeroBubble`` schedule means ``on``. Limits: co-located even or explicit
        layouts, no data or tensor parallelism. A split chunk holds its activations until its
        weight gradient and, from its input gradient on, the output gradient of every weight's
        operation: more memory than 1F1B, which the planner counts."""

        offload: bool = False
        """Where a plan would not fit ``memory_gib``, copy activations to pinned host memory after
        their forward and back before their backward, on a copy stream beside the compute
        (OptPipe's activation offload): the planner chooses which, per iteration, only where memory
        binds, and compares against plans that keep them. Needs a latency table with a host link
        (``host``: from the hardware preset in estimates). Co-located layouts only."""

        jitter_draws: int = 0
        """Score plans by their expected time over this many draws of per-action jitter (0: the
        deterministic simulation; else >= 2). Needs ``calibration.online_window``: the spread is
        fitted online from the measured action times. Co-located layouts only."""

        calibration: CalibrationSettings.Config = field(default_factory=CalibrationSettings.Config)
        guard: GuardSettings.Config = field(default_factory=GuardSettings.Config)
        replay: ReplaySettings.Config = field(default_factory=ReplaySettings.Config)

        def __post_init__(self) -> None:
            Mode(self.mode)
            if self.split_backward not in {s.value for s in SplitBackward}:
                raise ValueError(f"pipetune.split_backward must be one of {[s.value for s in SplitBackward]}, got {self.split_backward!r}")
            _at_least("", self, 0, "plan_ahead", "max_mbs", "image_grid")
            if self.mbs is not None:
                _at_least("", self, 1, "mbs")
            if self.budget_s <= 0 or self.memory_gib <= 0:
                raise ValueError("pipetune.budget_s and pipetune.memory_gib must be positive")
            check_jitter_draws(self.jitter_draws, "pipetune.jitter_draws")
            excluded = (separated_excluded(split_backward=self.split_backward, jitter_draws=self.jitter_draws, offload=self.offload)
                        if self.layout == "separated" else [])
            if excluded:
                raise ValueError(f"pipetune.layout separated does not run {' and '.join(excluded)}: set those off or a co-located layout")

        @property
        def tuning(self) -> bool:
            return Mode(self.mode) is Mode.PIPETUNE

        @property
        def guarded(self) -> bool:
            """Whether the guard runs: pipetune mode, planning (not replaying), guard enabled."""
            return self.guard.enable and self.tuning and not self.replay.path

        def planner_config(self, mode: Mode, *, seq_len: int, seed: int, split_backward: SplitBackward, mbs: int | None = None) -> PlannerConfig:
            """The planner settings of this job's planners (``mbs`` None: the largest that fits)."""
            return PlannerConfig(mode=mode, max_seq_len=seq_len, memory_bytes=self.memory_gib * 2**30, max_mbs=self.max_mbs, mbs=mbs,
                                 seed=seed, jitter_draws=self.jitter_draws, split_backward=split_backward, offload=self.offload)

        def learner(self, profiled: CostModel) -> Learner:
            """A replica lead's learning for this job (``pipetune.serve.learner``)."""
            calibrator = self.calibration.calibrator(profiled, jitter_draws=self.jitter_draws)
            correction = FamilyCorrection() if calibrator is not None and self.tuning else None
            return Learner(profiled, calibrator=calibrator, correction=correction, guard=self.guard.guard() if self.guarded else None)
