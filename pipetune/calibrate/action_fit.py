"""Fit a latency table to measured times (DIP-style calibration).

Each observation is a measured latency of one micro-batch: a stage's forward, backward or both
(``part``), or the vision encoder's forward. Its prediction is linear in the unknowns: one scale
factor per table component (attention, rest, embedding, head, projector, encoder) and the fixed
seconds of a stage forward and of a stage backward call (runtime overhead the isolated profile
cannot see). We solve non-negative least squares, weighting each row by 1 / measured so the fit
minimises relative error, and re-weight it Huber-style (``HUBER_DELTA`` relative error) so a few
timings hit by machine noise do not drag the fit. A ridge term pulls every unknown towards its current value (``RIDGE`` per
unknown, in units of squared relative error; an overhead counts relative to the median measured
time): an unknown that timings cannot identify (the embedding is a tiny part of every
observation; a per-call overhead and the ``rest`` scale look alike when all micro-batches are
the same size) would otherwise take an absurd value. Unknowns no observation exercises keep
their value.

Observations from a pipeline's own timelines also carry their overlap with other ranks' work
(``Observation.concurrent_s``), and the fit finds the table's ``contention`` kappa
(``pipetune.simulate.contention``) with them: an observation overlapped for a fraction ``phi`` of
its uncontended time takes ``1 + kappa phi`` times that time, so each kappa on a grid scales the
rows and the linear fit above is solved per kappa; the kappa of least (Huber) loss, its ridge
term towards the table's kappa included, wins (``fit_contention=False`` holds the table's
kappa). The overlap enters as a fraction, not as seconds: overlapped seconds grow with the
observation's own noise and, where nearly every action overlaps (deep pipelines), would trade
one-for-one against the scales. Isolated timings have no overlap and leave kappa as it was.

Split backwards (zero-bubble plans) also time each backbone backward's input-gradient part ``I``
alone (``Part.INPUT_GRAD``; the stage observation still sums ``F``, ``I`` and ``W``). The fit above
ignores these rows; a second fit, the first's scales, overheads and kappa held, finds per
component a factor on its input-gradient part (``I`` is linear in the factors), solved the same
way: relative-error NNLS, Huber re-weighted, ridge pulling each factor towards 1 (the table's
split). A factor is capped where the part would exceed the component's backward, and the refitted
table carries the parts as its curves' ``bwd_input`` (``with_input_grad``), so the cost model
prices ``I`` and ``W`` with the measured split. Components whose split their structure fixes
are not fitted (``INPUT_GRAD_FITTED``), components no ``I`` row exercises keep their split, and
without ``I`` rows the refit is the whole-backward fit alone. ``I`` pays ``INPUT_GRAD_OVERHEAD`` of
the fitted backward call overhead, which rows of a whole forward + backward cannot tell from the
forward's: where the machine's calls split their overhead otherwise, the factors absorb it.

The residuals of the fit give the table's variability model (``pipetune.cost.variability``): the
spread of measured over predicted time of a stage's forward + backward and of an encoder action
(forward, or backward when trained), as a function of predicted time (a kind with too few
observations keeps its previous spread).

Observations come from ``pipetune calibrate`` (isolated stage timings) or from the runtime's own
action timelines (``pipetune.calibrate.online``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np
from scipy.optimize import nnls

from pipetune.cost.cost_model import INPUT_GRAD_OVERHEAD, INPUT_GRAD_SHARE, CostModel, MicroBatchShapes, input_grad_values
from pipetune.cost.latency_table import CURVES, LatencyTable
from pipetune.cost.variability import Variability, fit_spread

RIDGE = 0.05
HUBER_DELTA = 0.1
HUBER_ROUNDS = 4
CONTENTION_GRID = np.concatenate([np.arange(0.0, 1.0, 0.05), np.arange(1.0, 3.01, 0.25)])
OVERHEAD_GRID = np.arange(0.0, 0.2001, 0.005)  # per-call overhead, in units of the median stage row's time
# components whose I/W split the I rows fit: not attention (no weights: its I is its whole
# backward) nor the embedding (its input, token ids, takes no gradient)
INPUT_GRAD_FITTED = tuple(n for n in INPUT_GRAD_SHARE if n not in ("attention", "embedding"))


class Observed(Enum):
    """Whose work an observation timed."""

    STAGE = "stage"
    ENCODER = "encoder"


class Part(Enum):
    """Which passes an observation timed (the value: the table's curve names)."""

    FWD = ("fwd",)
    BWD = ("bwd",)
    BOTH = ("fwd", "bwd")
    INPUT_GRAD = ("bwd_input",)  # a split backward's I alone


@dataclass(frozen=True)
class Observation:
    """A measured latency (seconds) of micro-batch ``shapes`` (a single one): ``part`` of its
    work on backbone ``stage`` (``Observed.STAGE``), or ``part`` of the encoder's work on its
    ``shapes.images`` images on encoder chunk ``stage`` (``Observed.ENCODER``; the chunk's share
    of the encoder's layers, see ``pipetune.cost.cost_model``). ``concurrent_s``: of ``seconds``,
    how many ran while another rank was busy."""

    shapes: MicroBatchShapes
    seconds: float
    stage: int = 0
    kind: Observed = Observed.STAGE
    part: Part = Part.BOTH
    concurrent_s: float = 0.0


@dataclass(frozen=True)
class CalibrationReport:
    scales: dict[str, float]
    overhead: dict[str, float]
    mean_abs_pct_error_before: float
    mean_abs_pct_error_after: float
    observations: int
    makespan_factor: float = 1.0
    contention: float = 0.0
    input_grad: dict[str, float] = field(default_factory=dict)  # fitted factor on each exercised component's I


UNKNOWNS = (*CURVES, "fwd_s", "bwd_s")


@dataclass(frozen=True)
class Design:
    """Calibration's linear system for some observations: row ``i`` of ``X`` holds the unscaled
    contribution of each of ``UNKNOWNS`` to observation ``i``, whose measured seconds are ``y[i]``,
    of which the fraction ``overlap[i]`` ran while another rank was busy; ``input_grad[i]``: it
    observes a split backward's ``I`` alone. Rows depend on a table's
    curves and the stage layout only, not on its scales, overheads or contention, so they can be
    built once and refitted many times (sliding windows, leave-one-out)."""

    X: np.ndarray
    y: np.ndarray
    overlap: np.ndarray | None = None
    input_grad: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.overlap is None:
            object.__setattr__(self, "overlap", np.zeros(len(self.y)))
        if self.input_grad is None:
            object.__setattr__(self, "input_grad", np.zeros(len(self.y), bool))

    @classmethod
    def of(cls, cost: CostModel, observations: list[Observation]) -> "Design":
        """Rows of ``observations`` under ``cost``'s curves; an ``I`` of stage 0 that has nothing to do
        (``CostModel.input_grad_idle``) is left out: the cost model prices it at zero."""
        observations = [o for o in observations
                        if not (o.part is Part.INPUT_GRAD and o.stage == 0 and cost.input_grad_idle(o.shapes)[0])]
        rows = []
        for obs in observations:
            parts, _ = cost.components(obs.shapes)
            which = obs.part.value
            if obs.kind is Observed.ENCODER:
                seconds = sum(cost.encoder_curve(obs.shapes.images, w)[0][0] for w in which)
                if cost.recompute_encoder and "bwd" in which:
                    seconds += cost.encoder_curve(obs.shapes.images, "fwd")[0][0]  # the backward re-runs the forward
                rows.append([seconds * cost.encoder_share[obs.stage] if n == "encoder" else 0.0 for n in UNKNOWNS])
                continue
            row = [sum(parts[n][w][0, obs.stage] for w in which) if n in parts else 0.0 for n in CURVES]
            rows.append(row + [float("fwd" in which), float("bwd" in which) + INPUT_GRAD_OVERHEAD * ("bwd_input" in which)])
        y = np.asarray([o.seconds for o in observations], dtype=np.float64)
        shared = np.asarray([o.concurrent_s for o in observations], dtype=np.float64)
        return cls(np.asarray(rows).reshape(-1, len(UNKNOWNS)), y, np.clip(shared / np.where(y > 0, y, 1.0), 0.0, 1.0),
                   np.array([o.part is Part.INPUT_GRAD for o in observations], bool))

    @classmethod
    def stack(cls, designs: list["Design"]) -> "Design":
        return cls(np.vstack([d.X for d in designs]), np.concatenate([d.y for d in designs]), np.concatenate([d.overlap for d in designs]),
                   np.concatenate([d.input_grad for d in designs]))

    def rows(self, mask: np.ndarray) -> "Design":
        """The rows ``mask`` selects."""
        return Design(self.X[mask], self.y[mask], self.overlap[mask], self.input_grad[mask])

    def slowdown(self, contention: float) -> np.ndarray:
        """Per row, measured over uncontended time under ``contention``: ``1 + kappa phi`` with
        ``phi`` the overlapped fraction of the uncontended time (the measured fraction shrunk back)."""
        phi = self.overlap / (1 + contention * (1 - self.overlap))
        return 1 + contention * phi

    def stage_work_rows(self) -> np.ndarray:
        """Rows observing a stage's forward + backward (both per-call overheads count once)."""
        return (self.X[:, UNKNOWNS.index("fwd_s")] == 1) & (self.X[:, UNKNOWNS.index("bwd_s")] == 1)

    def encoder_rows(self) -> np.ndarray:
        """Rows observing encoder work, a chunk's forward or backward (its only non-zero unknown is
        the encoder scale)."""
        return self.X[:, UNKNOWNS.index("encoder")] > 0


def calibrate(table: LatencyTable, cost: CostModel, observations: list[Observation]) -> tuple[LatencyTable, CalibrationReport]:
    """Return ``table`` with fitted scales and overheads, and the error before and after."""
    return calibrate_design(table, Design.of(cost, observations))


def _huber(rel: np.ndarray) -> np.ndarray:
    a = np.abs(rel)
    return np.where(a <= HUBER_DELTA, 0.5 * a**2, HUBER_DELTA * (a - 0.5 * HUBER_DELTA))


def _fit(X: np.ndarray, y: np.ndarray, before: np.ndarray, used: np.ndarray, prior: np.ndarray) -> tuple[np.ndarray, float]:
    """Ridge-regularised, Huber-reweighted relative-error NNLS of ``y`` on ``X[:, used]`` (the
    other unknowns held at ``before``): the fit and its loss."""
    held = np.setdiff1d(np.arange(X.shape[1]), used)
    rest = y - X[:, held] @ before[held]
    w = 1.0 / y
    for _ in range(HUBER_ROUNDS):
        A = np.vstack([X[:, used] * w[:, None], prior])
        b = np.concatenate([rest * w, prior @ before[used]])
        fit, _ = nnls(A, b)
        rel = (X[:, used] @ fit - rest) / y
        w = np.minimum(1.0, HUBER_DELTA / np.maximum(np.abs(rel), 1e-12)) / y
    return fit, float(_huber(rel).sum() + 0.5 * np.sum((prior @ (fit - before[used])) ** 2))


def calibrate_design(table: LatencyTable, design: Design, *, fit_contention: bool = True,
                     fit_overhead: bool = True) -> tuple[LatencyTable, CalibrationReport]:
    """``calibrate`` on prepared rows (built from ``table``'s curves and layout); with
    ``fit_contention=False`` the table's kappa is held, with ``fit_overhead=False`` its per-call
    overheads. ``I`` rows are fitted after the rest (see the module doc)."""
    if (design.y <= 0).any():
        raise ValueError("calibration observations must have positive measured times")
    split, design = design.rows(design.input_grad), design.rows(~design.input_grad)
    X, y = design.X, design.y
    if not len(y):
        raise ValueError("calibration needs at least one measured observation")
    before = np.array([table.scale(n) for n in CURVES] + [table.fixed("fwd"), table.fixed("bwd")])
    used = np.flatnonzero((np.abs(X).sum(axis=0) > 0) & (fit_overhead | (np.arange(len(UNKNOWNS)) < len(CURVES))))
    is_scale = used < len(CURVES)
    prior = np.sqrt(RIDGE) * np.diag(np.where(is_scale, 1.0, 1.0 / np.median(y)))
    grid = CONTENTION_GRID if fit_contention and design.overlap.any() else np.array([table.contention])
    best = None
    for kappa in grid:
        fit, loss = _fit(X * design.slowdown(kappa)[:, None], y, before, used, prior)
        loss += 0.5 * RIDGE * (kappa - table.contention) ** 2
        if best is None or loss < best[2]:
            best = (kappa, fit, loss)
    contention, fit, _ = best
    after = before.copy()
    after[used] = np.where((fit > 0) | ~is_scale, fit, before[used])
    Xk = X * design.slowdown(contention)[:, None]

    def err(s: np.ndarray, Xs: np.ndarray) -> float:
        return float(np.mean(np.abs(Xs @ s - y) / y) * 100)

    scales = {n: float(v) for n, v in zip(CURVES, after) if v != 1.0 or n in table.scales}
    overhead = {n: float(v) for n, v in zip(UNKNOWNS[len(CURVES):], after[len(CURVES):]) if v > 0}
    input_grad = _fit_input_grad(table, split, after, contention)
    report = CalibrationReport(scales, overhead, err(before, X * design.slowdown(table.contention)[:, None]), err(after, Xk), len(y),
                               contention=float(contention), input_grad=input_grad)
    previous = table.variability or Variability()
    predicted = Xk @ after
    stage, enc = design.stage_work_rows(), design.encoder_rows()
    fitted = Variability(stage=fit_spread(predicted[stage], y[stage], previous.stage),
                         encoder=fit_spread(predicted[enc], y[enc], previous.encoder), p2p=previous.p2p)
    variability = fitted if fitted != Variability() else table.variability
    table = replace(table, scales=scales, overhead=overhead, variability=variability, contention=float(contention))
    return with_input_grad(table, input_grad), report


def _fit_input_grad(table: LatencyTable, design: Design, unknowns: np.ndarray, contention: float) -> dict[str, float]:
    """Per component of ``INPUT_GRAD_FITTED`` that ``design``'s ``I`` rows exercise, the factor on
    its input-gradient part that best predicts them (``_fit``, ridge towards 1), with every other
    term held at the whole-backward fit (``unknowns``, ``contention``); capped where the part would
    exceed the component's backward at a grid point."""
    X = design.X * design.slowdown(contention)[:, None] * unknowns[None, :]  # seconds of each term at the fitted values
    used = np.flatnonzero([n in INPUT_GRAD_FITTED and X[:, i].any() for i, n in enumerate(UNKNOWNS)])
    if not len(used):
        return {}
    fit, _ = _fit(X, design.y, np.ones(len(UNKNOWNS)), used, np.sqrt(RIDGE) * np.eye(len(used)))
    out = {}
    for i, f in zip(used, fit):
        name = UNKNOWNS[i]
        curve, part = table.curves[name], input_grad_values(name, table.curves[name])
        out[name] = float(min(f, np.min(curve.bwd[part > 0] / part[part > 0])))
    return out


def with_input_grad(table: LatencyTable, factors: dict[str, float]) -> LatencyTable:
    """``table`` whose components' input-gradient parts are ``factors`` times the cost model's (see
    ``input_grad_values``), written as their curves' ``bwd_input`` (at most the backward)."""
    if not factors:
        return table
    curves = dict(table.curves)
    for name, f in factors.items():
        c = curves[name]
        curves[name] = replace(c, bwd_input=np.minimum(f * input_grad_values(name, c), c.bwd))
    return replace(table, curves=curves)
