"""A lower bound on any schedule's makespan for one iteration's micro-batches (linear pipeline).

Stage ``s`` must do all its own work; before its first action some micro-batch has to pass the
stages before it (and, with an encoder, that micro-batch's encoder), and after its last action some
micro-batch still has to run its backward on every earlier stage. So for every stage

    LB_s = min_i(enc_i + sum_{t<s} (fwd[i, t] + p2p_i)) + work_s + min_i(sum_{t<s} (bwd[i, t] + p2p_i))

with ``work_0`` including every encoder. Also no schedule beats one micro-batch's full chain
``enc_i + sum_t (fwd + bwd)[i, t] + 2 (S - 1) p2p_i``. The bound is the largest of these; it
ignores memory limits, so it may be unreachable, never too high.
"""

from __future__ import annotations

import numpy as np

from pipetune.simulate.simulator import Latencies


def makespan_lower_bound(lat: Latencies) -> float:
    fwd, bwd, enc, p2p = lat.fwd, lat.bwd, lat.encoder, lat.p2p
    m, S = fwd.shape
    fill = np.cumsum(np.hstack([np.zeros((m, 1)), fwd[:, :-1] + p2p[:, None]]), axis=1) + enc[:, None]
    fill[:, 0] = 0.0
    drain = np.cumsum(np.hstack([np.zeros((m, 1)), bwd[:, :-1] + p2p[:, None]]), axis=1)
    work = (fwd + bwd).sum(axis=0)
    work[0] += enc.sum()
    per_stage = fill.min(axis=0) + work + drain.min(axis=0)
    chain = enc + (fwd + bwd).sum(axis=1) + 2 * (S - 1) * p2p
    return float(max(per_stage.max(), chain.max()))
