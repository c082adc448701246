"""How much measured action times spread around their predictions (issue 14): the variability model.

An iteration is a longest path through actions that jitter, so its expected time exceeds the
time of its typical actions, and more so for plans with many short actions (more synchronisation
points). The simulator's ``pipetune.simulate.jitter`` draws per-action noise from this model.

Per action kind (a stage's forward + backward of one micro-batch, an encoder forward, a
micro-batch's messages), ``ln(measured / predicted)`` is modelled as normal with variance

    log_var + log_var_s / max(predicted_s, min_s)

a relative spread that grows as actions get shorter: a constant part (clock and contention
changes that stretch everything alike) plus interruptions that arrive at a rate in time, whose
relative variance on an action of ``d`` seconds falls as ``1 / d``. ``min_s`` is the shortest
predicted action the fit saw; shorter ones keep the variance it has there, so the model never
extrapolates ``1 / d`` towards infinity.

Why this form: on the 2-core CPU test machine (tiny model, 2 gloo ranks, two pipelined training
runs with 45 measured steps each, 508-606 stage and 242-282 encoder observations per run; other
jobs running, load average 4 on 2 cores, so these are spreads under contention and table misfit,
not clean jitter), the log-ratio variance of encoder forwards fell
from 1.07-1.39 (0.7-1 ms) to 0.73 (1.3-2 ms) in one run and from 0.96 (1-1.2 ms) to 0.44
(2-3 ms) in the other; for stage actions the shortest sixth (9-70 ms) had 0.11 and 0.096
against 0.060-0.095 for the longer ones (up to 325 ms), a weaker and not monotonic trend.
``a + b / d`` follows this with two numbers a sliding window of steps can fit, where per-size
bins would need more observations per bin than it holds.

``fit_spread`` fits one kind from calibration's residuals (after the scale / overhead fit): the
squared deviations of the log-ratios from their mean are regressed on ``[1, 1 / predicted]`` by
non-negative least squares, re-weighted by the fitted variance (squared normal deviates scatter in
proportion to it). Limits: whatever the table's curves cannot represent (a systematic, size-
dependent misfit) counts as spread too, so the model is an upper bound on pure jitter; messages
are not timed by the runtime, so ``p2p`` is never fitted (zero unless a table sets it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import nnls

MIN_OBSERVATIONS = 8
REWEIGHT_ROUNDS = 3


@dataclass(frozen=True, kw_only=True)
class Spread:
    """Variance of ``ln(measured / predicted)`` of one action kind: ``log_var + log_var_s / max(d, min_s)``."""

    log_var: float = 0.0
    log_var_s: float = 0.0
    min_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("log_var", "log_var_s", "min_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.log_var_s > 0 and self.min_s <= 0:
            raise ValueError(f"min_s must be > 0 when log_var_s > 0 (got {self.min_s!r})")

    def variance(self, predicted_s: np.ndarray) -> np.ndarray:
        """Log-ratio variance of actions predicted to take ``predicted_s`` seconds."""
        d = np.asarray(predicted_s, dtype=np.float64)
        if self.log_var_s == 0:
            return np.full(d.shape, self.log_var)
        return self.log_var + self.log_var_s / np.maximum(d, self.min_s)

    def scaled(self, factor: float) -> "Spread":
        """The same spread of the same actions once every prediction is multiplied by ``factor``."""
        return Spread(log_var=self.log_var, log_var_s=self.log_var_s * factor, min_s=self.min_s * factor)

    def to_dict(self) -> dict:
        return {"log_var": self.log_var, "log_var_s": self.log_var_s, "min_s": self.min_s}


KINDS = ("stage", "encoder", "p2p")


@dataclass(frozen=True, kw_only=True)
class Variability:
    """Spread of a stage's forward + backward of one micro-batch (one factor for both, as observed),
    of an encoder forward, and of one micro-batch's messages."""

    stage: Spread = field(default_factory=Spread)
    encoder: Spread = field(default_factory=Spread)
    p2p: Spread = field(default_factory=Spread)

    def scaled(self, factor: float) -> "Variability":
        return Variability(stage=self.stage.scaled(factor), encoder=self.encoder.scaled(factor), p2p=self.p2p.scaled(factor))

    def to_dict(self) -> dict:
        return {k: getattr(self, k).to_dict() for k in KINDS}


def fit_spread(predicted_s: np.ndarray, measured_s: np.ndarray, previous: Spread) -> Spread:
    """``Spread`` of one kind's observations; ``previous`` when fewer than ``MIN_OBSERVATIONS``."""
    d = np.asarray(predicted_s, dtype=np.float64)
    y = np.asarray(measured_s, dtype=np.float64)
    ok = (d > 0) & (y > 0)
    d, y = d[ok], y[ok]
    if len(d) < MIN_OBSERVATIONS:
        return previous
    r = np.log(y / d)
    sq = (r - r.mean()) ** 2 * len(r) / (len(r) - 1)
    X = np.column_stack([np.ones_like(d), 1.0 / d])
    w = np.ones_like(d)
    for _ in range(REWEIGHT_ROUNDS):
        coef, _ = nnls(X * w[:, None], sq * w)
        fitted = X @ coef
        if not (fitted > 0).all():
            break
        w = 1.0 / fitted
    return Spread(log_var=float(coef[0]), log_var_s=float(coef[1]), min_s=float(d.min()))
