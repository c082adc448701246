"""One planner per replica: its lead rank plans each step and sends the plan to the replica's ranks.

Planning on every rank could diverge (a time budget may fall back on one rank and not another),
so each data-parallel replica's lead (``runtime.replica_groups``) owns its replica's planner (a
function from a step to the ``SharePlan`` of the replica's share, usually ``PlanSource``) and the
replica's other ranks receive its plan with the share's rows and the global batch's totals, from
which they read their share's metadata alone (``BatchReader.rows``): no rank reads the global
batch on its training thread. Each rank's dataloader uses a ``PlanChannel`` as its share source;
loaders ask for steps in the same order on every rank, so the broadcasts pair up. Dedicated gloo groups keep them apart from the pipeline's point-to-point
traffic. Before a lead sends its plan, the leads check together that their plans partition the
global batch (``id_checksum``: one all-reduce of two numbers), so a split computed differently on
one node stops the job at that step instead of dropping or repeating samples; a lead whose
planner raised takes part in that check too (and says so), so no lead waits for it.

Ranks that disagree (started with other ``--modes``/``--steps``, or a rank without a planner)
must fail rather than hang: the groups carry the job's timeout (torch's ``new_group`` would
otherwise use its 30-minute default, not the world group's), every rank first learns which ranks
own a planner and which step each one asks for, and any collective that times out is reported
as a ``PlanMismatchError`` naming the step and the timeout.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from pipetune.data.batch import CHECKSUM_BITS, BatchMeta, BatchReader, BatchTotals, id_checksum
from pipetune.plan.plan import IterationPlan, PlanError
from pipetune.plan.replicas import ReplicaPlans, SharePlan
from torchtitan_patches.runtime.executor import PlanMismatchError

FAILED = -(2**62)  # a lead's count when its planner raised: any sum with it is negative


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
    """``group``: the replica's ranks (default: every rank, one replica); ``src``: its lead's
    global rank, the only one with a ``planner``; ``leads``: the leads' group, on the leads."""

    def __init__(
        self,
        planner: Callable[[int], SharePlan] | None,
        *,
        replica: int = 0,
        replicas: int = 1,
        src: int = 0,
        group=None,
        leads=None,
        timeout: timedelta | None = None,
    ):
        self.rank = dist.get_rank()
        self.planner = planner
        self.replica, self.replicas = replica, replicas
        self.src, self.leads = src, leads
        self.timeout = timeout if timeout is not None else group_timeout(group)
        self.group = group if group is not None else self._collective(
            lambda: dist.new_group(backend="gloo", timeout=self.timeout), "opening the plan channel")
        self._plans: dict[int, IterationPlan] = {}
        members = dist.get_process_group_ranks(self.group)
        owners = self._gather(int(planner is not None), "agreeing which rank plans")
        if owners != [int(r == src) for r in members]:
            raise PlanMismatchError(
                f"plan channel of replica {replica}: rank {src} must own the planner and only it, but ranks "
                f"{[r for r, o in zip(members, owners) if o]} have one (this is rank {self.rank})"
            )

    def share(self, step: int, reader: BatchReader) -> tuple[BatchMeta, list[list[int]]]:
        """This replica's share of batch ``step`` and its packing (sample-id groups); the share's
        metadata is read with ``reader`` from the rows the lead sends."""
        steps = self._gather(step, f"asking for the plan of step {step}")
        if len(set(steps)) > 1:
            members = dist.get_process_group_ranks(self.group)
            raise PlanMismatchError(
                "plan channel: ranks ask for the plans of different steps ("
                + ", ".join(f"rank {r}: step {s}" for r, s in zip(members, steps))
                + "); were they started with the same --modes, --steps and data?"
            )
        box, raised = [None], None
        if self.planner is not None:
            box[0], raised = self._lead(step)
        self._collective(lambda: dist.broadcast_object_list(box, src=self.src, group=self.group),
                         f"receiving the plan of step {step}")
        ok, text, rows, whole = box[0]
        if raised is not None:
            raise raised
        if not ok:
            raise PlanError(text)
        share = reader.rows(step, rows, BatchTotals(*whole))  # the lead too: every rank of the replica reads it alike
        plans = ReplicaPlans.from_json(text)
        if plans.step != step:
            raise PlanError(f"rank {self.rank} asked for step {step} but received the plans of step {plans.step}")
        if plans.first != self.replica or plans.replicas != 1 or plans.job_replicas != self.replicas:
            raise PlanError(f"step {step}: replica {self.replica} of {self.replicas} received the plans of replicas "
                            f"{plans.first}..{plans.first + plans.replicas - 1} of {plans.job_replicas}")
        plan = plans.plans[0].validate(share.table.ids)
        self._plans[step] = plan
        return share, [list(mb) for mb in plan.micro_batches]

    def _lead(self, step: int) -> tuple[tuple, Exception | None]:
        """Plan the step and check with the other leads that the plans partition the batch: the
        message for the replica's ranks (``(True, plans as JSON, share rows, whole batch's
        totals)`` or ``(False, why not, None, None)``), and the planner's own error, which the
        lead raises once its ranks know."""
        try:
            planned = self.planner(step)
            count, total = id_checksum(planned.plan.sample_ids())
        except Exception as e:
            failed = (False, f"step {step}: replica {self.replica}'s lead (rank {self.rank}) could not plan: {e}", None, None)
            if self.leads is None:
                return failed, e
            count, total, raised = FAILED, 0, (failed, e)
        else:
            raised = None
        if self.leads is not None:
            sums = torch.tensor([count, total], dtype=torch.int64)
            self._collective(lambda: dist.all_reduce(sums, group=self.leads), f"checking the replicas' plans of step {step}")
            if raised is not None:
                return raised
            count_all, total_all = int(sums[0]), int(sums[1]) % 2**CHECKSUM_BITS
            whole = planned.share.whole
            if count_all < 0:
                return (False, f"step {step}: another replica's lead could not plan its share (its error is in that rank's log)",
                        None, None), None
            if (count_all, total_all) != (whole.samples, whole.checksum):
                return (False, f"step {step}: the replicas' plans do not partition the global batch (they hold {count_all} "
                               f"samples of its {whole.samples}" + (", some twice and others not at all" if count_all == whole.samples else "")
                               + "); every replica must compute the same split: the same data, latency table and pipetune "
                               "version on every node", None, None), None
        w = planned.share.whole
        return (True, planned.plans.to_json(), planned.share.rows.tolist(), (w.samples, w.label_tokens, w.checksum)), None

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
