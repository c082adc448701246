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

Speed: everything but the priorities depends on the packing alone, so ``Problem`` holds it as flat
Python lists, built once per packing with numpy, and ``Problem.run`` is one pass of list scheduling
per priority vector (about 2 us an action on one core; a video batch's configuration holds up to
5,000); the search calls it hundreds of times. Priorities become each action's rank in (priority,
index) order, so the queues are heaps of plain ints. A rank's next action is found again only when
something it depends on changed (its own schedule, an action ready before it could start, a
release, an admission; same tables: tested against the rules one by one). Under admission, forwards
of a micro-batch that does not fit are set aside until a release on a rank it overflowed (or its
admission) may let it in, instead of being re-examined every round (which cost 30x on a video
batch's 2,000 actions); a release rechecks only the micro-batches that now fit on that rank, and
puts back only each queue's best forward of a micro-batch, the rest following it once it runs (most
are set aside again before then: the next admission takes the memory).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pipetune.schedule.table import Action, Placement, ScheduleTable
from pipetune.simulate.simulator import Latencies


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
        # Built with numpy from the table's index arithmetic (``acts`` order: ``expected_actions``):
        # action by action, a video batch's 4,700 actions cost 40 ms per configuration, now 2 ms.
        m, parent = lat.fwd.shape[0], np.asarray(sub_mb_parent, np.int64)
        n, S, E = len(parent), placement.num_stages, len(placement.encoder)
        self.placement, self.sub_mb_parent, self.num_micro_batches, self.name = placement, tuple(sub_mb_parent), m, name
        self.num_ranks = R = placement.num_ranks
        trained = placement.encoder_trained
        ops_e = 2 if trained else 1
        NE = E * ops_e * n
        self.num_actions = N = NE + 2 * S * m
        k, c = np.arange(n), np.arange(E)
        j, s = np.arange(m), np.arange(S)
        ef = (c[:, None] * ops_e) * n + k  # [E, n]: encoder forward of chunk c, sub-microbatch k
        eb = ef + n  # encoder backward (trained only)
        bf = NE + (s[:, None] * 2) * m + j  # [S, m]
        bb = bf + m
        enc_rank, bb_rank = np.asarray(placement.encoder, np.int64), np.asarray(placement.backbone, np.int64)
        rank = np.empty(N, np.int64)
        dur = np.empty(N)
        group = np.empty(N, np.int64)
        forward = np.zeros(N, bool)
        rank[ef], dur[ef], group[ef], forward[ef] = enc_rank[:, None], lat.encoder.T, parent, True
        rank[bf], dur[bf], group[bf], forward[bf] = bb_rank[:, None], lat.fwd.T, j, True
        rank[bb], dur[bb], group[bb] = bb_rank[:, None], lat.bwd.T, j
        if trained:
            rank[eb], dur[eb], group[eb] = enc_rank[:, None], lat.encoder_bwd.T, parent
        self.rank, self.dur, self.forward, self.group = rank.tolist(), dur.tolist(), forward.tolist(), group.tolist()
        self.mb_of = group
        encoder = np.arange(N) < NE
        self.is_ef, self.is_eb = encoder & forward, encoder & ~forward
        # Buffers (``ScheduleTable.buffers``), summed in its order so every sum rounds as it does there.
        alloc, free = np.zeros(N), np.zeros(N)
        alloc[bf], free[bb] = lat.activation_bytes.T, lat.activation_bytes.T
        made = [bf.ravel()]
        nbytes = [lat.activation_bytes.T.ravel()]
        if n and E:
            feat_made = ef[-1] if enc_rank[-1] == bb_rank[0] else bf[0, parent]
            per_k = [ef.T, feat_made[:, None]] if trained else [feat_made[:, None]]
            per_b = [lat.encoder_activation_bytes, lat.image_feature_bytes[:, None]] if trained else [lat.image_feature_bytes[:, None]]
            made.append(np.concatenate(per_k, axis=1).ravel())
            nbytes.append(np.concatenate(per_b, axis=1).ravel())
            freed = np.concatenate([eb.T, bb[0, parent][:, None]] if trained else [bb[0, parent][:, None]], axis=1).ravel()
            np.add.at(alloc, made[-1], nbytes[-1])
            np.add.at(free, freed, nbytes[-1])
        made, nbytes = np.concatenate(made), np.concatenate(nbytes)
        need = np.zeros((m, R))  # forward memory of each micro-batch (with its images) on each rank
        np.add.at(need, (group[made], rank[made]), nbytes)
        self.alloc, self.free, self.need = alloc.tolist(), free.tolist(), need.tolist()
        # Edges (``ScheduleTable.consumers``, in its order) with their message times (0 on one rank).
        src, dst, cost = [], [], []

        def edge(a, b, seconds=None):
            a, b = np.broadcast_arrays(a, b)
            src.append(a.ravel())
            dst.append(b.ravel())
            cost.append(np.zeros(a.size) if seconds is None else np.broadcast_to(seconds, a.shape).ravel())

        if E:
            edge(ef[:-1], ef[1:], lat.encoder_p2p)
            edge(ef[-1], bf[0, parent], lat.feature_p2p)
        if trained:
            edge(ef, eb)
            edge(eb[1:], eb[:-1], lat.encoder_p2p)
            edge(bb[0, parent], eb[-1], lat.feature_p2p)
        edge(bf[:-1], bf[1:], lat.p2p)
        edge(bf, bb)
        edge(bb[1:], bb[:-1], lat.p2p)
        src, dst, cost = np.concatenate(src), np.concatenate(dst), np.concatenate(cost)
        cost = np.where(rank[src] == rank[dst], 0.0, cost)
        by = np.argsort(src, kind="stable")
        edges = list(zip(dst[by].tolist(), cost[by].tolist()))
        ends = np.cumsum(np.bincount(src, minlength=N)).tolist()
        self.out = tuple(tuple(edges[a:b]) for a, b in zip([0] + ends[:-1], ends))  # tuples: untracked by the collector
        self.waiting = np.bincount(dst, minlength=N).tolist()
        self.work = np.bincount(rank, weights=dur, minlength=R).tolist()  # each rank's total work

    @cached_property
    def acts(self) -> list[Action]:
        """Every action, ``index`` order (``ScheduleTable.expected_actions``)."""
        return ScheduleTable(placement=self.placement, num_micro_batches=self.num_micro_batches, ranks=(),
                             sub_mb_parent=self.sub_mb_parent).expected_actions()

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
        n_acts = self.num_actions
        push, pop = heapq.heappush, heapq.heappop
        rank, dur, forward, group, alloc, free, need, out = (self.rank, self.dur, self.forward, self.group, self.alloc, self.free,
                                                             self.need, self.out)
        # each action's rank in (priority, index) order: heaps of plain ints compare fastest
        act = np.lexsort((np.arange(n_acts), np.asarray(prio)))
        key = np.empty(n_acts, np.int64)
        key[act] = np.arange(n_acts)
        key, act = key.tolist(), act.tolist()
        waiting = self.waiting.copy()
        ready_at = [0.0] * n_acts
        limited = memory_limit is not None
        limit = [float(x) for x in memory_limit] if limited else []
        capped = cap is not None
        caps = [float(x) for x in np.broadcast_to(np.asarray(cap, np.float64), (R,))] if capped else []
        cut = within < np.inf
        within *= 1 + 1e-9
        left = self.work.copy()  # work not yet scheduled, per rank
        # per rank and kind (0 forward, 1 backward): not yet startable ((ready time, key)), startable (key)
        pending = [[[], []] for _ in range(R)]
        avail = [[[], []] for _ in range(R)]
        # forwards found not allowed (admission), by micro-batch: (heap, entry, rank) set aside until
        # the micro-batch is admitted or fits again, which only a release on a rank it overflowed can make it
        blocked: dict[int, list] = {}
        # blocked micro-batches by a rank they overflow, as (forward memory there, micro-batch): a
        # release on that rank rechecks only those that now fit there (``filed``: the current entry)
        overflows: list[list[tuple[float, int]]] = [[] for _ in range(R)]
        filed = [-1] * self.num_micro_batches
        behind: dict[int, list[int]] = {}  # startable forwards kept out of their queue behind a better one of their micro-batch
        for i in range(n_acts):
            if waiting[i] == 0:
                push(pending[rank[i]][0 if forward[i] else 1], (0.0, key[i]))
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

        def first_allowed(heap: list, timed: bool, r: int):
            """The best entry of rank ``r``'s ``heap`` whose action may run, or None; the entries
            before it are set aside (``blocked``). ``timed``: a heap of (ready time, key)."""
            while heap:
                g = group[act[heap[0][1] if timed else heap[0]]]
                if admitted[g]:
                    return heap[0]
                x = overflow(g)
                if x < 0:
                    return heap[0]
                if g not in blocked:
                    blocked[g] = []
                    push(overflows[x], (need[g][x], g))
                    filed[g] = x
                blocked[g].append((heap, pop(heap), r))
            return None

        def release(g: int) -> None:
            """Put ``g``'s forwards back; of those in one startable queue, only the best, the rest
            behind it until it runs (a micro-batch admitted), as most are set aside again first."""
            startable: dict[int, tuple] = {}
            for heap, e, r in blocked.pop(g):
                stale.add(r)
                if type(e) is tuple:
                    push(heap, e)
                else:
                    startable.setdefault(id(heap), (heap, []))[1].append(e)
            for heap, keys in startable.values():
                first = min(keys)
                if len(keys) > 1:
                    rest = behind.setdefault(first, [])
                    for k in keys:
                        if k != first:
                            rest.append(k)
                            rest.extend(behind.pop(k, ()))
                push(heap, first)

        def pick(r: int) -> tuple:
            """Rank ``r``'s next action: (the time it can start, its index, the heap it heads)."""
            t = t_last[r]
            pr, av = pending[r], avail[r]
            for q in (0, 1):
                pq = pr[q]
                while pq and pq[0][0] <= t:
                    push(av[q], pop(pq)[1])
            b = av[1][0] if av[1] else None
            if b is not None and last_fwd[r]:
                return t, act[b], av[1]
            f = av[0][0] if av[0] else None
            if limited and f is not None and not admitted[group[act[f]]]:
                f = first_allowed(av[0], False, r)
            if f is not None:
                return t, act[f], av[0]
            if b is not None:
                return t, act[b], av[1]
            hb = pr[1][0] if pr[1] else None
            hf = pr[0][0] if pr[0] else None
            if limited and hf is not None and not admitted[group[act[hf[1]]]]:
                hf = first_allowed(pr[0], True, r)
            if hb is not None and (hf is None or hb < hf):
                return hb[0], act[hb[1]], pr[1]
            return (hf[0], act[hf[1]], pr[0]) if hf is not None else (np.inf, -1, None)

        # Each rank's next action is found again only after something it depends on changed: its
        # own schedule, its queues (an action ready before it could start, a release) or, under
        # admission, what is held.
        cand: list[tuple] = [()] * R
        at = [0.0] * R  # each rank's candidate start time
        stale = set(range(R))
        others = range(1, R)
        for _ in range(n_acts):
            for r in stale:
                cand[r] = c = pick(r)
                at[r] = c[0]
            stale.clear()
            r, best_t = 0, at[0]
            for x in others:
                if at[x] < best_t:
                    r, best_t = x, at[x]
            _, i, heap = cand[r]
            if i < 0:
                return None, False  # no micro-batch fits on its own: no table exists under this limit
            e = pop(heap)
            if behind and type(e) is int and e in behind:
                for k in behind.pop(e):
                    push(heap, k)
            stale.add(r)
            g = group[i]
            if not admitted[g]:
                admitted[g] = True
                if g in blocked:
                    release(g)
                ng = need[g]
                for x in range(R):
                    held[x] += ng[x]
                if limited:
                    stale.update(range(R))
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
                over = overflows[r]
                while over and over[0][0] + held[r] <= limit[r]:
                    h = pop(over)[1]
                    if filed[h] != r or h not in blocked:
                        continue  # admitted, or filed under another rank since
                    x = overflow(h)
                    if x < 0:
                        filed[h] = -1
                        release(h)
                    else:
                        push(overflows[x], (need[h][x], h))
                        filed[h] = x
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
                    x = rank[j]
                    push(pending[x][0 if forward[j] else 1], (ready_at[j], key[j]))
                    if at[x] != t_last[x] or ready_at[j] <= t_last[x]:
                        stale.add(x)  # else ``x`` can start another action now, before this one is ready
        return Interleaved(self, tuple(map(tuple, lists)), end_max, np.array(peak)), False
