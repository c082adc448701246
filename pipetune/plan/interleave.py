"""Dual-queue greedy interleaving of forward and backward actions under a memory limit (DIP Sec. 5.2).

A pure function from (placement, sub-microbatches, latencies, unit priorities, per-rank memory
limit) to a per-rank action table, built by list scheduling: every rank keeps a queue of ready
forwards and one of ready backwards (an action is ready once all its producers are scheduled; it
can start when they end and their messages arrive). Each round takes the rank that can start an
action earliest and picks on it:

1. if both a forward and a backward could start as soon as the rank is free, the other kind than
   the rank's last action (one forward, one backward: 1F1B where the data allow it), highest
   priority first;
2. else, if one of the two kinds can start then, its highest-priority action;
3. else the action that can start first (ties: priority), leaving the smallest gap.

Forwards allocate memory (``ScheduleTable.buffers``: saved activations, image features) and
backwards free it, in the rank's own order, as the simulator counts it. DIP disables a rank's
forward queue while a forward would take it over its limit; alone, that deadlocks (in random
tests, 39 % of the cases whose limit admits running micro-batches one at a time): a rank fills up
with early encoder forwards of later micro-batches, and the backbone forwards that would bring
the backwards freeing them no longer fit. So memory is admitted per micro-batch (with its
sub-microbatches): a micro-batch's first action may run only if every rank can also hold all the
forward memory it will need there, which is then reserved; forwards of admitted micro-batches
always fit. The table never exceeds the limit, and whenever a single micro-batch fits, a table is
found; if one does not, the result is ``None``.

Deviation from DIP's text: DIP picks the rank with the smallest earliest ready time of its
queued stages; we take the earliest time an action can actually *start* (ready time or the end of
the rank's current work, whichever is later), which keeps the construction in time order.

Lower priority values go first. ``segment_priorities`` derives them from a micro-batch order:
backbone micro-batch ``order[i]`` gets ``i``, its image sub-microbatches ``i - lead``, so the
encoder runs ``lead`` micro-batches ahead of the backbone (DIP's segment reordering assigns
priorities per segment; segments of one micro-batch and modality share theirs, DIP Sec. 5.1).
The scheduling times are the simulator's own: ``simulate`` on the returned table gives the same
makespan and peak memory (tested).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from pipetune.schedule.lowering import Message
from pipetune.schedule.table import Op, Placement, ScheduleTable
from pipetune.simulate.simulator import Latencies, buffer_bytes, durations, message_costs


@dataclass(frozen=True)
class Interleaved:
    """A greedy table with its own makespan and per-rank peak bytes (activations, not model states)."""

    table: ScheduleTable
    makespan: float
    peak_bytes: np.ndarray


def segment_priorities(order, sub_mb_parent, lead: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Priorities of micro-batches and sub-microbatches for micro-batch ``order`` (see module doc)."""
    pos = np.empty(len(order), np.int64)
    pos[np.asarray(order, np.int64)] = np.arange(len(order))
    return pos, pos[np.asarray(sub_mb_parent, np.int64)] - lead if len(sub_mb_parent) else np.zeros(0, np.int64)


def interleave(
    placement: Placement,
    sub_mb_parent: tuple[int, ...],
    lat: Latencies,
    priority: np.ndarray,
    sub_priority: np.ndarray,
    memory_limit: np.ndarray | None = None,
    *,
    name: str = "interleaved",
) -> Interleaved | None:
    """The greedy table (module doc); ``memory_limit[r]``: bytes rank ``r`` may hold at once."""
    proto = ScheduleTable(placement=placement, num_micro_batches=lat.fwd.shape[0], ranks=((),) * placement.num_ranks,
                          sub_mb_parent=tuple(sub_mb_parent), name=name)
    acts = proto.expected_actions()
    index = {a: i for i, a in enumerate(acts)}
    R = placement.num_ranks
    rank = [placement.rank_of(a) for a in acts]
    dur = [float(durations(lat, a.module, a.op)[a.unit, a.chunk]) for a in acts]
    forward = [a.op is Op.FORWARD for a in acts]
    key = [(int(sub_priority[a.unit] if a.is_encoder else priority[a.unit]), i) for i, a in enumerate(acts)]
    alloc, free = [0.0] * len(acts), [0.0] * len(acts)
    group = [proto.sub_mb_parent[a.unit] if a.is_encoder else a.unit for a in acts]
    need = np.zeros((proto.num_micro_batches, R))  # forward memory of each micro-batch (with its images) on each rank
    for kind, chunk, unit, made, freed in proto.buffers():
        arr = buffer_bytes(lat, kind)
        nbytes = float(arr[unit, chunk] if arr.ndim == 2 else arr[unit])
        alloc[index[made]] += nbytes
        free[index[freed]] += nbytes
        need[group[index[made]], rank[index[made]]] += nbytes
    out = []
    for i, a in enumerate(acts):
        edges = []
        for c in proto.consumers(a):
            j = index[c]
            msg = Message(a, c)
            edges.append((j, 0.0 if rank[j] == rank[i] else float(message_costs(lat, msg.kind)[msg.unit])))
        out.append(edges)
    waiting = [len(proto.producers(a)) for a in acts]
    ready_at = [0.0] * len(acts)
    limit = np.full(R, np.inf) if memory_limit is None else np.asarray(memory_limit, np.float64)
    # per rank and kind (0 forward, 1 backward): not yet startable (by ready time), startable (by priority)
    pending = [[[], []] for _ in range(R)]
    avail = [[[], []] for _ in range(R)]
    for i in range(len(acts)):
        if waiting[i] == 0:
            heapq.heappush(pending[rank[i]][0 if forward[i] else 1], (0.0, key[i], i))
    t_last, mem, peak, last_fwd = [0.0] * R, [0.0] * R, [0.0] * R, [False] * R
    reserved = np.zeros(R)  # forward memory admitted micro-batches will still allocate, per rank
    admitted = [False] * proto.num_micro_batches
    lists: list[list] = [[] for _ in range(R)]
    end_max = 0.0

    def allowed(i: int) -> bool:
        g = group[i]
        return admitted[g] or bool((np.asarray(mem) + reserved + need[g] <= limit).all())

    def first_allowed(heap: list, by: int) -> tuple | None:
        """The best entry of ``heap`` (ordered by its tuples) whose action may run, or None."""
        if heap and allowed(heap[0][by]):
            return heap[0]
        return next((e for e in sorted(heap) if allowed(e[by])), None)

    def candidate(r: int) -> tuple[float, int] | None:
        """(start time, action) rank ``r`` would run next, or None if it can run nothing."""
        t = t_last[r]
        for q in (0, 1):
            while pending[r][q] and pending[r][q][0][0] <= t:
                _, k, i = heapq.heappop(pending[r][q])
                heapq.heappush(avail[r][q], (k, i))
        f = first_allowed(avail[r][0], 1)
        b = avail[r][1][0] if avail[r][1] else None
        if f is not None and b is not None:
            return t, (b[1] if last_fwd[r] else f[1])
        if f is not None or b is not None:
            return t, (f or b)[1]
        heads = [h for h in (pending[r][1][0] if pending[r][1] else None, first_allowed(pending[r][0], 2)) if h]
        if not heads:
            return None
        start, _, i = min(heads)
        return start, i

    for _ in range(len(acts)):
        best = None
        for r in range(R):
            c = candidate(r)
            if c is not None and (best is None or c[0] < best[0]):
                best = (c[0], c[1], r)
        if best is None:
            return None  # no micro-batch fits on its own: no table exists under this limit
        start, i, r = best
        q = 0 if forward[i] else 1
        for heap in (avail[r][q], pending[r][q]):
            at = next((n for n, e in enumerate(heap) if e[-1] == i), None)
            if at is not None:
                heap[at] = heap[-1]
                heap.pop()
                heapq.heapify(heap)
                break
        g = group[i]
        if not admitted[g]:
            admitted[g] = True
            reserved += need[g]
        reserved[r] -= alloc[i]
        start = max(start, ready_at[i])
        end = start + dur[i]
        t_last[r], last_fwd[r] = end, forward[i]
        mem[r] += alloc[i]
        peak[r] = max(peak[r], mem[r])
        mem[r] -= free[i]
        lists[r].append(acts[i])
        end_max = max(end_max, end)
        for j, comm in out[i]:
            ready_at[j] = max(ready_at[j], end + comm)
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(pending[rank[j]][0 if forward[j] else 1], (ready_at[j], key[j], j))
    table = ScheduleTable(placement=placement, num_micro_batches=proto.num_micro_batches, ranks=tuple(map(tuple, lists)),
                          sub_mb_parent=proto.sub_mb_parent, name=name)
    return Interleaved(table, end_max, np.array(peak))
