"""torch's per-rank action orders on V-shaped placements (``Placement.v_shaped``), as pure functions.

Rank ``r`` of ``P`` holds backbone chunks ``r`` (the "down" chunk) and ``2P - 1 - r`` (the "up"
chunk). The orders are those of torch 2.13's ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``
(``_calculate_single_rank_operations``), rewritten over pipetune's ``Action``s so that a plan can
be compared with what TorchTitan would run, and so that pipetune's list scheduler can follow the
same forward/input-gradient sequence while placing the weight gradients itself. Micro-batch
``i`` of torch's orders is the ``i``-th to enter the pipeline (the caller maps it through its
order).

What is not reproduced of DualPipeV: torch runs an ``OVERLAP_F_B`` action (a forward of one chunk
beside a full backward of the other) as its two sub-actions one after the other unless a custom
overlap callback is registered; DeepSeek's DualPipe overlaps them on two streams to hide MoE
all-to-all traffic. Here it is the forward, then the input gradient, then the weight gradient, as
torch runs it by default. A full backward (``FULL_BACKWARD``) is the same two actions back to back.
"""

from __future__ import annotations

from collections import deque

from pipetune.schedule.table import Action, Op, ScheduleError

F, I, W = Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT


def zbv_rank_ops(num_ranks: int, rank: int, num_micro_batches: int) -> list[Action]:
    """``ScheduleZBVZeroBubble``'s order for ``rank``: ``2(P - r) - 1`` forwards of the down chunk,
    ``r`` pairs of forwards, ``P - r`` up-chunk forward / input / weight triples, the steady
    down-then-up triples, and the drain. torch pads to at least ``2P - 1`` micro-batches and drops
    the padding's actions; so does this (a runnable order stays runnable without whole micro-batches)."""
    P, r, m = num_ranks, rank, num_micro_batches
    n = max(2 * P - 1, m)
    down, up = r, 2 * P - 1 - r
    ops: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (P - r) - 1):
        ops.append(Action(down, F, f0))
        f0 += 1
    for _ in range(r):
        ops += [Action(up, F, f1), Action(down, F, f0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(P - r):
        ops += [Action(up, F, f1), Action(up, I, b1), Action(up, W, b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append(Action(down, F, f0))
            f0 += 1
        ops += [Action(down, I, b0), Action(down, W, b0), Action(up, F, f1), Action(up, I, b1), Action(up, W, b1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(r):
        ops += [Action(down, I, b0), Action(up, I, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(P - r):
        ops += [Action(down, I, b0), Action(down, W, w0)]
        b0, w0 = b0 + 1, w0 + 1
    ops += [Action(up, W, k) for k in range(w1, b1)] + [Action(down, W, k) for k in range(w0, b0)]
    return [a for a in ops if a.unit < m]


def dual_pipe_v_rank_ops(num_ranks: int, rank: int, num_micro_batches: int) -> list[Action]:
    """``ScheduleDualPipeV``'s order for ``rank`` (its eight steps), with every overlapped
    forward-and-backward and every full backward run as forward, input gradient, weight gradient
    (module doc). Needs at least ``2P`` micro-batches, as torch does."""
    P, r, m = num_ranks, rank, num_micro_batches
    if m < 2 * P:
        raise ScheduleError(f"DualPipeV needs at least as many micro-batches as chunks ({2 * P}), got {m}")
    down, up = r, 2 * P - 1 - r
    ops: list[Action] = []
    nxt = {(down, F): 0, (up, F): 0, (down, I): 0, (up, I): 0}
    pending: deque[Action] = deque()

    def add(chunk: int, op: Op, *, full: bool = False) -> None:
        k = nxt[chunk, op]
        nxt[chunk, op] = k + 1
        ops.append(Action(chunk, op, k))
        if op is I:
            (ops.append if full else pending.append)(Action(chunk, W, k))

    def weight() -> None:
        if pending:
            ops.append(pending.popleft())

    for _ in range(2 * (P - r - 1)):
        add(down, F)
    for _ in range(r + 1):
        add(down, F)
        add(up, F)
    for _ in range(P - r - 1):
        add(up, I)
        weight()
        add(up, F)
    for _ in range(m - 2 * P + r + 1):
        add(down, F)
        add(up, I, full=True)
        add(up, F)
        add(down, I, full=True)
    for _ in range(P - r - 1):
        add(up, I, full=True)
        add(up, F)
        add(down, I, full=True)
    split = False
    steps = r + 1
    for i in range(steps):
        if i == steps // 2 and r % 2 == 1:
            split = True
        add(up, I, full=not split)
        if i == steps // 2 and r % 2 == 0:
            split = True
        add(down, I, full=not split)
    for _ in range(P - r - 1):
        weight()
        add(down, I, full=not split)
    for _ in range(r + 1):
        weight()
    return ops
