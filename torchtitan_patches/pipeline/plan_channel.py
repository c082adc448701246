"""One planner, every rank: rank 0 plans and broadcasts each step's plan to the pipeline ranks.

Planning on every rank could diverge (a time budget may fall back on one rank and not another),
so rank 0 owns the planner (a function from batch metadata to ``IterationPlan``, usually
``AsyncPlanner.plan``) and the others receive its plans. Each rank's
dataloader uses a ``PlanChannel`` as its packing source; loaders ask for steps in the same order
on every rank, so the broadcasts pair up. A dedicated gloo group keeps them apart from the
pipeline's point-to-point traffic.
"""

from __future__ import annotations

import torch.distributed as dist

from typing import Callable

from pipetune.data.batch import BatchMeta
from pipetune.plan.plan import IterationPlan, PlanError


class PlanChannel:
    def __init__(self, planner: Callable[[BatchMeta], IterationPlan] | None, *, src: int = 0, group=None):
        self.rank = dist.get_rank()
        if (planner is None) == (self.rank == src):
            raise ValueError(f"rank {src} must own the planner and only it (this is rank {self.rank})")
        self.planner = planner
        self.src = src
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self._plans: dict[int, IterationPlan] = {}

    def __call__(self, meta: BatchMeta) -> list[list[int]]:
        box = [None]
        if self.planner is not None:
            box[0] = self.planner(meta).to_json()
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        plan = IterationPlan.from_json(box[0], batch_ids=meta.table.ids)
        if plan.step != meta.step:
            raise PlanError(f"rank {self.rank} asked for step {meta.step} but received the plan of step {plan.step}")
        self._plans[meta.step] = plan
        return [list(mb) for mb in plan.micro_batches]

    def pop(self, step: int) -> IterationPlan:
        if step not in self._plans:
            raise PlanError(f"no plan for step {step} on rank {self.rank}")
        return self._plans.pop(step)
