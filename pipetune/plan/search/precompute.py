"""Encoder pre-computation slots: move encoder forwards of later micro-batches into stage 0's idle gaps.

Co-located layout only: the encoder forwards are the schedule's floating actions
(``CompiledSchedule.floating``), one per micro-batch slot, on the rank of stage 0.

Stage 0 idles whenever its next action waits for a message (in 1F1B, mostly for gradients coming
back). Starting from an order's timeline without pre-computation, we walk stage 0's actions in
time order and fill each idle gap with the encoders of the micro-batches that come next, as long
as they fit in the gap (``overflow`` lets them exceed it by that fraction of the gap, trading a
small delay now for a shorter forward later). Moving encoders changes the timeline, so the walk is
repeated on the new timeline ``passes`` times. The caller evaluates the resulting placements and
keeps the best one that fits in memory (held image features count).
"""

from __future__ import annotations

import numpy as np

from pipetune.simulate.dag import CompiledSchedule
from pipetune.simulate.simulator import Latencies, timelines


def move_encoders_into_gaps(dag: CompiledSchedule, lat: Latencies, orders: np.ndarray, overflows: np.ndarray, *,
                            passes: int = 2) -> np.ndarray:
    """Encoder slots (node before which each slot's encoder runs), one row per (order, overflow)."""
    rank0 = dag.rank_nodes[dag.table.placement.encoder[0]]
    fwd_node = dag.float_slot
    pos = np.empty(dag.num_nodes, np.int64)
    pos[rank0] = np.arange(len(rank0))
    fwd_pos = pos[fwd_node]
    C = len(orders)
    slots = np.tile(fwd_node, (C, 1))
    enc = lat.encoder.sum(axis=1)[orders]
    active = np.ones(C, bool)
    for _ in range(passes):
        start, end, pre = timelines(dag, lat, orders, slots)
        prev_end = np.vstack([np.zeros((1, C)), end[rank0[:-1]]])
        gaps = (start[rank0] - prev_end - pre[rank0]) * (1 + overflows)  # room before each of stage 0's nodes
        for c in np.flatnonzero(active):
            waiting = np.flatnonzero((slots[c] == fwd_node) & (enc[c] > 0))
            waiting = waiting[np.argsort(fwd_pos[waiting], kind="stable")].tolist()
            e, wait_pos, j, moved = enc[c].tolist(), fwd_pos[waiting].tolist(), 0, False
            for i in np.flatnonzero(gaps[:, c] > 0).tolist():  # encoders only move into room
                while j < len(waiting) and wait_pos[j] <= i:
                    j += 1
                room = gaps[i, c]
                while j < len(waiting) and e[waiting[j]] <= room:
                    slots[c, waiting[j]] = rank0[i]
                    room -= e[waiting[j]]
                    j += 1
                    moved = True
            active[c] = moved
        if not active.any():
            break
    return slots
