"""Which runs a testbed step executes, and in which order: pure functions of the step, the
settings and the plan, so every rank decides alike without talking and the rules are tested
without a job."""

from __future__ import annotations

from enum import Enum

from pipetune.plan import Mode
from pipetune.plan.plan import IterationPlan


class Twin(str, Enum):
    """A serial run beside a step's plan."""

    SERIAL = "serial"  # a calibration step's plan on the serial schedule
    SIZE = "size"  # a calibration batch at the largest micro-batch size, serially
    TUNED = "tuned"  # a planner's plan (after calibration) on the serial schedule


def twin_of(step: int, plan: IterationPlan, *, calibrate_steps: int, serial_twins: bool, tuned_twin_every: int,
            replaying: bool) -> Twin | None:
    """The serial twin batch ``step`` runs beside ``plan``: calibration steps with
    ``serial_twins``, and every ``tuned_twin_every``-th later step whose plan is pipetune's (the
    guard's baseline plans are not). None in replays, or where the plan has no serial twin."""
    if replaying or not plan.has_serial_twin:
        return None
    if step < calibrate_steps:
        return Twin.SERIAL if serial_twins else None
    tuned = tuned_twin_every and (step - calibrate_steps) % tuned_twin_every == 0
    return Twin.TUNED if tuned and plan.mode is Mode.PIPETUNE else None


def has_size_twin(step: int, *, calibrate_steps: int, sizes: int) -> bool:
    """Whether calibration batch ``step`` is one of the smallest size (the cycle through ``sizes``
    micro-batch sizes starts there), whose batch also runs at the largest size serially."""
    return step < calibrate_steps and sizes > 1 and step % sizes == 0


def first_run(step: int, *, calibrate_steps: int, tuned_twin_every: int, replaying: bool) -> int:
    """Which run of the step goes first (mod the number of runs): the batch step, or, on steps
    with tuned twins, the twin's count (they fall on every Nth step, so the step alone would put
    the same run first every time)."""
    if tuned_twin_every and not replaying and step >= calibrate_steps:
        return (step - calibrate_steps) // tuned_twin_every
    return step


def rotated(runs: list, first: int) -> list:
    """``runs`` starting at ``first`` (mod their count)."""
    k = first % len(runs)
    return runs[k:] + runs[:k]
