"""Lower bounds on any schedule's makespan for one iteration's units.

Co-located layout (``makespan_lower_bound``; a linear pipeline with the encoder beside stage 0):
stage ``s`` must do all its own work; before its first action some micro-batch has to pass the
stages before it (and, with an encoder, that micro-batch's encoder), and after its last action some
micro-batch still has to run its backward on every earlier stage (and the encoder's backward, when
trained). So for every stage

    LB_s = min_i(enc_i + sum_{t<s} (fwd[i, t] + p2p_i)) + work_s + min_i(sum_{t<s} (bwd[i, t] + p2p_i))

with ``work_0`` and ``bwd[i, 0]`` including the encoder's work. Also no schedule beats one
micro-batch's full chain ``enc_i + sum_t (fwd + bwd)[i, t] + 2 (S - 1) p2p_i``.

Any placement (``placement_lower_bound``): no rank finishes before it has done all its work, and
no micro-batch before the chain of its slowest sub-microbatch's encoder forward, its backbone
forward and backward, and its slowest encoder backward (messages left out).

Both ignore memory limits, so they may be unreachable, never too high.
"""

from __future__ import annotations

import numpy as np

from pipetune.cost.cost_model import rank_work
from pipetune.schedule.table import ScheduleTable
from pipetune.simulate.simulator import Latencies


def makespan_lower_bound(lat: Latencies) -> float:
    """The co-located bound (sub-microbatch ``i`` = micro-batch ``i``'s images)."""
    fwd, p2p = lat.fwd, lat.p2p
    enc = lat.encoder.sum(axis=1)
    bwd = lat.bwd.copy()
    bwd[:, 0] += lat.encoder_bwd.sum(axis=1)
    m, S = fwd.shape
    fill = np.cumsum(np.hstack([np.zeros((m, 1)), fwd[:, :-1] + p2p[:, None]]), axis=1) + enc[:, None]
    fill[:, 0] = 0.0
    drain = np.cumsum(np.hstack([np.zeros((m, 1)), bwd[:, :-1] + p2p[:, None]]), axis=1)
    work = (fwd + bwd).sum(axis=0)
    work[0] += enc.sum()
    per_stage = fill.min(axis=0) + work + drain.min(axis=0)
    chain = enc + (fwd + bwd).sum(axis=1) + 2 * (S - 1) * p2p
    return float(max(per_stage.max(), chain.max()))


def placement_lower_bound(table: ScheduleTable, lat: Latencies) -> float:
    """The bound for any placement (see the module doc)."""
    work = rank_work(table.placement, lat)
    chain = (lat.fwd + lat.bwd).sum(axis=1)
    if table.num_sub_micro_batches:
        parent = np.array(table.sub_mb_parent)
        for arr in (lat.encoder, lat.encoder_bwd) if table.placement.encoder_trained else (lat.encoder,):
            slowest = np.zeros(table.num_micro_batches)
            np.maximum.at(slowest, parent, arr.sum(axis=1))
            chain = chain + slowest
    return float(max(work.max(), chain.max()))
