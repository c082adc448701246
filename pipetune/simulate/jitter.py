"""Expected iteration time under per-action jitter: a Monte-Carlo estimate on top of ``evaluate``.

A makespan is a maximum over paths of sums of action times, a convex function of them, so with
noisy actions its expectation exceeds the makespan of the expected times, and the more so the
more paths are nearly critical (many micro-batches, many synchronisation points) and the shorter
the actions (they jitter relatively more, see ``pipetune.cost.variability``). Scoring plans by
expected makespan lets the planner prefer plans whose advantage survives noise.

``jitter`` draws ``K`` multiplicative factors per action from the table's variability model:
one per (micro-batch, stage) shared by its forward and backward (calibration observes their sum),
one per encoder forward and one per micro-batch's messages (the simulator's ``p2p`` is per
micro-batch). Factors are ``exp(sigma z)`` divided by their mean over the ``K`` draws, so each
action's factors average exactly one: the estimate is then never below the deterministic makespan
(Jensen's inequality holds on the draws themselves, not only in expectation), equals it when the
model has no spread, and equals the sum of the expected times on a single chain of actions. The
price is a spread slightly below the model's for small ``K``. The noisy copies are stacked along
the micro-batch axis (row ``k * m + i`` is draw ``k`` of micro-batch ``i``), so offsetting every
candidate's order by ``k * m`` times all draws of all candidates in one ``evaluate`` call.

Common random numbers: the draws depend only on the seed (the planner passes its own seed and
the step), so every order and encoder placement of one packing sees the same noise and their
comparison carries no Monte-Carlo noise of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetune.cost.variability import Spread, Variability
from pipetune.schedule.table import ScheduleTable
from pipetune.simulate.dag import CompiledSchedule, compile_schedule
from pipetune.simulate.simulator import Latencies, evaluate


@dataclass(frozen=True)
class JitteredLatencies:
    """``draws`` noisy copies of ``m`` micro-batches' latencies, row ``k * m + i`` = draw ``k`` of ``i``."""

    lat: Latencies
    draws: int
    m: int


def _factors(spread: Spread, predicted_s: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Mean-one factors over the draws (axis 0) with log-variance ``spread.variance(predicted_s)``."""
    u = np.exp(np.sqrt(spread.variance(predicted_s)) * z)
    return u / u.mean(axis=0)


def jitter(lat: Latencies, variability: Variability, draws: int, seed) -> JitteredLatencies:
    """``draws`` (>= 2) noisy copies of ``lat``; ``seed`` is anything ``numpy.random.default_rng`` takes."""
    if draws < 2:
        raise ValueError(f"jitter needs at least 2 draws (their mean is normalised to one), got {draws}")
    m, S = lat.fwd.shape
    rng = np.random.default_rng(seed)
    stage = _factors(variability.stage, lat.fwd + lat.bwd, rng.standard_normal((draws, m, S)))
    enc = _factors(variability.encoder, lat.encoder, rng.standard_normal((draws, m)))
    p2p = _factors(variability.p2p, lat.p2p, rng.standard_normal((draws, m)))

    def stack(x: np.ndarray) -> np.ndarray:
        return np.tile(x, (draws,) + (1,) * (x.ndim - 1))

    noisy = Latencies(
        fwd=(lat.fwd * stage).reshape(draws * m, S),
        bwd=(lat.bwd * stage).reshape(draws * m, S),
        encoder=(lat.encoder * enc).reshape(-1),
        p2p=(lat.p2p * p2p).reshape(-1),
        activation_bytes=stack(lat.activation_bytes),
        image_feature_bytes=stack(lat.image_feature_bytes),
    )
    return JitteredLatencies(noisy, draws, m)


def draw_makespans(dag: CompiledSchedule, jl: JitteredLatencies, orders: np.ndarray, encoder_slots: np.ndarray | None = None) -> np.ndarray:
    """Makespan of every draw of every candidate, ``[draws, C]`` (arguments as ``evaluate``'s)."""
    orders = np.atleast_2d(np.asarray(orders, dtype=np.int64))
    C = len(orders)
    slots = np.broadcast_to(dag.encoder_slot if encoder_slots is None else encoder_slots, orders.shape)
    offset = (np.arange(jl.draws) * jl.m)[:, None, None]
    every = (orders[None] + offset).reshape(jl.draws * C, jl.m)
    spans = evaluate(dag, jl.lat, every, np.broadcast_to(slots, (jl.draws, C, jl.m)).reshape(jl.draws * C, jl.m)).makespan
    return spans.reshape(jl.draws, C)


def expected_makespan(dag: CompiledSchedule, jl: JitteredLatencies, orders: np.ndarray, encoder_slots: np.ndarray | None = None) -> np.ndarray:
    """Mean makespan over the draws per candidate, ``[C]`` (arguments as ``evaluate``'s)."""
    spans = draw_makespans(dag, jl, orders, encoder_slots)
    low = spans.min(axis=0)
    return low + (spans - low).mean(axis=0)  # exactly the common value when every draw agrees


def expected_time(table: ScheduleTable, lat: Latencies, variability: Variability, draws: int, seed) -> float:
    """Expected makespan of one schedule (micro-batches numbered as in ``lat``)."""
    jl = jitter(lat, variability, draws, seed)
    return float(expected_makespan(compile_schedule(table), jl, np.arange(table.num_micro_batches)[None])[0])
