"""Per plan family, how far measured steps run from the calibrated prediction.

The online calibration refits per-component scales, per-call overheads and the contention term
(work slowed while another rank is busy) to recent action times, but some costs depend on the
plan as a whole: a plan of many small micro-batches has more synchronisation points, each of
which waits for the slowest of two jittering ranks, and under contention its messages and
wake-ups slow down more than the table's per-call terms say.
The calibration sees mostly the plans the planner prefers, so such a bias against one micro-batch
size can persist and keep the planner choosing it.

``FamilyCorrection`` keeps, per micro-batch size (the plan family the planner chooses between),
the last ``window`` log ratios of measured to predicted iteration time, and gives each size a
factor: its mean log ratio relative to the mean over all recent steps (a bias common to every
plan does not change which plan wins), shrunk towards zero by ``n / (n + prior)`` so that one
noisy step moves nothing far. The planner multiplies each size's candidates by its factor when
it picks the size (``Planner.set_correction``); orders and pre-computation within a size are
unaffected. Sizes never measured keep the factor 1. Limits: a size the planner stops choosing is
measured again only by the trainer's calibration steps and guard probes, so its factor can age.
"""

from __future__ import annotations

import math
from collections import deque


class FamilyCorrection:
    def __init__(self, *, window: int = 16, prior: float = 4.0):
        if window < 1 or prior < 0:
            raise ValueError(f"family correction: need window >= 1 and prior >= 0, got {window}, {prior}")
        self.window, self.prior = window, prior
        self.recent: deque[tuple[int, float]] = deque(maxlen=4 * window)
        self.by_mbs: dict[int, deque[float]] = {}

    def observe(self, mbs: int, measured_s: float, predicted_s: float) -> None:
        if not (measured_s > 0 and predicted_s > 0):
            raise ValueError(f"family correction: times must be positive, got measured {measured_s}, predicted {predicted_s}")
        r = math.log(measured_s / predicted_s)
        self.recent.append((mbs, r))
        self.by_mbs.setdefault(mbs, deque(maxlen=self.window)).append(r)

    def factors(self) -> dict[int, float]:
        """Multiplicative correction per micro-batch size measured so far."""
        if not self.recent:
            return {}
        pooled = sum(r for _, r in self.recent) / len(self.recent)
        out = {}
        for mbs, rs in self.by_mbs.items():
            n = len(rs)
            out[mbs] = math.exp(n / (n + self.prior) * (sum(rs) / n - pooled))
        return out

    def state_dict(self) -> dict:
        return {"recent": list(self.recent), "by_mbs": {str(k): list(v) for k, v in self.by_mbs.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.recent = deque((tuple(x) for x in state["recent"]), maxlen=4 * self.window)
        self.by_mbs = {int(k): deque(v, maxlen=self.window) for k, v in state["by_mbs"].items()}
