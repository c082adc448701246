"""Plans of data-parallel pipeline replicas, each made where the replica runs (torch-free).

With data parallelism each global batch is split over the ``D`` replicas
(``pipetune.plan.data_parallel.dp_balance``), each replica's share gets its own plan (micro-batch size, count,
order, encoder placement), and the step lasts as long as its slowest replica. The split is the
only global decision and it is cheap and deterministic, so every replica computes it itself and
plans its own share (``SharePlanner``), in parallel with every other replica: planning time on a
step's critical path is one split plus one replica's plan, whatever ``D``.

``ReplicaPlans`` are the plans of consecutive replicas ``first .. first + len(plans) - 1`` of a
job's ``job_replicas`` for one step: one replica's in a job (what its lead rank sends its
pipeline), every replica's in a recording. They travel as one JSON document.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pipetune.data.batch import BatchMeta
from pipetune.plan.data_parallel.dp_balance import ShareCost, Split, replica_meta, split_batch
from pipetune.plan.plan import IterationPlan, PlanError
from pipetune.plan.search.planner import Planner

FORMAT = "pipetune.replica_plans"


@dataclass(frozen=True)
class ReplicaPlans:
    """Plan ``k`` runs replica ``first + k``'s share of batch ``step``, of ``job_replicas``."""

    step: int
    plans: tuple[IterationPlan, ...]
    first: int = 0
    job_replicas: int = 1

    @property
    def whole(self) -> bool:
        """Whether these are every replica's plans (so together they cover the batch)."""
        return self.first == 0 and self.replicas == self.job_replicas

    @property
    def replicas(self) -> int:
        return len(self.plans)

    @property
    def slowest(self) -> int:
        return max(range(self.replicas), key=lambda r: self.plans[r].predicted_s)

    @property
    def predicted_s(self) -> float:
        """The predicted time of the slowest of these replicas."""
        return self.plans[self.slowest].predicted_s

    @property
    def mbs(self) -> int:
        """The slowest replica's micro-batch size (the one a fallback keeps)."""
        return self.plans[self.slowest].mbs

    def metas(self, meta: BatchMeta) -> list[BatchMeta]:
        """Each replica's share of ``meta``."""
        return [meta.share(p.sample_ids()) for p in self.plans]

    def validate(self, batch_ids=None) -> "ReplicaPlans":
        """Every plan is of this step, no sample is in two plans, and all are in the batch
        (``batch_ids``); every replica's plans together cover it."""
        if not self.plans:
            raise PlanError(f"step {self.step}: no replica plans")
        if not (0 <= self.first and self.first + self.replicas <= self.job_replicas):
            raise PlanError(f"step {self.step}: plans of replicas {self.first}..{self.first + self.replicas - 1} of a job "
                            f"with {self.job_replicas}")
        for r, p in enumerate(self.plans):
            if p.step != self.step:
                raise PlanError(f"step {self.step}: replica {self.first + r}'s plan is of step {p.step}")
            p.validate()
        ids = [s for p in self.plans for s in p.sample_ids()]
        if len(set(ids)) != len(ids):
            twice = sorted({s for s in ids if ids.count(s) > 1})[:5]
            raise PlanError(f"step {self.step}: samples {twice} are in two replicas' plans")
        if batch_ids is not None:
            batch = set(int(i) for i in batch_ids)
            extra = sorted(set(ids) - batch)[:5]
            missing = sorted(batch - set(ids))[:5] if self.whole else []
            if extra or missing:
                raise PlanError(f"step {self.step}: the replicas' plans do not " + ("cover" if self.whole else "fit")
                                + f" the batch (missing {missing}, extra {extra})")
        return self

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "step": self.step, "first": self.first, "job_replicas": self.job_replicas,
                           "plans": [p.to_json() for p in self.plans]})

    @classmethod
    def from_json(cls, text: str, batch_ids=None) -> "ReplicaPlans":
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise PlanError("not a pipetune replica-plans document")
            out = cls(int(raw["step"]), tuple(IterationPlan.from_json(p) for p in raw["plans"]), int(raw["first"]), int(raw["job_replicas"]))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise PlanError(f"replica plans are malformed: {type(e).__name__}: {e}") from None
        return out.validate(batch_ids)


@dataclass(frozen=True)
class ReplicaShare:
    """Replica ``replica``'s share of each global batch of a job with ``replicas`` replicas: the
    balanced split where ``share_cost`` is given, else round-robin."""

    replicas: int
    replica: int = 0
    share_cost: ShareCost | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.replica < self.replicas:
            raise ValueError(f"replica {self.replica} is not one of 0..{self.replicas - 1}")

    def split(self, meta: BatchMeta) -> Split:
        return split_batch(meta, self.replicas, self.share_cost, balanced=self.share_cost is not None)

    def of(self, meta: BatchMeta) -> BatchMeta:
        """This replica's share of global batch ``meta`` (all of it with one replica), carrying
        the whole batch's totals."""
        return replica_meta(meta, self.split(meta).replicas[self.replica])

    def plans(self, share: BatchMeta, plan: IterationPlan) -> "SharePlan":
        """``plan`` as this replica's plan of ``share``."""
        return SharePlan(ReplicaPlans(share.step, (plan,), self.replica, self.replicas), share)


@dataclass(frozen=True)
class SharePlan:
    """A replica's plan of its share of a step, with the share's metadata (``share.whole``: what
    the replica needs of the global batch), so its ranks need not read the global batch."""

    plans: ReplicaPlans
    share: BatchMeta

    @property
    def plan(self) -> IterationPlan:
        return self.plans.plans[0]

    @property
    def predicted_s(self) -> float:
        return self.plan.predicted_s

    @property
    def mbs(self) -> int:
        return self.plan.mbs

    def validate(self, batch_ids=None) -> "SharePlan":
        """The plan packs exactly the share (of the batch ``batch_ids`` when given)."""
        self.plans.validate(batch_ids)
        self.plan.validate(self.share.table.ids)
        return self


class SharePlanner:
    """``planner`` planning one replica's share of each global batch (a ``SharePlan``). Reads and
    settings reach the wrapped planner, so the calibration, the correction and the guard treat it
    as that planner."""

    def __init__(self, planner: Planner, share: ReplicaShare):
        self.planner, self.share = planner, share

    def plan(self, meta: BatchMeta, *, deadline: float | None = None) -> SharePlan:
        share = self.share.of(meta)
        return self.share.plans(share, self.planner.plan(share, deadline=deadline))

    def fallback(self, meta: BatchMeta, why: str) -> SharePlan:
        share = self.share.of(meta)
        return self.share.plans(share, self.planner.fallback(share, why))

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
