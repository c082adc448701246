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
    rank0 = dag.rank_nodes[dag.table.placement.encoder[0]].tolist()
    fwd_node = dag.float_slot
    pos = {n: k for k, n in enumerate(rank0)}
    C = len(orders)
    slots = np.tile(fwd_node, (C, 1))
    enc = lat.encoder.sum(axis=1)[orders]
    active = np.ones(C, bool)
    for _ in range(passes):
        start, end, pre = timelines(dag, lat, orders, slots)
        for c in np.flatnonzero(active):
            moved = False
            waiting = sorted((k for k in range(orders.shape[1]) if slots[c, k] == fwd_node[k] and enc[c, k] > 0), key=lambda k: pos[fwd_node[k]])
            for i, n in enumerate(rank0):
                prev_end = end[rank0[i - 1], c] if i else 0.0
                room = (start[n, c] - prev_end - pre[n, c]) * (1 + overflows[c])
                while waiting and pos[fwd_node[waiting[0]]] <= i:
                    waiting.pop(0)
                while waiting and enc[c, waiting[0]] <= room:
                    k = waiting.pop(0)
                    slots[c, k] = n
                    room -= enc[c, k]
                    moved = True
            active[c] = moved
        if not active.any():
            break
    return slots
