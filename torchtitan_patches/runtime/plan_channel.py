"""One planner per replica: its lead rank plans each step and sends the plan to the replica's ranks.

Planning on every rank could diverge (a time budget may fall back on one rank and not another),
so each data-parallel replica's lead (``runtime.replica_groups``) owns its replica's planner (a
function from a step to the ``SharePlan`` of the replica's share, usually ``PlanSource``) and the
replica's other ranks receive its plan with the share's rows and the global batch's totals, from
which they read their share's metadata alone (``BatchReader.rows``): no rank reads the global
batch on its training thread. Each rank's dataloader uses a ``PlanChannel`` as its share source;
loaders ask for steps in the same order on every rank, so the messages pair up. They travel on
a gloo control group, apart from the pipeline's point-to-point traffic. Before a lead sends its plan, the leads check together that their plans partition the
global batch (``id_checksum``: one all-reduce of two numbers), so a split computed differently on
one node stops the job at that step instead of dropping or repeating samples; a lead whose
planner raised takes part in that check too (and says so), so no lead waits for it.

Ranks that disagree (started with other ``--modes``/``--steps``, or a rank without a planner)
must fail rather than hang: the groups carry the job's timeout (torch's ``new_group`` would
otherwise use its 30-minute default, not the world group's), each lead first learns which of its
ranks own a planner and which step each one asks for and tells them, and any message or
collective that times out is reported as a ``PlanMismatchError`` naming the step and the timeout.
"""

from __future__ import annotations

from datetime import timedelta
from enum import Enum
from typing import Callable

import torch
import torch.distributed as dist

from pipetune.data.batch import CHECKSUM_BITS, BatchMeta, BatchReader, BatchTotals, id_checksum
from pipetune.plan.plan import IterationPlan, PlanError
from pipetune.plan.data_parallel.replicas import ReplicaPlans, SharePlan
from torchtitan_patches.runtime.executor import PlanMismatchError
from torchtitan_patches.runtime.replica_groups import ReplicaGroups

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


class Reply(Enum):
    """What a lead tells its replica's ranks about a step."""

    PLAN = "plan"  # the plan, the share's rows, the batch's totals
    FAILED = "failed"  # no plan: why
    MISMATCH = "mismatch"  # the ranks disagree on the job: why


class PlanChannel:
    """``links``: this replica's ranks and lead (``runtime.replica_groups``; default: one replica
    of every rank, led by rank 0, on a new gloo group); only the lead has a ``planner``."""

    def __init__(self, planner: Callable[[int], SharePlan] | None, *, replica: int = 0, replicas: int = 1,
                 links: ReplicaGroups | None = None, timeout: timedelta | None = None):
        self.rank = dist.get_rank()
        self.planner = planner
        self.replica, self.replicas = replica, replicas
        self.timeout = timeout if timeout is not None else group_timeout(links.control if links is not None else None)
        if links is None:
            group = self._collective(lambda: dist.new_group(backend="gloo", timeout=self.timeout), "opening the plan channel")
            links = ReplicaGroups(group, tuple(range(dist.get_world_size())), None, (0,))
        self.links = links
        self._plans: dict[int, IterationPlan] = {}
        owners = self._collective(lambda: links.to_lead(planner is not None), "agreeing which rank plans")
        verdict = None
        if owners is not None and owners != [True] + [False] * (len(owners) - 1):
            verdict = (f"plan channel of replica {replica}: rank {links.lead} must own the planner and only it, but ranks "
                       f"{[r for r, o in zip(links.members, owners) if o]} have one")
        verdict = self._collective(lambda: links.from_lead(verdict), "agreeing which rank plans")
        if verdict is not None:
            raise PlanMismatchError(f"{verdict} (this is rank {self.rank})")

    def share(self, step: int, reader: BatchReader) -> tuple[BatchMeta, list[list[int]]]:
        """This replica's share of batch ``step`` and its packing (sample-id groups); the share's
        metadata is read with ``reader`` from the rows the lead sends."""
        links = self.links
        steps = self._collective(lambda: links.to_lead(step), f"asking for the plan of step {step}")
        message, raised = None, None
        if links.is_lead:
            if len(set(steps)) > 1:
                message = (Reply.MISMATCH, "plan channel: ranks ask for the plans of different steps ("
                           + ", ".join(f"rank {r}: step {s}" for r, s in zip(links.members, steps))
                           + "); were they started with the same --modes, --steps and data?")
            else:
                message, raised = self._lead(step)
        reply, *body = self._collective(lambda: links.from_lead(message), f"receiving the plan of step {step}")
        if raised is not None:
            raise raised
        if reply is Reply.MISMATCH:
            raise PlanMismatchError(body[0])
        if reply is Reply.FAILED:
            raise PlanError(body[0])
        text, rows, whole = body
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
        message for the replica's ranks, and the planner's own error, which the lead raises once
        its ranks know."""
        leads = self.links.leads
        try:
            planned = self.planner(step)
            count, total = id_checksum(planned.plan.sample_ids())
        except Exception as e:
            failed = (Reply.FAILED, f"step {step}: replica {self.replica}'s lead (rank {self.rank}) could not plan: {e}"), e
            if leads is None:
                return failed
            count, total, raised = FAILED, 0, failed
        else:
            raised = None
        if leads is not None:
            sums = torch.tensor([count, total], dtype=torch.int64)
            self._collective(lambda: dist.all_reduce(sums, group=leads), f"checking the replicas' plans of step {step}")
            if raised is not None:
                return raised
            count_all, total_all = int(sums[0]), int(sums[1]) % 2**CHECKSUM_BITS
            whole = planned.share.whole
            if count_all < 0:
                return (Reply.FAILED, f"step {step}: another replica's lead could not plan its share (its error is in that rank's log)"), None
            if (count_all, total_all) != (whole.samples, whole.checksum):
                return (Reply.FAILED, f"step {step}: the replicas' plans do not partition the global batch (they hold {count_all} "
                                      f"samples of its {whole.samples}" + (", some twice and others not at all" if count_all == whole.samples else "")
                                      + "); every replica must compute the same split: the same data, latency table and pipetune "
                                      "version on every node"), None
        w = planned.share.whole
        return (Reply.PLAN, planned.plans.to_json(), planned.share.rows.tolist(), (w.samples, w.label_tokens, w.checksum)), None

    def pop(self, step: int) -> IterationPlan:
        if step not in self._plans:
            raise PlanError(f"no plan for step {step} on rank {self.rank}")
        return self._plans.pop(step)

    def _collective(self, op: Callable[[], object], what: str):
        try:
            return op()
        except RuntimeError as e:  # gloo reports a timeout or a closed peer as RuntimeError (DistBackendError)
            raise PlanMismatchError(
                f"plan channel, rank {self.rank}: no answer from the other ranks within {self.timeout.total_seconds():g} s "
                f"while {what}; a rank stopped, or ranks were started with different --modes/--steps ({e})"
            ) from e
