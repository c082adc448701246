"""The candidate plan both planners score: one packing at one micro-batch size and its best order
so far. A module of its own so that the co-located ``Planner`` and the ``SeparatedPlanner`` share it
without either reaching into the other's module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pipetune.packing.groups import Packing
from pipetune.simulate.dag import CompiledSchedule
from pipetune.simulate.jitter import JitteredLatencies
from pipetune.simulate.simulator import Latencies

if TYPE_CHECKING:  # the separated planner's table; the search does not depend on it
    from pipetune.plan.separated.interleave import Interleaved


@dataclass
class Candidate:
    """One packing, its latencies and the best order (with encoder slots, or the separated planner's
    interleaved table) found for it so far; ``best_s`` stays ``inf`` while nothing found fits memory."""

    mbs: int
    packing: Packing
    lat: Latencies
    dag: CompiledSchedule | None  # the co-located planner's compiled schedule
    base_s: float
    lower_bound_s: float
    fits: bool
    noisy: JitteredLatencies | None = None  # jitter draws (co-located planner only)
    best_s: float = np.inf
    order: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    schedule: Interleaved | None = None  # the separated planner's best table
