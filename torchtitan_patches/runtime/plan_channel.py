"""One planner, every rank: rank 0 plans and broadcasts each step's plans to every rank.

Planning on every rank could diverge (a time budget may fall back on one rank and not another),
so rank 0 owns the planner (a function from batch metadata to ``ReplicaPlans``, usually
``AsyncPlanner.plan``) and the others receive its plans. Each rank's
dataloader uses a ``PlanChannel`` as its packing source; loaders ask for steps in the same order
on every rank, so the broadcasts pair up. A dedicated gloo group keeps them apart from the
pipeline's point-to-point traffic. A step's plans are a ``ReplicaPlans`` (one plan per
data-parallel replica); every rank checks that they partition the global batch it read and keeps
its replica's plan, whose samples its loader then packs.

Ranks that disagree (started with other ``--modes``/``--steps``, or a rank without a planner)
must fail rather than hang: the group carries the job's timeout (torch's ``new_group`` would
otherwise use its 30-minute default, not the world group's), every rank first learns which ranks
own a planner and which step each one asks for, and any collective that times out is reported
as a ``PlanMismatchError`` naming the step and the timeout.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from pipetune.data.batch import BatchMeta
from pipetune.plan.plan import IterationPlan, PlanError
from pipetune.plan.replicas import ReplicaPlans
from torchtitan_patches.runtime.executor import PlanMismatchError


def group_timeout(group=None) -> timedelta:
    """The timeout of ``group`` (default: the world group), as given to ``init_process_group``."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return dist.distributed_c10d._get_default_timeout(dist.get_backend(pg))


class PlanChannel:
    def __init__(
        self,
        planner: Callable[[BatchMeta], ReplicaPlans] | None,
        *,
        replica: int = 0,
        replicas: int = 1,
        src: int = 0,
        group=None,
        timeout: timedelta | None = None,
    ):
        self.rank = dist.get_rank()
        self.planner = planner
        self.replica, self.replicas = replica, replicas
        self.src = src
        self.timeout = timeout if timeout is not None else group_timeout(group)
        self.group = group if group is not None else self._collective(
            lambda: dist.new_group(backend="gloo", timeout=self.timeout), "opening the plan channel")
        self._plans: dict[int, IterationPlan] = {}
        owners = self._gather(int(planner is not None), "agreeing which rank plans")
        if owners != [int(r == src) for r in range(len(owners))]:
            raise PlanMismatchError(
                f"plan channel: rank {src} must own the planner and only it, but ranks "
                f"{[r for r, o in enumerate(owners) if o]} have one (this is rank {self.rank})"
            )

    def __call__(self, meta: BatchMeta) -> list[list[int]]:
        steps = self._gather(meta.step, f"asking for the plan of step {meta.step}")
        if len(set(steps)) > 1:
            raise PlanMismatchError(
                "plan channel: ranks ask for the plans of different steps ("
                + ", ".join(f"rank {r}: step {s}" for r, s in enumerate(steps))
                + "); were they started with the same --modes, --steps and data?"
            )
        box = [None]
        if self.planner is not None:
            box[0] = self.planner(meta).to_json()
        self._collective(lambda: dist.broadcast_object_list(box, src=self.src, group=self.group),
                         f"receiving the plan of step {meta.step}")
        plans = ReplicaPlans.from_json(box[0], batch_ids=meta.table.ids)
        if plans.step != meta.step:
            raise PlanError(f"rank {self.rank} asked for step {meta.step} but received the plans of step {plans.step}")
        if plans.replicas != self.replicas:
            raise PlanError(f"step {meta.step}: rank {self.src} planned {plans.replicas} data-parallel replicas, this job runs "
                            f"{self.replicas}; a replayed job must have the same data-parallel degree")
        plan = plans.plans[self.replica]
        self._plans[meta.step] = plan
        return [list(mb) for mb in plan.micro_batches]

    def pop(self, step: int) -> IterationPlan:
        if step not in self._plans:
            raise PlanError(f"no plan for step {step} on rank {self.rank}")
        return self._plans.pop(step)

    def _gather(self, value: int, what: str) -> list[int]:
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(self.group))]
        self._collective(lambda: dist.all_gather(out, torch.tensor([value], dtype=torch.int64), group=self.group), what)
        return [int(t.item()) for t in out]

    def _collective(self, op: Callable[[], object], what: str):
        try:
            return op()
        except RuntimeError as e:  # gloo reports a timeout or a closed peer as RuntimeError (DistBackendError)
            raise PlanMismatchError(
                f"plan channel, rank {self.rank}: no answer from the other ranks within {self.timeout.total_seconds():g} s "
                f"while {what}; a rank stopped, or ranks were started with different --modes/--steps ({e})"
            ) from e
