"""The control plane's gloo groups of a data-parallel pipeline job.

Each replica plans its own share of every batch on its lead rank (pipeline stage 0, tensor-parallel
rank 0), so the control traffic of a step stays inside the replica: the lead sends its plan to the
replica's ranks and gathers their timings. Only two things cross replicas: the leads' check that
their plans partition the global batch (an all-reduce of two numbers over the leads' group) and
the step's records, which the leads hand to rank 0 to write. No rank handles another replica's
plan or timings, so what a rank does per step does not grow with the number of replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class ReplicaGroups:
    """``replica``: this replica's ranks; ``lead``: its lead's global rank; ``leads``: the leads'
    group (``None`` on other ranks); ``lead_ranks``: every replica's lead, by replica."""

    replica: dist.ProcessGroup
    lead: int
    leads: dist.ProcessGroup | None
    lead_ranks: tuple[int, ...]

    @classmethod
    def build(cls, replica: int, stage: int, tp_rank: int, *, control: dist.ProcessGroup, timeout: timedelta) -> "ReplicaGroups":
        """Every rank calls this once, with its coordinates; the groups are made in one order on all."""
        coords: list = [None] * dist.get_world_size()
        dist.all_gather_object(coords, (replica, stage, tp_rank), group=control)
        members: dict[int, list[int]] = {}
        for rank, (d, _, _) in enumerate(coords):
            members.setdefault(d, []).append(rank)
        if sorted(members) != list(range(len(members))):
            raise ValueError(f"data-parallel replicas {sorted(members)} are not numbered 0..{len(members) - 1}")
        leads = []
        for d in range(len(members)):
            first = [r for r in members[d] if coords[r][1:] == (0, 0)]
            if len(first) != 1:
                raise ValueError(f"replica {d} has {len(first)} ranks at pipeline stage 0 and tensor-parallel rank 0; one expected")
            leads.append(first[0])
        mine = None
        for d in range(len(members)):
            group = dist.new_group(members[d], backend="gloo", timeout=timeout)
            if d == replica:
                mine = group
        lead_group = dist.new_group(leads, backend="gloo", timeout=timeout)
        return cls(mine, leads[replica], lead_group if dist.get_rank() in leads else None, tuple(leads))

    @property
    def is_lead(self) -> bool:
        return self.leads is not None
