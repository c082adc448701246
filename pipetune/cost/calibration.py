"""Fit per-component scale factors of a latency table to a few measured times (DIP-style).

Each observation is a measured latency of one micro-batch on one stage (``kind="stage"``,
forward + backward) or of the vision encoder (``kind="encoder"``, forward). Its prediction is a
sum of table components (attention, rest, embedding, head, projector, encoder); we solve
non-negative least squares for one factor per component, weighting each row by 1 / measured so the
fit minimises relative error. A ridge term pulls every factor towards its current value
(``RIDGE`` per component, in units of squared relative error): components that are a tiny part
of every observation (the embedding, say) are not identifiable from timings and would otherwise
take absurd factors. Components no observation exercises keep their factor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import nnls

from pipetune.cost.cost_model import CostModel, MicroBatchShapes
from pipetune.cost.table import CURVES, LatencyTable

RIDGE = 0.05


@dataclass(frozen=True)
class Observation:
    """A measured latency (seconds) of micro-batch ``shapes`` (a single one) on ``stage``."""

    shapes: MicroBatchShapes
    seconds: float
    stage: int = 0
    kind: str = "stage"


@dataclass(frozen=True)
class CalibrationReport:
    scales: dict[str, float]
    mean_abs_pct_error_before: float
    mean_abs_pct_error_after: float
    observations: int


def _design(cost: CostModel, observations: list[Observation]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    names = list(CURVES)
    rows = []
    for obs in observations:
        parts, _ = cost.components(obs.shapes)
        if obs.kind == "encoder":
            rows.append([parts[n]["fwd"][0, 0] if n == "encoder" else 0.0 for n in names])
        else:
            rows.append([0.0 if n == "encoder" else parts[n]["fwd"][0, obs.stage] + parts[n]["bwd"][0, obs.stage] for n in names])
    return np.asarray(rows), np.asarray([o.seconds for o in observations]), names


def calibrate(table: LatencyTable, cost: CostModel, observations: list[Observation]) -> tuple[LatencyTable, CalibrationReport]:
    """Return ``table`` with fitted ``scales`` and the error of its predictions before and after."""
    if not observations:
        raise ValueError("calibration needs at least one measured observation")
    X, y, names = _design(cost, observations)
    if (y <= 0).any():
        raise ValueError("calibration observations must have positive measured times")
    before = np.array([table.scale(n) for n in names])
    used = np.flatnonzero(np.abs(X).sum(axis=0) > 0)
    w = 1.0 / y
    prior = np.sqrt(RIDGE) * np.eye(len(used))
    A = np.vstack([X[:, used] * w[:, None], prior])
    b = np.concatenate([y * w, prior @ before[used]])
    fit, _ = nnls(A, b)
    after = before.copy()
    after[used] = np.where(fit > 0, fit, before[used])
    def err(s: np.ndarray) -> float:
        return float(np.mean(np.abs(X @ s - y) / y) * 100)

    scales = {n: float(v) for n, v in zip(names, after) if v != 1.0 or n in table.scales}
    report = CalibrationReport(scales, err(before), err(after), len(observations))
    return replace(table, scales=scales), report
