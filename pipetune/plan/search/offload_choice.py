"""Which activations to offload, and when to reload them, where memory binds (OptPipe's offload, greedily).

A table whose simulated peak exceeds a rank's room for activations gets offloads, round by round.
Each round, on every rank over its room, walking the instants it holds too much in time order:
at each, backbone activations live then whose forward ended at least one copy earlier and whose
gradient starts at least one copy later (so both copies can run while the rank computes), the
longest-lasting such window first, until that instant fits. Each one's reload is issued after the
latest compute action that lets it finish before its gradient starts on this round's times (just
in time: memory is taken again as late as that allows). Offloads queue on the copy engine and
shift times, so the next round re-simulates.
The planner scores the result like any other table: an offload table is chosen only when it fits
and no fitting table without offload is faster (``Planner``), which is "only where memory binds
and it pays".

Limits: backbone activations only (a trained encoder's stay on the device); one reload point per
pair, from the times of the round that chose it; at most ``ROUNDS`` rounds; without a host link
(``Latencies.copy`` infinite) nothing is offloaded.
"""

from __future__ import annotations

import numpy as np

from pipetune.schedule.offload import with_offload
from pipetune.schedule.table import Action, Buffer, Module, Op, ScheduleTable
from pipetune.simulate.dag import compile_schedule
from pipetune.simulate.simulator import Latencies, memory_timeline

ROUNDS = 8


def offload_to_fit(table: ScheduleTable, lat: Latencies, order: np.ndarray, room: np.ndarray) -> ScheduleTable | None:
    """``table`` (over positions: unit ``k`` is micro-batch ``order[k]``) with offloads until every
    rank's simulated activation peak is within ``room[r]`` bytes (None if the rounds cannot get there)."""
    order = np.asarray(order, np.int64)
    if not np.isfinite(lat.copy).all():
        return None
    grad = table.grad_op(Module.BACKBONE)
    for _ in range(ROUNDS):
        dag = compile_schedule(table, validate=False)
        tl = memory_timeline(dag, lat, order[None])
        node = {dag.action(n): n for n in range(dag.num_nodes)}
        window = _windows(table, dag, tl, node, lat, order, grad)
        leads: dict[tuple[int, int], int] = {}
        fits = True
        for r in range(table.num_ranks):
            chosen = _cover(tl, window, np.flatnonzero(tl.owner == r), room[r])
            if chosen is None:
                continue
            if not chosen:  # an instant over room with too little hideable: later rounds only shift times
                return None
            fits = False
            for b in chosen:
                c, u = int(dag.buf_chunk[b]), int(dag.buf_unit[b])
                leads[c, u] = _reload_lead(table.ranks[r], tl, node, Action(c, grad, u), float(lat.copy[order[u], c]))
        if fits:
            return table
        if not leads:
            return None
        table = with_offload(table, leads)
    return None


def _windows(table: ScheduleTable, dag, tl, node: dict, lat: Latencies, order: np.ndarray, grad: Op) -> dict[int, tuple[float, float]]:
    """For each buffer that is a backbone forward's activations, not offloaded yet: the times
    between which offloading it frees its bytes with both copies hidden (from its forward's end plus
    a copy to its gradient's start minus a copy), where that is not empty."""
    out = {}
    for b in np.flatnonzero(dag.buf_kind == Buffer.ACTIVATION.value).tolist():
        c, u = int(dag.buf_chunk[b]), int(dag.buf_unit[b])
        if (c, u) in table.offloaded:
            continue
        copy = float(lat.copy[order[u], c])
        lo, hi = tl.end[node[Action(c, Op.FORWARD, u)]] + copy, tl.start[node[Action(c, grad, u)]] - copy
        if lo < hi:
            out[b] = (lo, hi)
    return out


def _cover(tl, window: dict[int, tuple[float, float]], mine: np.ndarray, room: float) -> list[int] | None:
    """Buffers of one rank (``mine``) to offload so that every instant its held bytes exceed
    ``room`` is brought within it, walking those instants in time order and adding, at each, the
    live buffers whose window lasts longest; None when the rank fits already, empty when some
    instant cannot be brought within room."""
    t = np.concatenate([tl.taken[mine], tl.given[mine]])
    d = np.concatenate([tl.size[mine], -tl.size[mine]])
    at = np.lexsort((d, t))
    t, held = t[at], np.cumsum(d[at])
    over = np.flatnonzero(held > room)
    if not len(over):
        return None
    chosen: list[int] = []
    for i in over.tolist():
        now = float(t[i])
        freed = sum(tl.size[b] for b in chosen if window[b][0] <= now < window[b][1])
        need = held[i] - room - freed
        live = [b for b in mine.tolist() if b in window and b not in chosen and window[b][0] <= now < window[b][1]]
        if need > sum(tl.size[b] for b in live):
            return []
        for b in sorted(live, key=lambda b: -window[b][1]):
            if need <= 0:
                break
            chosen.append(b)
            need -= tl.size[b]
    return chosen


def _reload_lead(acts: tuple[Action, ...], tl, node: dict, grad: Action, copy: float) -> int:
    """Compute actions to leave between a reload and ``grad``: after the latest one whose end, plus
    the copy, is no later than ``grad``'s start (0: right before ``grad``)."""
    due = tl.start[node[grad]] - copy
    lead = 0
    for a in reversed([a for a in acts[:acts.index(grad)] if not a.op.is_copy]):  # as with_offload counts them
        if a in node and tl.end[node[a]] <= due:  # (a floating encoder forward has no node: counted, not timed)
            return lead
        lead += 1
    return lead
