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
found; if one does not, the result is ``None``. Admission is conservative (it reserves a whole
micro-batch's forward memory up front), so ``Problem.run_fitting`` first runs the greedy without
it, stopping once a rank's memory would pass its limit, and falls back to admission only then.

Deviation from DIP's text: DIP picks the rank with the smallest earliest ready time of its
queued stages; we take the earliest time an action can actually *start* (ready time or the end of
the rank's current work, whichever is later), which keeps the construction in time order.

Lower priority values go first. ``Problem.point_keys`` derives them from a micro-batch order:
backbone micro-batch ``order[i]`` gets ``i``, the encoder forwards of its images ``i - lead`` (the
encoder runs ``lead`` micro-batches ahead of the backbone) and their backwards ``i + lag``. With
``lag = -lead`` the segments of one micro-batch and modality share one priority: DIP's segment
reordering (DIP Sec. 5.1). A large ``lag`` lets the
backbone's backwards, which the next micro-batches' chains wait for, pass the encoder's, which
only the end of the iteration waits for. The scheduling times are the simulator's own: ``simulate`` on the returned table gives the same
makespan and peak memory (tested).

Speed: everything but the priorities depends on the packing alone, so ``Problem`` holds it as
flat Python lists, built once per packing, and ``Problem.run`` is one pass of list scheduling per
priority vector (about 1 ms for 200 actions on one core); the search calls it hundreds of times.
Under admission, forwards of a micro-batch that does not fit are set aside until a release on the
rank it overflowed (or its admission) may let it in, instead of being re-examined every round
(which cost 30x on a video batch's 2,000 actions).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pipetune.schedule.lowering import Message
from pipetune.schedule.table import Op, Placement, ScheduleTable
from pipetune.simulate.simulator import Latencies, buffer_bytes, durations, message_costs


@dataclass(frozen=True)
class Interleaved:
    """A greedy table with its own makespan and per-rank peak bytes (activations, not model states)."""

    problem: "Problem"
    lists: tuple[tuple[int, ...], ...]
    makespan: float
    peak_bytes: np.ndarray

    @cached_property
    def table(self) -> ScheduleTable:
        p = self.problem
        return ScheduleTable(placement=p.placement, num_micro_batches=p.num_micro_batches,
                             ranks=tuple(tuple(p.acts[i] for i in r) for r in self.lists), sub_mb_parent=p.sub_mb_parent, name=p.name)


class Problem:
    """One packing's actions, durations, messages and buffers as flat lists, for ``run``."""

    def __init__(self, placement: Placement, sub_mb_parent: tuple[int, ...], lat: Latencies, *, name: str = "interleaved"):
        proto = ScheduleTable(placement=placement, num_micro_batches=lat.fwd.shape[0], ranks=((),) * placement.num_ranks,
                              sub_mb_parent=tuple(sub_mb_parent), name=name)
        acts = proto.expected_actions()
        index = {a: i for i, a in enumerate(acts)}
        self.placement, self.sub_mb_parent, self.num_micro_batches, self.name = placement, proto.sub_mb_parent, proto.num_micro_batches, name
        self.acts = acts
        self.num_ranks = R = placement.num_ranks
        self.rank = [placement.rank_of(a) for a in acts]
        self.dur = [float(durations(lat, a.module, a.op)[a.unit, a.chunk]) for a in acts]
        self.forward = [a.op is Op.FORWARD for a in acts]
        self.is_encoder = np.array([a.is_encoder for a in acts], bool)
        self.alloc, self.free = [0.0] * len(acts), [0.0] * len(acts)
        self.group = [proto.sub_mb_parent[a.unit] if a.is_encoder else a.unit for a in acts]
        self.mb_of = np.array(self.group, np.int64)
        self.is_ef = self.is_encoder & np.array(self.forward, bool)
        self.is_eb = self.is_encoder & ~np.array(self.forward, bool)
        need = np.zeros((proto.num_micro_batches, R))  # forward memory of each micro-batch (with its images) on each rank
        for kind, chunk, unit, made, freed in proto.buffers():
            arr = buffer_bytes(lat, kind)
            nbytes = float(arr[unit, chunk] if arr.ndim == 2 else arr[unit])
            self.alloc[index[made]] += nbytes
            self.free[index[freed]] += nbytes
            need[self.group[index[made]], self.rank[index[made]]] += nbytes
        self.need = need.tolist()
        self.out = []
        for i, a in enumerate(acts):
            edges = []
            for c in proto.consumers(a):
                j = index[c]
                msg = Message(a, c)
                edges.append((j, 0.0 if self.rank[j] == self.rank[i] else float(message_costs(lat, msg.kind)[msg.unit])))
            self.out.append(edges)
        self.waiting = [len(proto.producers(a)) for a in acts]
        self.work = [0.0] * R  # each rank's total work
        for r, d in zip(self.rank, self.dur):
            self.work[r] += d

    def point_keys(self, order, lead: int, lag: int) -> list[int]:
        """Priorities of a search point (``segment_search``): micro-batch ``order[i]``'s backbone
        actions get ``i``, its encoder forwards ``i - lead`` and its encoder backwards ``i + lag``."""
        pos = np.empty(self.num_micro_batches, np.int64)
        pos[np.asarray(order, np.int64)] = np.arange(self.num_micro_batches)
        return (pos[self.mb_of] - lead * self.is_ef + lag * self.is_eb).tolist()

    def run_fitting(self, prio: list, memory_limit: np.ndarray, *, within: float = np.inf) -> Interleaved | None:
        """The greedy without admission (``memory_limit=None``) when its table's peak fits
        ``memory_limit`` on every rank, else the greedy with admission (module doc, "Memory"):
        admission reserves a micro-batch's whole forward memory on every rank before its first
        action, which also rejects orders whose real peak would fit. Either table fits the limit.
        ``within``: None when that table cannot end before it (``run``), and also when the greedy
        without admission cannot before its memory passes the limit: admission only delays
        forwards, so it is not tried then (``tests/unit/test_separated_search.py`` counts how
        rarely that loses a faster table)."""
        free, cut = self._run(prio, None, memory_limit, within)
        if free is not None:
            return free if free.makespan < within else None
        return None if cut else self._run(prio, memory_limit, None, within)[0]

    def run(self, prio: list, memory_limit: np.ndarray | None = None, *, cap: np.ndarray | None = None,
            within: float = np.inf) -> Interleaved | None:
        """The greedy table (module doc) for one priority per action (``acts`` order, e.g.
        ``point_keys``; lower runs first); ``memory_limit[r]``: bytes rank ``r`` may hold at once
        (admission). With ``cap`` (bytes per rank), ``None`` as soon as a rank's memory would exceed it.
        With ``within`` (seconds), ``None`` as soon as a rank's scheduled work plus the work it has
        left reaches it (with a relative margin of ``1e-9`` for the sums' rounding), so the table
        cannot end before it: a caller keeping only a table faster than ``within`` is spared the rest."""
        return self._run(prio, memory_limit, cap, within)[0]

    def _run(self, prio: list, memory_limit: np.ndarray | None, cap: np.ndarray | None, within: float) -> tuple[Interleaved | None, bool]:
        """``run``, and whether it was cut short by ``within``."""
        R = self.num_ranks
        n_acts = len(self.acts)
        rank, dur, forward, group, alloc, free, need, out = (self.rank, self.dur, self.forward, self.group, self.alloc, self.free,
                                                             self.need, self.out)
        key = list(zip(prio, range(n_acts)))
        waiting = self.waiting.copy()
        ready_at = [0.0] * n_acts
        limited = memory_limit is not None
        limit = [float(x) for x in memory_limit] if limited else []
        capped = cap is not None
        caps = [float(x) for x in np.broadcast_to(np.asarray(cap, np.float64), (R,))] if capped else []
        cut = within < np.inf
        within *= 1 + 1e-9
        left = self.work.copy()  # work not yet scheduled, per rank
        # per rank and kind (0 forward, 1 backward): not yet startable (by ready time), startable (by priority)
        pending = [[[], []] for _ in range(R)]
        avail = [[[], []] for _ in range(R)]
        # forwards found not allowed (admission), by micro-batch: (heap, entry) set aside until the
        # micro-batch is admitted or fits again, which only a release on the rank it overflowed can make it
        blocked: dict[int, list] = {}
        overflows: list[set[int]] = [set() for _ in range(R)]  # blocked micro-batches by the rank they overflowed
        for i in range(n_acts):
            if waiting[i] == 0:
                heapq.heappush(pending[rank[i]][0 if forward[i] else 1], (0.0, key[i], i))
        t_last, mem, peak, last_fwd = [0.0] * R, [0.0] * R, [0.0] * R, [False] * R
        held = [0.0] * R  # memory in use plus what admitted micro-batches will still allocate, per rank
        admitted = [False] * self.num_micro_batches
        lists: list[list[int]] = [[] for _ in range(R)]
        end_max = 0.0

        def overflow(g: int) -> int:
            """The first rank whose limit micro-batch ``g``'s forward memory would pass, or -1."""
            ng = need[g]
            for r in range(R):
                if held[r] + ng[r] > limit[r]:
                    return r
            return -1

        def first_allowed(heap: list, by: int) -> tuple | None:
            """The best entry of ``heap`` (ordered by its tuples) whose action may run, or None;
            the entries before it are set aside (``blocked``)."""
            while heap:
                g = group[heap[0][by]]
                if admitted[g]:
                    return heap[0]
                r = overflow(g)
                if r < 0:
                    return heap[0]
                if g not in blocked:
                    blocked[g] = []
                    overflows[r].add(g)
                blocked[g].append((heap, heapq.heappop(heap)))
            return None

        def release(g: int) -> None:
            for heap, e in blocked.pop(g):
                heapq.heappush(heap, e)

        for _ in range(n_acts):
            best_t, best_i, best_r = np.inf, -1, -1
            for r in range(R):
                t = t_last[r]
                if t >= best_t:
                    continue
                pr, av = pending[r], avail[r]
                for q in (0, 1):
                    pq = pr[q]
                    while pq and pq[0][0] <= t:
                        _, k, i = heapq.heappop(pq)
                        heapq.heappush(av[q], (k, i))
                f = first_allowed(av[0], 1) if limited else (av[0][0] if av[0] else None)
                b = av[1][0] if av[1] else None
                if f is not None or b is not None:
                    i = (b[1] if last_fwd[r] else f[1]) if f is not None and b is not None else (f or b)[1]
                    best_t, best_i, best_r = t, i, r
                    continue
                heads = [h for h in (pr[1][0] if pr[1] else None,
                                     first_allowed(pr[0], 2) if limited else (pr[0][0] if pr[0] else None)) if h]
                if heads:
                    start, _, i = min(heads)
                    if start < best_t:
                        best_t, best_i, best_r = start, i, r
            if best_i < 0:
                return None, False  # no micro-batch fits on its own: no table exists under this limit
            i, r = best_i, best_r
            q = 0 if forward[i] else 1
            for heap in (avail[r][q], pending[r][q]):
                if heap and heap[0][-1] == i:
                    heapq.heappop(heap)
                    break
                at = next((n for n, e in enumerate(heap) if e[-1] == i), None)
                if at is not None:
                    last = heap.pop()
                    if at < len(heap):
                        heap[at] = last
                        heapq.heapify(heap)
                    break
            g = group[i]
            if not admitted[g]:
                admitted[g] = True
                if g in blocked:
                    for x in overflows:
                        x.discard(g)
                    release(g)
                ng = need[g]
                for x in range(R):
                    held[x] += ng[x]
            start = best_t if best_t > ready_at[i] else ready_at[i]
            end = start + dur[i]
            t_last[r], last_fwd[r] = end, forward[i]
            m = mem[r] + alloc[i]
            if m > peak[r]:
                if capped and m > caps[r]:
                    return None, False
                peak[r] = m
            mem[r] = m - free[i]
            if free[i]:
                held[r] -= free[i]
                if overflows[r]:
                    for h in list(overflows[r]):
                        x = overflow(h)
                        if x != r:
                            overflows[r].discard(h)
                            if x < 0:
                                release(h)
                            else:
                                overflows[x].add(h)
            lists[r].append(i)
            if end > end_max:
                end_max = end
            if cut:
                left[r] -= dur[i]
                if end + left[r] >= within:
                    return None, True
            for j, comm in out[i]:
                t = end + comm
                if t > ready_at[j]:
                    ready_at[j] = t
                waiting[j] -= 1
                if waiting[j] == 0:
                    heapq.heappush(pending[rank[j]][0 if forward[j] else 1], (ready_at[j], key[j], j))
        return Interleaved(self, tuple(map(tuple, lists)), end_max, np.array(peak)), False
