"""What one run of a plan in a training step gives back, and the step record a replica's lead makes of it.

``PipeTuneTrainer`` runs each step's plan (``Run``); every rank reports its ``Share`` (times from
its own step start, so clocks of other nodes need not agree); the loss and work are summed over
replicas and the time is the slowest replica's (``RunOutcome``); each replica's lead makes the
replica's ``StepRecord`` from its ranks' shares (``replica_record``), and rank 0 collects every
replica's (``collect_records``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torchtitan.tools.logging import logger

from pipetune.plan import IterationPlan
from pipetune.records import StepRecord
from pipetune.simulate import TimedAction
from torchtitan_patches.data.micro_batch import GlobalBatch
from torchtitan_patches.runtime.replica_groups import ReplicaGroups
from torchtitan_patches.titan.metrics import StepWork


@dataclass(frozen=True)
class Run:
    """One execution of a plan in a step: the step's own (``extra=False``), or a run an extension
    adds beside it. Every run starts from the step's weights; the last run's gradients train."""

    batch: GlobalBatch
    plan: IterationPlan
    extra: bool = False


@dataclass(frozen=True)
class Share:
    """What one rank reports of a run (its times are from its own step start)."""

    replica: int
    stage: int
    tp_rank: int
    elapsed_s: float
    loss: float | None
    overhead_s: float
    peak_bytes: float | None
    host_syncs: int | None
    timeline: list[TimedAction]


@dataclass(frozen=True)
class RunOutcome:
    """A run as every rank knows it: the loss over all replicas, the time of the slowest, the work
    summed over replicas, and the records: on a lead its replica's, on rank 0 every replica's."""

    loss: float
    measured_s: float
    records: list[StepRecord]
    work: StepWork


def replica_record(record_class: type[StepRecord], every: list[Share], plan: IterationPlan, work: StepWork, **fields) -> StepRecord:
    """A replica's record of a run from its ranks' shares; its timeline is that of the replica's
    first pipeline (of its tensor-parallel ranks, which run the same actions)."""
    ranks = sorted((g for g in every if g.tp_rank == 0), key=lambda g: g.stage)
    timeline = sorted((t for g in ranks for t in g.timeline), key=lambda t: (t.start, t.rank))
    return record_class(
        mode=plan.mode, mbs=plan.mbs, micro_batches=plan.num_micro_batches, order=list(plan.order),
        samples=[list(mb) for mb in plan.micro_batches], precomputed_encoders=sum(t.precomputed for t in timeline),
        predicted_s=plan.predicted_s, measured_s=max(g.elapsed_s for g in every), plan_setup_s=max(g.overhead_s for g in every),
        loss=sum(g.loss for g in ranks if g.loss is not None), fallback=plan.fallback, plan=plan.to_json(),
        peak_bytes=[g.peak_bytes for g in ranks], predicted_peak_bytes=list(plan.peak_bytes), host_syncs=[g.host_syncs for g in ranks],
        timeline=[[t.rank, str(t.action), t.start, t.end, t.precomputed] for t in timeline], model_flops=work.model_flops,
        real_tokens=work.real_tokens, padding_tokens=work.padding_tokens, **fields)


def collect_records(records: list[StepRecord], groups: ReplicaGroups, rank: int) -> list[StepRecord]:
    """A lead's records of a run, handed to rank 0: there every replica's, by replica; elsewhere its own."""
    if groups.leads is None:  # one replica: rank 0 leads it
        return records
    every = [None] * len(groups.lead_ranks) if rank == 0 else None
    dist.gather_object(records, every, dst=0, group=groups.leads)
    return sorted((r for rs in every for r in rs), key=lambda r: r.replica) if rank == 0 else records


def log_step(step: int, records: list[StepRecord], plan: IterationPlan, replicas: int) -> None:
    """Rank 0's line per step (the slowest replica's plan and times), and which replicas fell back."""
    r = max(records, key=lambda r: r.measured_s)
    logger.info(f"pipetune step {step}: {r.kind.value if r.kind else '?'} plan ({plan.mode}), "
                + (f"{replicas} replicas, slowest {r.replica}: " if replicas > 1 else "")
                + f"mbs {r.mbs}, {r.micro_batches} micro-batches, {r.precomputed_encoders} encoders "
                f"pre-computed, predicted {r.predicted_s * 1e3:.1f} ms, measured {r.measured_s * 1e3:.1f} ms"
                + (f"; guard {r.guard}" if r.guard else ""))
    fell_back = [x for x in records if x.fallback]
    if fell_back:
        logger.warning(f"pipetune step {step}: fallback plans on replica" + ("s " if len(fell_back) > 1 else " ")
                       + "; ".join(f"{x.replica} ({x.fallback_reason or 'no reason given'})" for x in fell_back))
