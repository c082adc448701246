"""Expected iteration time under per-action jitter: a Monte-Carlo estimate on top of ``evaluate``.

A makespan is a maximum over paths of sums of action times, a convex function of them, so with
noisy actions its expectation exceeds the makespan of the expected times, and the more so the
more paths are nearly critical (many micro-batches, many synchronisation points) and the shorter
the actions (they jitter relatively more, see ``pipetune.cost.variability``). Scoring plans by
expected makespan lets the planner prefer plans whose advantage survives noise.

``jitter`` draws ``K`` multiplicative factors per action from the table's variability model:
one per (micro-batch, stage) shared by its forward and backward (calibration observes their sum),
one per (sub-microbatch, encoder chunk) shared by the encoder's forward and backward, and one per
message. Factors are ``exp(sigma z)`` divided by their mean over the ``K`` draws, so each
action's factors average exactly one: the estimate is then never below the deterministic makespan
(Jensen's inequality holds on the draws themselves, not only in expectation), equals it when the
model has no spread, and equals the sum of the expected times on a single chain of actions. The
price is a spread slightly below the model's for small ``K``. ``simulator.makespans_over`` times
all draws of all candidates in one vectorised pass.

Common random numbers: the draws depend only on the seed (the planner passes its own seed and
the step), so every order and encoder placement of one packing sees the same noise and their
comparison carries no Monte-Carlo noise of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pipetune.cost.variability import Spread, Variability
from pipetune.schedule.table import ScheduleTable
from pipetune.simulate.dag import CompiledSchedule, compile_schedule
from pipetune.simulate.simulator import Latencies, makespans_over


@dataclass(frozen=True)
class JitteredLatencies:
    """Noisy copies of one batch's latencies, one per draw."""

    draws: tuple[Latencies, ...]


def _factors(spread: Spread, predicted_s: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Mean-one factors over the draws (axis 0) with log-variance ``spread.variance(predicted_s)``."""
    u = np.exp(np.sqrt(spread.variance(predicted_s)) * z)
    return u / u.mean(axis=0)


def jitter(lat: Latencies, variability: Variability, draws: int, seed) -> JitteredLatencies:
    """``draws`` (>= 2) noisy copies of ``lat``; ``seed`` is anything ``numpy.random.default_rng`` takes."""
    if draws < 2:
        raise ValueError(f"jitter needs at least 2 draws (their mean is normalised to one), got {draws}")
    rng = np.random.default_rng(seed)
    stage = _factors(variability.stage, lat.fwd + lat.bwd, rng.standard_normal((draws, *lat.fwd.shape)))
    enc = _factors(variability.encoder, lat.encoder, rng.standard_normal((draws, *lat.encoder.shape)))
    p2p = {name: _factors(variability.p2p, getattr(lat, name), rng.standard_normal((draws, *getattr(lat, name).shape)))
           for name in ("p2p", "encoder_p2p", "feature_p2p")}
    return JitteredLatencies(tuple(
        replace(lat, fwd=lat.fwd * stage[k], bwd=lat.bwd * stage[k], bwd_input=lat.bwd_input * stage[k], encoder=lat.encoder * enc[k], encoder_bwd=lat.encoder_bwd * enc[k],
                **{name: getattr(lat, name) * f[k] for name, f in p2p.items()})
        for k in range(draws)))


def draw_makespans(dag: CompiledSchedule, jl: JitteredLatencies, orders: np.ndarray, float_slots: np.ndarray | None = None) -> np.ndarray:
    """Makespan of every draw of every candidate, ``[draws, C]`` (arguments as ``evaluate``'s)."""
    return makespans_over(dag, jl.draws, orders, float_slots)


def expected_makespan(dag: CompiledSchedule, jl: JitteredLatencies, orders: np.ndarray, float_slots: np.ndarray | None = None) -> np.ndarray:
    """Mean makespan over the draws per candidate, ``[C]`` (arguments as ``evaluate``'s)."""
    spans = draw_makespans(dag, jl, orders, float_slots)
    low = spans.min(axis=0)
    return low + (spans - low).mean(axis=0)  # exactly the common value when every draw agrees


def expected_time(table: ScheduleTable, lat: Latencies, variability: Variability, draws: int, seed) -> float:
    """Expected makespan of one schedule (micro-batches numbered as in ``lat``)."""
    jl = jitter(lat, variability, draws, seed)
    return float(expected_makespan(compile_schedule(table), jl, np.arange(table.num_micro_batches)[None])[0])
