"""A schedule table compiled into a DAG (PipeTune App. A.5): node = (micro-batch slot, stage, F/B).

Edges: a rank runs its nodes in table order; ``F(s, i)`` waits for ``F(s-1, i)`` plus a message
when the stages sit on different ranks; ``B(s, i)`` waits for ``F(s, i)`` and for ``B(s+1, i)``
plus a message. Encoder actions are not nodes: each is attached, as extra work, to the stage-0
rank node it runs before (``encoder_slot``), which is how pre-computation is expressed without
changing the DAG's shape, so many placements can be evaluated on one compiled DAG.

Nodes are numbered in a topological order that respects every edge and each rank's order, so one
forward pass over node indices times the whole schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetune.schedule.table import Op, ScheduleError, ScheduleTable

OP_F, OP_B = 0, 1


@dataclass(frozen=True)
class CompiledSchedule:
    """Node arrays in topological order (index = node id).

    ``dep``/``dep_comm``: up to two producer nodes per node (-1: none) and whether a message
    separates them. ``rank_prev``: previous node on the same rank (-1 for a rank's first node).
    ``rank_pos``: position of the node among its rank's nodes. ``encoder_slot[mb]``: the node
    before which ``0E{mb}`` runs (``-1`` without encoder).
    """

    table: ScheduleTable
    op: np.ndarray
    stage: np.ndarray
    mb: np.ndarray
    rank: np.ndarray
    dep: np.ndarray
    dep_comm: np.ndarray
    rank_prev: np.ndarray
    rank_nodes: tuple[np.ndarray, ...]
    encoder_slot: np.ndarray

    @property
    def num_nodes(self) -> int:
        return len(self.op)

    def rank_position(self) -> np.ndarray:
        """Position of each node within its rank's node list."""
        pos = np.empty(self.num_nodes, np.int64)
        for nodes in self.rank_nodes:
            pos[nodes] = np.arange(len(nodes))
        return pos


def _key(a) -> tuple[int, int, int]:
    return (OP_F if a.op is Op.FORWARD else OP_B, a.stage, a.mb)


def compile_schedule(table: ScheduleTable) -> CompiledSchedule:
    """Validate ``table`` and order its compute actions topologically (``ScheduleError`` on deadlock)."""
    table.validate()
    work = [[_key(a) for a in acts if a.op is not Op.ENCODER] for acts in table.ranks]
    S = table.num_stages
    done: dict[tuple[int, int, int], int] = {}
    ptr = [0] * len(work)
    order = []
    while True:
        progressed = False
        for r, acts in enumerate(work):
            while ptr[r] < len(acts):
                op, s, mb = acts[ptr[r]]
                deps = [(OP_F, s - 1, mb)] if op == OP_F and s > 0 else []
                if op == OP_B:
                    deps = [(OP_F, s, mb)] + ([(OP_B, s + 1, mb)] if s < S - 1 else [])
                if any(d not in done for d in deps):
                    break
                done[(op, s, mb)] = len(order)
                order.append((op, s, mb, r, deps))
                ptr[r] += 1
                progressed = True
        if all(p == len(a) for p, a in zip(ptr, work)):
            break
        if not progressed:
            stuck = ", ".join(
                f"rank {r} at {s}{'FB'[op]}{mb}" for r in range(len(work)) if ptr[r] < len(work[r]) for op, s, mb in [work[r][ptr[r]]]
            )
            raise ScheduleError(f"schedule deadlocks: {stuck}")
    n = len(order)
    op = np.array([o[0] for o in order], np.int8)
    stage = np.array([o[1] for o in order], np.int64)
    mb = np.array([o[2] for o in order], np.int64)
    rank = np.array([o[3] for o in order], np.int64)
    dep = np.full((n, 2), -1, np.int64)
    dep_comm = np.zeros((n, 2), bool)
    for i, (_, _, _, r, deps) in enumerate(order):
        for j, d in enumerate(deps):
            dep[i, j] = done[d]
            dep_comm[i, j] = table.stage_rank[d[1]] != r
    rank_nodes = tuple(np.array([done[k] for k in acts], np.int64) for acts in work)
    rank_prev = np.full(n, -1, np.int64)
    for nodes in rank_nodes:
        rank_prev[nodes[1:]] = nodes[:-1]
    encoder_slot = np.full(table.num_micro_batches, -1, np.int64)
    if table.encoder:
        r0 = table.stage_rank[0]
        k = 0
        for a in table.ranks[r0]:
            if a.op is Op.ENCODER:
                encoder_slot[a.mb] = rank_nodes[r0][k]
            else:
                k += 1
    return CompiledSchedule(table, op, stage, mb, rank, dep, dep_comm, rank_prev, rank_nodes, encoder_slot)
