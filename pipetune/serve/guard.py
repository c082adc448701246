"""Measured guard: run pipetune's plans only while they are measured faster than the baseline.

The planner predicts; the guard checks what it earns. Per step the trainer reports which kind of
plan ran (pipetune's ``TUNED`` plan, or the ``BASELINE`` plan: balanced packing at the best fixed
micro-batch size, what a careful user would run instead), its measured time, and the predicted
times of both plans for that same batch, by one model (predictions by models of different age
would bias the advantage by how much the model changed). The guard keeps, per kind, the log
ratio of measured to predicted time (the model's bias on that kind of plan: contention,
per-micro-batch overheads and jitter the latency table lacks). A tuned step's *advantage* is
``log(predicted baseline time x baseline bias) - log(measured time)``: what the baseline would
have taken on the same batch, as measured on the baseline's own recent steps, against what the
tuned plan took.

Policy (``GuardConfig``):

* ``TUNED``: tuned plans run; every ``probe_every``-th step runs the baseline instead (a probe,
  so its bias stays measured). Once ``min_steps`` tuned steps are in the window (the last
  ``window`` of them), the guard falls back when the advantage is negative beyond the noise: its
  mean plus ``z`` standard errors (of the tuned steps' advantages and of the baseline bias) is
  below ``-margin``. The baseline bias's error uses one measurement's noise pooled over both
  kinds of plan, since a few probes cannot estimate their own spread.
* ``FALLBACK``: baseline plans run for ``backoff`` steps, then ``RETRY``.
* ``RETRY``: baseline and tuned plans alternate (the baseline first), judged as above on the
  retry's own steps only (every window emptied on entry); falling back again doubles the backoff
  (up to ``max_backoff``); ``window`` tuned steps without falling back return to ``TUNED`` and
  reset it. Why alternate: judged against the fallback's baseline steps, a retry reads a machine
  that slowed since them as a slower plan. On a CPU job whose whole machine slowed ~10 % between
  the last fallback steps and the retry, a retry with a 4-step window fell back on that alone and
  the doubled backoff kept pipetune off for 16 more steps. Interleaved, both kinds see the same
  machine; the price is a retry twice as long, half of it running the baseline as the fallback did.

In ``TUNED`` a drift between probes that exceeds pipetune's advantage can still cause a fallback;
it costs the fallback's steps at the baseline's speed (never a slower plan), and the paired retry
then returns without doubling the backoff.

Until the baseline has been measured, its bias is taken to be the tuned plans' (the model is
trusted as far as it is not contradicted). Decisions take effect from the next plan requested, so
with a dataloader that prefetches ``k`` batches they act ``k`` steps later. The guard is
deterministic given the measurements, and its state is checkpointed with the trainer's.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import Enum

import numpy as np


class PlanKind(str, Enum):
    TUNED = "tuned"
    BASELINE = "baseline"


class GuardState(str, Enum):
    TUNED = "tuned"
    FALLBACK = "fallback"
    RETRY = "retry"


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """Parameters of the policy in the module doc. ``z`` = 1.645 is a one-sided 95 % bound."""

    window: int = 8
    min_steps: int = 4
    z: float = 1.645
    margin: float = 0.0
    probe_every: int = 16
    backoff: int = 8
    max_backoff: int = 128

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.window:
            raise ValueError(f"guard: need 1 <= min_steps <= window, got min_steps={self.min_steps}, window={self.window}")
        if self.z < 0 or self.margin < 0:
            raise ValueError("guard: z and margin must be >= 0")
        if self.probe_every < 2 or self.backoff < 1 or self.max_backoff < self.backoff:
            raise ValueError("guard: need probe_every >= 2, backoff >= 1 and max_backoff >= backoff")


@dataclass(frozen=True)
class Decision:
    """The guard's view after a step: state, advantage estimate and its standard error (log ratios)."""

    state: GuardState
    advantage: float
    stderr: float


class Guard:
    def __init__(self, config: GuardConfig = GuardConfig()):
        self.config = config
        self.state = GuardState.TUNED
        self.advantage: deque[float] = deque(maxlen=config.window)
        self.bias = {kind: deque(maxlen=config.window) for kind in PlanKind}
        self.backoff = config.backoff
        self.fallback_left = 0
        self.since_probe = 0

    def choose(self) -> PlanKind:
        """The kind of plan the next step runs (advances the probe counter)."""
        if self.state is GuardState.FALLBACK:
            return PlanKind.BASELINE
        self.since_probe += 1
        if self.since_probe >= (2 if self.state is GuardState.RETRY else self.config.probe_every):
            self.since_probe = 0
            return PlanKind.BASELINE
        return PlanKind.TUNED

    def observe(self, kind: PlanKind, measured_s: float, predicted_s: float, baseline_predicted_s: float) -> Decision:
        """Record one step (``predicted_s``: the plan that ran; ``baseline_predicted_s``: the
        baseline plan of the same batch) and update the state."""
        if not (measured_s > 0 and predicted_s > 0 and baseline_predicted_s > 0):
            raise ValueError(f"guard: times must be positive, got measured {measured_s}, predicted {predicted_s}, "
                             f"baseline predicted {baseline_predicted_s}")
        self.bias[kind].append(math.log(measured_s / predicted_s))
        if kind is PlanKind.TUNED:
            self.advantage.append(math.log(baseline_predicted_s) - math.log(measured_s))
        if self.state is GuardState.FALLBACK:
            self.fallback_left -= 1
            if self.fallback_left <= 0:
                self.state = GuardState.RETRY
                self.since_probe = 1  # the retry's first step runs the baseline
                for window in (self.advantage, *self.bias.values()):
                    window.clear()
        elif kind is PlanKind.TUNED:
            self._judge()
        return self._decision()

    def _estimate(self) -> tuple[float, float]:
        """Mean advantage corrected by the baseline's measured bias, and its standard error."""
        a = np.asarray(self.advantage)
        if len(a) == 0:
            return math.nan, math.nan
        base = np.asarray(self.bias[PlanKind.BASELINE] or self.bias[PlanKind.TUNED])
        # one measurement's noise, pooled over both kinds (a probe or two alone cannot estimate it)
        groups = [np.asarray(g) for g in self.bias.values() if len(g) > 1]
        dof = sum(len(g) - 1 for g in groups)
        noise = sum(((g - g.mean()) ** 2).sum() for g in groups) / dof if dof else 0.0
        var = (a.var(ddof=1) if len(a) > 1 else noise) / len(a) + noise / len(base)
        return float(a.mean() + base.mean()), math.sqrt(var)

    def _judge(self) -> None:
        if len(self.advantage) < self.config.min_steps:
            return
        mean, se = self._estimate()
        if mean + self.config.z * se < -self.config.margin:
            if self.state is GuardState.RETRY:
                self.backoff = min(2 * self.backoff, self.config.max_backoff)
            self.state = GuardState.FALLBACK
            self.fallback_left = self.backoff
        elif self.state is GuardState.RETRY and len(self.advantage) == self.config.window:
            self.state = GuardState.TUNED
            self.backoff = self.config.backoff

    def _decision(self) -> Decision:
        mean, se = self._estimate()
        return Decision(self.state, mean, se)

    def state_dict(self) -> dict:
        return {"state": self.state.value, "advantage": list(self.advantage), "bias": {k.value: list(v) for k, v in self.bias.items()},
                "backoff": self.backoff, "fallback_left": self.fallback_left, "since_probe": self.since_probe}

    def load_state_dict(self, state: dict) -> None:
        self.state = GuardState(state["state"])
        self.advantage = deque(state["advantage"], maxlen=self.config.window)
        self.bias = {k: deque(state["bias"][k.value], maxlen=self.config.window) for k in PlanKind}
        self.backoff, self.fallback_left, self.since_probe = state["backoff"], state["fallback_left"], state["since_probe"]
