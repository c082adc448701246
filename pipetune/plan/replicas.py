"""One step's plans for ``D`` data-parallel pipeline replicas (torch-free).

With data parallelism each global batch is split over the replicas (``pipetune.plan.dp_balance``),
each replica's share gets its own plan (micro-batch size, count, order, encoder placement), and
the step lasts as long as its slowest replica. ``ReplicaPlans`` is what rank 0 hands every rank:
it checks that the replicas' plans partition the batch (no sample lost or repeated) and travels
as one JSON document. ``ReplicaPlanner`` makes a single-pipeline ``Planner`` plan a step for
``D`` replicas: the balanced split for the job's own planner, round-robin (TorchTitan's own
split) for the fixed baseline and the calibration plans. With ``D = 1`` both are the plain plan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pipetune.data.batch import BatchMeta
from pipetune.plan.dp_balance import split_and_plan
from pipetune.plan.plan import IterationPlan, PlanError
from pipetune.plan.planner import Planner

FORMAT = "pipetune.replica_plans"


@dataclass(frozen=True)
class ReplicaPlans:
    """Plan ``r`` runs replica ``r``'s share of batch ``step``."""

    step: int
    plans: tuple[IterationPlan, ...]

    @property
    def replicas(self) -> int:
        return len(self.plans)

    @property
    def slowest(self) -> int:
        return max(range(self.replicas), key=lambda r: self.plans[r].predicted_s)

    @property
    def predicted_s(self) -> float:
        """The step's predicted time: its slowest replica's."""
        return self.plans[self.slowest].predicted_s

    @property
    def mbs(self) -> int:
        """The slowest replica's micro-batch size (the one a fallback keeps)."""
        return self.plans[self.slowest].mbs

    def metas(self, meta: BatchMeta) -> list[BatchMeta]:
        """Each replica's share of ``meta``."""
        return [meta.share(p.sample_ids()) for p in self.plans]

    def validate(self, batch_ids=None) -> "ReplicaPlans":
        """Every plan is of this step, and together they cover the batch's samples exactly once."""
        if not self.plans:
            raise PlanError(f"step {self.step}: no replica plans")
        for r, p in enumerate(self.plans):
            if p.step != self.step:
                raise PlanError(f"step {self.step}: replica {r}'s plan is of step {p.step}")
            p.validate()
        ids = [s for p in self.plans for s in p.sample_ids()]
        if len(set(ids)) != len(ids):
            twice = sorted({s for s in ids if ids.count(s) > 1})[:5]
            raise PlanError(f"step {self.step}: samples {twice} are in two replicas' plans")
        if batch_ids is not None and sorted(ids) != sorted(int(i) for i in batch_ids):
            missing = sorted(set(int(i) for i in batch_ids) - set(ids))[:5]
            extra = sorted(set(ids) - set(int(i) for i in batch_ids))[:5]
            raise PlanError(f"step {self.step}: the replicas' plans do not cover the batch (missing {missing}, extra {extra})")
        return self

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "step": self.step, "plans": [p.to_json() for p in self.plans]})

    @classmethod
    def from_json(cls, text: str, batch_ids=None) -> "ReplicaPlans":
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise PlanError("not a pipetune replica-plans document")
            out = cls(int(raw["step"]), tuple(IterationPlan.from_json(p) for p in raw["plans"]))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise PlanError(f"replica plans are malformed: {type(e).__name__}: {e}") from None
        return out.validate(batch_ids)


class ReplicaPlanner:
    """``planner`` planning every replica of a step (``balanced``: the FLOPs- and
    simulation-balanced split, else round-robin). Reads and settings reach the wrapped planner,
    so the calibration, the correction and the guard treat it as that planner."""

    def __init__(self, planner: Planner, replicas: int, *, balanced: bool):
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.planner, self.replicas, self.balanced = planner, replicas, balanced

    def plan(self, meta: BatchMeta, *, deadline: float | None = None) -> ReplicaPlans:
        if self.replicas == 1:
            return ReplicaPlans(meta.step, (self.planner.plan(meta, deadline=deadline),))
        split = split_and_plan(meta, self.replicas, self.planner.model, lambda m: self.planner.plan(m, deadline=deadline),
                               balanced=self.balanced)
        return ReplicaPlans(meta.step, tuple(split.plans))

    @property
    def cost(self):
        return self.planner.cost

    @property
    def config(self):
        return self.planner.config

    @property
    def max_mbs(self) -> int:
        return self.planner.max_mbs

    @property
    def fixed_mbs(self) -> int:
        return self.planner.fixed_mbs

    @property
    def last_mbs(self) -> int:
        return self.planner.last_mbs

    @last_mbs.setter
    def last_mbs(self, mbs: int) -> None:
        self.planner.last_mbs = mbs

    def set_cost(self, cost) -> None:
        self.planner.set_cost(cost)

    def set_correction(self, factors) -> None:
        self.planner.set_correction(factors)
