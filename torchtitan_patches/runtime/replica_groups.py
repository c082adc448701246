"""The control plane of a data-parallel pipeline job: who talks to whom about plans and timings.

Each replica plans its own share of every batch on its lead rank (pipeline stage 0,
tensor-parallel rank 0), so a step's control traffic stays inside the replica: the lead sends its
plan to the replica's ranks (``from_lead``) and collects their timings (``to_lead``), by
point-to-point messages on the job's gloo control group. Only two things cross replicas: the
leads' check that their plans partition the global batch (an all-reduce of two numbers over the
leads' group) and the step's records, which the leads hand to rank 0 to write. No rank handles
another replica's plan or timings, so what a rank does per step does not grow with the number of
replicas.

Why messages rather than a gloo group per replica: every rank would have to create all ``D``
groups (each a barrier over the whole world), or create only its own with group-local
synchronisation, whose hashed names collide with TorchTitan's mesh groups of the same ranks (a
replica's pipeline group when TP is 1). One group for the leads is created once.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class ReplicaGroups:
    """``members``: this replica's global ranks, its lead first; ``leads``: the leads' group (on
    the leads; ``None`` elsewhere, and with one replica); ``lead_ranks``: every replica's lead, by
    replica; ``control``: the gloo group the messages travel on."""

    control: dist.ProcessGroup
    members: tuple[int, ...]
    leads: dist.ProcessGroup | None
    lead_ranks: tuple[int, ...]

    @property
    def lead(self) -> int:
        return self.members[0]

    @property
    def is_lead(self) -> bool:
        return dist.get_rank() == self.lead

    @classmethod
    def build(cls, replica: int, stage: int, tp_rank: int, *, control: dist.ProcessGroup, timeout: timedelta) -> "ReplicaGroups":
        """Every rank calls this once, with its coordinates."""
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
        group = dist.new_group(leads, backend="gloo", timeout=timeout) if len(leads) > 1 else None
        mine = [leads[replica], *(r for r in members[replica] if r != leads[replica])]
        return cls(control, tuple(mine), group if dist.get_rank() in leads else None, tuple(leads))

    def to_lead(self, obj) -> list | None:
        """Every member's ``obj`` on the lead, in ``members`` order; ``None`` on the others."""
        if not self.is_lead:
            dist.send_object_list([obj], dst=self.lead, group=self.control)
            return None
        out = [obj]
        for rank in self.members[1:]:
            box = [None]
            dist.recv_object_list(box, src=rank, group=self.control)
            out.append(box[0])
        return out

    def from_lead(self, obj=None):
        """The lead's ``obj`` on every member (the lead passes it, the others receive it)."""
        if self.is_lead:
            for rank in self.members[1:]:
                dist.send_object_list([obj], dst=rank, group=self.control)
            return obj
        box = [None]
        dist.recv_object_list(box, src=self.lead, group=self.control)
        return box[0]
