"""Lower bounds on any schedule's makespan for one iteration's units.

Co-located layout (``makespan_lower_bound``; a linear pipeline with the encoder beside stage 0):
stage ``s`` must do all its own work; before its first action some micro-batch has to pass the
stages before it (and, with an encoder, that micro-batch's encoder), and after its last action some
micro-batch still has to run its backward on every earlier stage (and the encoder's backward, when
trained). So for every stage

    LB_s = min_i(enc_i + sum_{t<s} (fwd[i, t] + p2p_i)) + work_s + min_i(sum_{t<s} (bwd[i, t] + p2p_i))

with ``work_0`` and ``bwd[i, 0]`` including the encoder's work. Also no schedule beats one
micro-batch's full chain ``enc_i + sum_t (fwd + bwd)[i, t] + 2 (S - 1) p2p_i``.

With virtual stages (several backbone chunks per rank) the terms are per rank: its work is all its
chunks', and fill and drain are those of its lowest chunk (every other chunk of the rank lies
further down the pipeline). With split backward the rank's last action may be a ``W`` that
nothing follows, so the bound is the larger of ``fill + work`` and ``fill + (work without W) +
drain``, the drain passing input gradients (``bwd_input``) only: every forward and input
gradient of the rank ends by its last ``I``, which the input-gradient chain still follows. A bound
for split tables is also one for unsplit tables, so a planner that may pick either uses it.

Any placement (``placement_lower_bound``; DIP's separated layout with encoder chunks on every
rank, or any other): every action gets a *head*, the longest chain of producers (with their
messages) that must end before it can start, and a *tail*, the longest chain of consumers (with
their messages) that must still run after it ends. Both ignore the ranks' other work, so they hold
for every table the simulator times. A rank runs its actions one at a time, so for every set ``J``
of its actions

    makespan >= min_{a in J} head_a + sum_{a in J} dur_a + min_{a in J} tail_a

(the first of ``J`` to start cannot start earlier, the last cannot end earlier, and its tail still
follows it). The same argument bounds the head of a micro-batch's first backbone forward: all its
sub-microbatches' encoder forwards on one rank (or of one chunk) run one at a time before it, so
it cannot start before their smallest head + their work + their shortest chain to it; likewise the
tail of its last backbone backward holds all its encoder backwards (``group_bound``: a flow of
many sub-microbatches through the encoder's ranks, not one sub-microbatch's chain). The bound is the largest value over all ranks and all sets ``{a : head_a >= h,
tail_a >= q}`` (for given ``h`` and ``q`` no set does better): the optimum of the rank's
preemptive one-machine relaxation. With ``J`` one action it is the critical path; with ``J`` all of
a rank's actions it is the co-located bound's ``fill + work + drain``, so on a co-located placement
it is never below ``makespan_lower_bound`` (tested).

Split backwards (a table whose backbone backwards are ``I`` then ``W``): the chains pass through
``I`` only, and each ``W`` is one more action with the head of its ``I``'s end and no tail (its
``I``'s tail is at least the ``W``). Whole backwards are the special case of a ``W`` right after
its ``I``, so a split table's bound holds for both; on interleaved placements this is what makes
the bound see that a rank's later chunks cannot start before the pipeline has filled up to them
(``makespan_lower_bound`` uses only the lowest chunk's fill and drain).

Pairs of ranks (``coupled_bound``; trained encoder, whole backwards): the per-rank bound lets every
encoder backward start as early as its own micro-batch allows, so on DIP's layout it misses that
they pile up after the backbone's work. Take a rank ``u`` and let ``x`` be the end of its last
action that is not an encoder backward: ``x`` is at least the one-machine bound of those actions,
and everything ``u`` runs after ``x`` is encoder backwards, at least ``work_u - (x - head_u)`` of
it. Each encoder backward ``EB(j, c)`` on ``u`` hands on to ``EB(j, c')`` on another rank ``v``
(``c'`` the nearest lower chunk there; one ``c`` per ``c'``), which starts after ``x`` plus
``EB(j, c)`` and the chain between; so ``v`` runs at least ``rho`` times that work after ``x``
(``rho``: the smallest ratio of their durations, at most 1), plus the backbone backwards on ``v``
that follow ``u``'s last action (below it in the pipeline). With the shortest delay before any of
them and the shortest tail after them,

    makespan >= x + delay + rho * max(0, work_u + head_u - x - unmapped_u) + backwards_v + tail,

taken at the smallest value over every action that may be ``u``'s last (its micro-batch fixes the
backbone backwards and delays; the right side does not decrease in ``x``, so ``x``'s lower bound
may stand in for it), and the largest over all pairs ``(u, v)``. On DIP's 5B + 8B configurations it
raises the bound by up to 6 % (rank 3's encoder backwards after its last backbone backward are
still to run on rank 0, after the backbone's own backward chain has reached it).

The flow out of chunk 0's rank (``flow_bound``; co-located layouts: every encoder chunk on that
rank). Nothing of micro-batch ``j`` runs on another rank before ``F(0, j)`` ends, and that rank
runs ``lead_j`` (``F(0, j)`` and ``j``'s encoder forwards) before it, one micro-batch after another;
so the ``k``-th micro-batch to leave chunk 0 leaves no earlier than ``left_k``, the sum of the
``k`` smallest ``lead``. On another rank ``r``, every action of the micro-batches that leave
``k``-th or later starts at or after ``h_k = left_k + (the shortest chain from F(0, .)'s end to
any action on r)``, and so does an action ``a`` of the ``i``-th (``i < k``) whenever
``left_i + (the shortest chain to a) >= h_k``. Rank ``r`` runs them all after ``h_k``, one at a
time, so

    makespan >= h_k + (the least work on r of m - k + 1 micro-batches)
                    + sum over i < k and such actions a of a's least work + (the least tail on r),

the largest over ``k`` and ``r``. With ``k = 1`` it is the rank's fill plus its work; for larger
``k`` it sees what the per-rank bound cannot: when chunk 0's rank (with the encoder beside it)
hands micro-batches on more slowly than a later rank consumes them in the first round, that rank
waits between arrivals (on 13B + SigLIP at PP 8, interleaved, it raises the bound by about 1 %).

With a per-rank memory limit (``placement_lower_bound(..., memory_limit)``), also a bound from
memory: the simulator counts a rank's memory along its own action order, so at any moment the
buffers whose allocating action has started and whose freeing action has not yet started fit
under the limit. Every buffer is held at least as long as the chain from its allocating action's
start to its freeing action's start (a saved activation: the rest of the forward, and the
backward back to its chunk), so ``makespan * limit_r >= sum over rank r's buffers of bytes x that
time``. It applies when no action floats (every rank sends its first chunk's output to another
rank, as in DIP's layout with two or more ranks); else it is left out.

And a bound from *windows* (``window_bound``): on a rank whose last backbone chunk is ``s``, all
of micro-batch ``i``'s buffers there (its activations, image features, encoder activations) are
allocated by actions that start no later than ``F(s, i)`` and freed by actions that end no earlier
than ``B(s, i)``, so from the start of ``F(s, i)`` to the end of ``B(s, i)`` the rank holds all
of them (``need_i``; at least the chain ``F(s..S-1), B(S-1..s)`` long). Windows that pairwise
overlap share the start of the latest ``F`` among them, where the simulator counts all their
bytes. So micro-batches with ``need_i > limit / 2`` have disjoint windows (a one-machine bound
over their windows), and windows scaled by ``need_i / limit`` fit one after another (the same bound
with those durations).

``makespan_lower_bound`` and ``placement_lower_bound`` without a limit ignore memory, so they may
be unreachable, never too high. Contention only adds time.
"""

from __future__ import annotations

import numpy as np

from pipetune.schedule.table import Placement, ScheduleTable
from pipetune.simulate.simulator import Latencies


def makespan_lower_bound(lat: Latencies, placement: Placement | None = None, *, split_backward: bool = False) -> float:
    """The co-located bound (sub-microbatch ``i`` = micro-batch ``i``'s images) for backbone
    chunks on ``placement``'s ranks (default: chunk ``s`` on rank ``s``), valid for split tables
    too when ``split_backward``."""
    fwd, p2p = lat.fwd, lat.p2p
    enc = lat.encoder.sum(axis=1)
    bwd = lat.bwd.copy()
    bwd[:, 0] += lat.encoder_bwd.sum(axis=1)
    passes = (lat.bwd_input.copy() if split_backward else bwd.copy())  # what a backward hands on before the next can start
    if split_backward:
        passes[:, 0] += lat.encoder_bwd.sum(axis=1)
    m, S = fwd.shape
    ranks = np.arange(S) if placement is None else np.array(placement.backbone)
    hops = (ranks[:-1] != ranks[1:])[None, :] * p2p[:, None]
    fill = np.cumsum(np.hstack([np.zeros((m, 1)), fwd[:, :-1] + hops]), axis=1) + enc[:, None]
    fill[:, 0] = 0.0
    drain = np.cumsum(np.hstack([np.zeros((m, 1)), passes[:, :-1] + hops]), axis=1)
    R = int(ranks.max()) + 1
    work = np.bincount(ranks, weights=(fwd + bwd).sum(axis=0), minlength=R)
    work[ranks[0]] += enc.sum()
    lowest = np.array([int(np.flatnonzero(ranks == r)[0]) for r in range(R)])
    head, tail = fill.min(axis=0)[lowest], drain.min(axis=0)[lowest]
    if split_backward:
        weights = np.bincount(ranks, weights=(bwd - passes).sum(axis=0), minlength=R)
        per_rank = head + np.maximum(work, work - weights + tail)
    else:
        per_rank = head + work + tail
    chain = enc + fwd.sum(axis=1) + passes.sum(axis=1) + (bwd - passes)[:, 0] + 2 * hops.sum(axis=1)
    return float(max(per_rank.max(), chain.max()))


def heads_and_tails(placement: Placement, sub_mb_parent, lat: Latencies, *,
                    split_backward: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``{kind: (head, duration, tail)}``, each ``[units, chunks]``, for the kinds ``F``, ``B``
    (backbone; with ``split_backward`` its input-gradient part, the ``I`` actions, and ``W``
    after it) and ``EF``, ``EB`` (encoder; ``EB`` only when trained), see the module doc."""
    fwd, p2p = lat.fwd, lat.p2p
    bwd = lat.bwd_input if split_backward else lat.bwd  # what a backbone backward hands on
    weight = lat.bwd - bwd
    m, S = fwd.shape
    bb = np.array(placement.backbone)
    hop = lambda ranks, c: float(ranks[c] != ranks[c + 1])  # noqa: E731  1 if chunks c, c+1 sit on different ranks
    E = len(placement.encoder)
    parent = np.asarray(sub_mb_parent, np.int64)
    n = len(parent) if E else 0
    trained = placement.encoder_trained
    enc = lat.encoder[:n] if E else np.zeros((0, 0))
    encb = lat.encoder_bwd[:n] if trained else np.zeros((n, E))
    er = np.array(placement.encoder, np.int64)
    feat = (float(er[-1] != bb[0]) * lat.feature_p2p[:n]) if E else np.zeros(0)

    hEF = np.zeros((n, E))
    for c in range(1, E):
        hEF[:, c] = hEF[:, c - 1] + enc[:, c - 1] + hop(er, c - 1) * lat.encoder_p2p[:n]
    hF = np.zeros((m, S))
    if n:
        to_f = (hEF[:, -1] + enc[:, -1] + feat)[:, None] - hEF - enc  # end of EF(j, c) to the start of F(parent_j, 0)
        hF[:, 0] = group_bound(parent, er, m, hEF, enc, to_f)
    for s in range(1, S):
        hF[:, s] = hF[:, s - 1] + fwd[:, s - 1] + hop(bb, s - 1) * p2p
    hB = np.zeros((m, S))
    hB[:, -1] = hF[:, -1] + fwd[:, -1]
    for s in range(S - 2, -1, -1):
        hB[:, s] = np.maximum(hF[:, s] + fwd[:, s], hB[:, s + 1] + bwd[:, s + 1] + hop(bb, s) * p2p)
    tB = np.zeros((m, S))
    tEB = np.zeros((n, E))
    hEB = np.zeros((n, E))
    if trained and n:
        for c in range(1, E):
            tEB[:, c] = tEB[:, c - 1] + encb[:, c - 1] + hop(er, c - 1) * lat.encoder_p2p[:n]
        from_b = (feat + encb[:, -1] + tEB[:, -1])[:, None] - encb - tEB  # end of B(parent_j, 0) to the start of EB(j, c)
        tB[:, 0] = group_bound(parent, er, m, from_b, encb, tEB)
        hEB[:, -1] = np.maximum(hEF[:, -1] + enc[:, -1], hB[parent, 0] + bwd[parent, 0] + feat)
        for c in range(E - 2, -1, -1):
            hEB[:, c] = np.maximum(hEF[:, c] + enc[:, c], hEB[:, c + 1] + encb[:, c + 1] + hop(er, c) * lat.encoder_p2p[:n])
    tB[:, 0] = np.maximum(tB[:, 0], weight[:, 0])  # a split backward's W still follows its I
    for s in range(1, S):
        tB[:, s] = np.maximum(tB[:, s - 1] + bwd[:, s - 1] + hop(bb, s - 1) * p2p, weight[:, s])
    tF = np.zeros((m, S))
    tF[:, -1] = bwd[:, -1] + tB[:, -1]
    for s in range(S - 2, -1, -1):
        tF[:, s] = np.maximum(tF[:, s + 1] + fwd[:, s + 1] + hop(bb, s) * p2p, bwd[:, s] + tB[:, s])
    tEF = np.zeros((n, E))
    if n:
        tEF[:, -1] = np.maximum(feat + fwd[parent, 0] + tF[parent, 0], encb[:, -1] + tEB[:, -1] if trained else 0.0)
        for c in range(E - 2, -1, -1):
            tEF[:, c] = np.maximum(tEF[:, c + 1] + enc[:, c + 1] + hop(er, c) * lat.encoder_p2p[:n], encb[:, c] + tEB[:, c] if trained else 0.0)
    out = {"F": (hF, fwd, tF), "B": (hB, bwd, tB), "EF": (hEF, enc, tEF)}
    if split_backward:
        out["W"] = (hB + bwd, weight, np.zeros_like(weight))
    if trained:
        out["EB"] = (hEB, encb, tEB)
    return out


def group_bound(parent: np.ndarray, ranks: np.ndarray, m: int, head: np.ndarray, dur: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """``[m]``: for each micro-batch ``i``, the largest ``min head + sum dur + min tail`` over three
    kinds of sets of its sub-microbatches' encoder actions (``[n, E]`` arrays; ``ranks[c]``: chunk
    ``c``'s rank): one action, one chunk's, one rank's. With ``tail`` the chain to a backbone action
    that needs them all (or ``head`` the chain from one they all need), a bound on the time between
    the two (module doc)."""
    n, E = head.shape
    out = np.zeros(m)
    np.maximum.at(out, np.repeat(parent, E), (head + dur + tail).ravel())
    for groups, per in ((np.arange(E), E), (np.asarray(ranks, np.int64), int(max(ranks)) + 1)):
        key = (parent[:, None] * per + groups[None, :]).ravel()
        lo_h, lo_t = np.full(m * per, np.inf), np.full(m * per, np.inf)
        np.minimum.at(lo_h, key, head.ravel())
        np.minimum.at(lo_t, key, tail.ravel())
        total = np.bincount(key, weights=dur.ravel(), minlength=m * per)
        out = np.maximum(out, np.where(np.isfinite(lo_h), lo_h + total + lo_t, 0.0).reshape(m, per).max(axis=1))
    return out


def coupled_bound(placement: Placement, sub_mb_parent, lat: Latencies, parts) -> float:
    """The bound from pairs of ranks (module doc, "Pairs of ranks"): on rank ``u`` every action after
    the last of its non-``EB`` actions (ending at ``x``) is an encoder backward, and each of them
    hands on to an encoder backward on rank ``v`` that starts after ``x`` too; so does every backbone
    backward on ``v`` below that last action. ``T >= x + delay + work on v after x + tail``, the
    smallest over every action that may be that last one. 0 for a frozen encoder or split tables."""
    if not placement.encoder_trained or "W" in parts:
        return 0.0
    bb, er = np.array(placement.backbone), np.array(placement.encoder, np.int64)
    parent = np.asarray(sub_mb_parent, np.int64)
    hF, fwd, _ = parts["F"]
    hB, bwd, tB = parts["B"]
    hEF, enc, _ = parts["EF"]
    hEB, encb, tEB = parts["EB"]
    m, S = fwd.shape
    R = placement.num_ranks
    hop = (bb[:-1] != bb[1:])[None, :] * lat.p2p[:, None]
    off_f = np.zeros((m, S))  # start of F(s, i) after the start of F(0, i), along micro-batch i's chain
    off_f[:, 1:] = np.cumsum(fwd[:, :-1] + hop, axis=1)
    off_b = np.zeros((m, S))  # start of B(s, i) after the start of F(0, i)
    off_b[:, -1] = off_f[:, -1] + fwd[:, -1]
    for s in range(S - 2, -1, -1):
        off_b[:, s] = off_b[:, s + 1] + bwd[:, s + 1] + hop[:, s]
    feat = float(er[-1] != bb[0]) * lat.feature_p2p[:len(parent)]
    ef_to_f = (hEF[:, -1] + enc[:, -1] + feat)[:, None] - hEF - enc  # end of EF(j, c) to the start of F(parent_j, 0)
    below_v = [(bwd[:, bb == v].sum(axis=1), off_b[:, bb == v].min(axis=1, initial=np.inf), tB[:, bb == v].min(axis=1, initial=np.inf))
               for v in range(R)]  # all backbone backwards of v: work, start after F(0, i) starts, tail
    eb_work = encb.sum(axis=0)
    out = 0.0
    for u in range(R):
        su, cu = np.flatnonzero(bb == u), np.flatnonzero(er == u)
        heads = np.concatenate([hF[:, su].ravel(), hB[:, su].ravel(), hEF[:, cu].ravel()])
        if not len(heads):
            continue
        durs = np.concatenate([fwd[:, su].ravel(), bwd[:, su].ravel(), enc[:, cu].ravel()])
        x_min = one_machine_bound(heads, durs, np.zeros_like(heads))  # every non-EB action of u has ended by x
        ends = [e for s in su for e in (hF[:, s] + fwd[:, s], hB[:, s] + bwd[:, s])] + ([hEF[:, c] + enc[:, c] for c in cu] if len(parent) else [])
        x = np.maximum(x_min, np.concatenate(ends))  # per candidate for u's last non-EB action
        h_u = min(heads.min(), hEB[:, cu].min() if len(cu) and len(parent) else np.inf)
        total = durs.sum() + encb[:, cu].sum()  # u's work; what it has not done by x is EB work after x
        for v in range(R):
            if v == u:
                continue
            sv, cv = np.flatnonzero(bb == v), np.flatnonzero(er == v)
            pairs: dict[int, int] = {}  # chunk on v -> the chunk on u it is the nearest lower one of (one each: the work maps one to one)
            for c in cu:
                lower = cv[cv < c]
                if len(lower):
                    pairs.setdefault(int(lower[-1]), int(c))
            mapped = np.array(sorted(pairs.values()), np.int64)
            unmapped = sum(eb_work[c] for c in cu if c not in pairs.values())
            if len(mapped) and len(parent):
                to = np.array([k for k, _ in sorted(pairs.items(), key=lambda kv: kv[1])], np.int64)
                with np.errstate(divide="ignore", invalid="ignore"):
                    ratio = np.where(encb[:, mapped] > 0, encb[:, to] / encb[:, mapped], np.inf)
                rho = min(1.0, float(ratio.min()))
                eb_delay = float((encb[:, mapped] + tEB[:, mapped] - tEB[:, to] - encb[:, to]).min())
                eb_tail = float(tEB[:, to].min())
            else:
                rho, eb_delay, eb_tail = 0.0, np.inf, np.inf
            b_work, b_delay, b_tail = [], [], []  # per candidate: v's backbone backwards after it, their delay and tail
            for s in su:
                below = sv[sv < s]
                b_work += [below_v[v][0], bwd[:, below].sum(axis=1)]  # after F(s, i): all of v's; after B(s, i): those below s
                b_delay += [below_v[v][1] - off_f[:, s] - fwd[:, s], (off_b[:, below] - (off_b[:, s] + bwd[:, s])[:, None]).min(axis=1, initial=np.inf)]
                b_tail += [below_v[v][2], tB[:, below].min(axis=1, initial=np.inf)]
            if len(parent):
                for c in cu:  # after EF(j, c): every backbone backward of its micro-batch
                    b_work.append(below_v[v][0][parent])
                    b_delay.append(ef_to_f[:, c] + below_v[v][1][parent])
                    b_tail.append(below_v[v][2][parent])
            best = _after(x, rho, total + h_u - unmapped, eb_delay, eb_tail, np.concatenate(b_work), np.concatenate(b_delay),
                          np.concatenate(b_tail))
            out = max(out, best)
    return out


def _after(x, rho, reach, eb_delay, eb_tail, b_work, b_delay, b_tail) -> float:
    """The smallest ``x + delay + work + tail`` over candidates (arrays): ``rho * (reach - x)`` of
    mapped encoder backward work and ``b_work`` of backbone backwards on ``v`` after ``x``."""
    eb = rho * np.maximum(reach - x, 0.0)
    has_eb, has_b = eb > 0, b_work > 0
    delay = np.minimum(np.where(has_eb, eb_delay, np.inf), np.where(has_b, b_delay, np.inf))
    tail = np.minimum(np.where(has_eb, eb_tail, np.inf), np.where(has_b, b_tail, np.inf))
    value = np.where(has_eb | has_b, x + delay + eb + b_work + tail, x)
    return float(value.min()) if len(value) else np.inf


def flow_bound(placement: Placement, sub_mb_parent, lat: Latencies, parts) -> float:
    """The bound from the flow out of chunk 0's rank (module doc, "Flow"), for every other rank at
    once: 0 unless every encoder chunk sits on that rank (co-located layouts) and there are two
    micro-batches or more."""
    bb, er = np.array(placement.backbone), np.array(placement.encoder, np.int64)
    source, R = bb[0], placement.num_ranks
    hF, fwd, _ = parts["F"]
    m = fwd.shape[0]
    if m < 2 or (er != source).any():
        return 0.0
    lead = fwd[:, 0].copy()  # the source rank's work that ends with F(0, j): its forward and its images' encoder forwards
    if len(er):
        np.add.at(lead, np.asarray(sub_mb_parent, np.int64), lat.encoder[:len(sub_mb_parent)].sum(axis=1))
    left = np.cumsum(np.sort(lead))  # left[k]: the earliest the (k + 1)-th micro-batch can leave chunk 0
    kinds = [parts[kind] for kind in ("F", "B", "W") if kind in parts]  # the backbone's actions, [kinds, m, S] below
    H, D, T = (np.stack([x[i] for x in kinds]) for i in range(3))
    delay = (H - (hF[:, 0] + fwd[:, 0])[None, :, None]).min(axis=1)  # [kinds, S]: least chain after F(0, j) ends
    first = np.full(R, np.inf)
    np.minimum.at(first, bb, delay.min(axis=0))
    tail = np.full(R, np.inf)
    np.minimum.at(tail, bb, T.min(axis=(0, 1)))
    work = np.zeros((R, m))
    np.add.at(work, bb, D.sum(axis=0).T)
    first = left[None, :] + first[:, None]  # [R, k]: no action of the micro-batches leaving (k + 1)-th or later starts before
    after = np.cumsum(np.sort(work, axis=1), axis=1)[:, ::-1]  # [R, k]: the least work of m - k micro-batches
    k = np.arange(m)
    start = np.searchsorted(left, first[bb][None] - delay[:, :, None])  # [kinds, S, k]: earlier positions from here on start after it too
    early = np.zeros((R, m))
    np.add.at(early, bb, (np.maximum(k - start, 0) * D.min(axis=1)[:, :, None]).sum(axis=0))
    value = first + after + early + tail[:, None]
    value[source] = 0.0  # its own flow is the co-located bound's
    return float(value[np.isfinite(value)].max(initial=0.0))


def one_machine_bound(head: np.ndarray, dur: np.ndarray, tail: np.ndarray, *, max_levels: int = 128) -> float:
    """``max over h, q of h + q + sum(dur[head >= h and tail >= q])`` over non-empty sets: the
    preemptive one-machine bound of one rank's actions (module doc). Of the tails, ``max_levels``
    evenly spread ones are tried as ``q`` (each still gives a valid bound; all of them when there
    are no more), which keeps the work linear in the actions."""
    if not len(head):
        return 0.0
    order = np.argsort(-head, kind="stable")
    h, p, q = head[order], dur[order], tail[order]
    levels = np.unique(q)
    if len(levels) > max_levels:
        levels = levels[np.linspace(0, len(levels) - 1, max_levels).round().astype(np.int64)]
    has = q[:, None] >= levels[None, :]
    work = np.cumsum(p[:, None] * has, axis=0)  # [i, k]: the i + 1 latest-released actions with tail >= levels[k]
    value = np.where(np.cumsum(has, axis=0) > 0, h[:, None] + levels[None, :] + work, -np.inf)
    return float(value.max())


def memory_bound(placement: Placement, sub_mb_parent, lat: Latencies, memory_limit) -> float:
    """``max_r sum(bytes x shortest holding time) / limit_r`` over each rank's buffers (module doc);
    0 when an action may float, ``inf`` when a rank holds buffers but may hold no bytes."""
    bb, er = np.array(placement.backbone), np.array(placement.encoder, np.int64)
    E, S = len(er), len(bb)
    if (E and (er[1] if E > 1 else bb[0]) == er[0]) or (S > 1 and bb[1] == bb[0]):
        return 0.0  # encoder chunk 0's forwards, or an image-less micro-batch's first forward, may float
    fwd, bwd, p2p = lat.fwd, lat.bwd, lat.p2p
    hop = lambda ranks, c: float(ranks[c] != ranks[c + 1])  # noqa: E731
    held = np.zeros(placement.num_ranks)
    d = np.zeros_like(fwd)  # start of F(s, j) to start of B(s, j)
    d[:, -1] = fwd[:, -1]
    for s in range(S - 2, -1, -1):
        d[:, s] = fwd[:, s] + 2 * hop(bb, s) * p2p + d[:, s + 1] + bwd[:, s + 1]
    np.add.at(held, bb, (lat.activation_bytes * d).sum(axis=0))
    parent = np.asarray(sub_mb_parent, np.int64)
    if E and len(parent):
        n = len(parent)
        feat = float(er[-1] != bb[0]) * lat.feature_p2p[:n]
        held[bb[0]] += float((lat.image_feature_bytes[:n] * d[parent, 0]).sum())
        if placement.encoder_trained:
            enc, encb = lat.encoder[:n], lat.encoder_bwd[:n]
            de = np.zeros((n, E))
            de[:, -1] = enc[:, -1] + 2 * feat + d[parent, 0] + bwd[parent, 0]
            for c in range(E - 2, -1, -1):
                de[:, c] = enc[:, c] + 2 * hop(er, c) * lat.encoder_p2p[:n] + de[:, c + 1] + encb[:, c + 1]
            np.add.at(held, er, (lat.encoder_activation_bytes[:n] * de).sum(axis=0))
    limit = np.broadcast_to(np.asarray(memory_limit, np.float64), held.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        per_rank = np.where(held > 0, held / np.maximum(limit, 0.0), 0.0)
    return float(per_rank.max())


def window_bound(placement: Placement, sub_mb_parent, lat: Latencies, memory_limit, parts) -> float:
    """The bound from micro-batch windows (module doc): per rank holding backbone chunks, the
    one-machine bound over the windows of micro-batches that pairwise cannot share the rank's
    memory, and over all windows with each one's bytes x length / limit as its duration."""
    bb, er = np.array(placement.backbone), np.array(placement.encoder, np.int64)
    E, S, R = len(er), len(bb), placement.num_ranks
    if (E and (er[1] if E > 1 else bb[0]) == er[0]) or (S > 1 and bb[1] == bb[0]):
        return 0.0  # as memory_bound: an action may float
    fwd, bwd, p2p = lat.fwd, lat.bwd, lat.p2p
    m = fwd.shape[0]
    hF, tB = parts["F"][0], parts["B"][2]
    need = np.zeros((m, R))
    np.add.at(need.T, bb, lat.activation_bytes.T)
    parent = np.asarray(sub_mb_parent, np.int64)
    n = len(parent) if E else 0
    if n:
        np.add.at(need[:, bb[0]], parent, lat.image_feature_bytes[:n])
        if placement.encoder_trained:
            for c, r in enumerate(er):
                np.add.at(need[:, r], parent, lat.encoder_activation_bytes[:n, c])
    limit = np.broadcast_to(np.asarray(memory_limit, np.float64), (R,))
    length = np.zeros((m, S))  # start of F(s, i) to the end of B(s, i)
    length[:, -1] = fwd[:, -1] + bwd[:, -1]
    for c in range(S - 2, -1, -1):
        length[:, c] = fwd[:, c] + bwd[:, c] + 2 * float(bb[c] != bb[c + 1]) * p2p + length[:, c + 1]
    out = 0.0
    for r in range(R):
        chunks = np.flatnonzero(bb == r)
        if not len(chunks):
            continue
        s = chunks[-1]
        if (need[:, r] > limit[r]).any():
            return np.inf
        big = need[:, r] > limit[r] / 2
        if big.any():
            out = max(out, one_machine_bound(hF[big, s], length[big, s], tB[big, s]))
        if limit[r] > 0:
            out = max(out, one_machine_bound(hF[:, s], need[:, r] * length[:, s] / limit[r], tB[:, s]))
    return out


def placement_lower_bound(table: ScheduleTable, lat: Latencies, memory_limit=None, *, enough: float = np.inf) -> float:
    """The bound for any placement (see the module doc); ``table`` gives the placement, the
    sub-microbatches and whether backwards are split (a split table's bound holds for whole
    backwards too); its rank lists are not read. With ``memory_limit`` (bytes per rank, or one
    for all), a bound on the tables that fit it (whole backwards only: the memory terms are left
    out for split tables). With ``enough``, the first term that reaches it is returned (still a
    bound, the cheapest terms first): for callers that only need to know it is that high."""
    p = table.placement
    parts = heads_and_tails(p, table.sub_mb_parent, lat, split_backward=table.split_backward)
    bound = max(flow_bound(p, table.sub_mb_parent, lat, parts), coupled_bound(p, table.sub_mb_parent, lat, parts))
    rank_of = {"F": p.backbone, "B": p.backbone, "W": p.backbone, "EF": p.encoder, "EB": p.encoder}
    per_rank: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in range(p.num_ranks)]
    for kind, (h, d, t) in parts.items():
        for c, r in enumerate(rank_of[kind]):
            per_rank[r].append((h[:, c], d[:, c], t[:, c]))
    for cols in reversed(per_rank):  # the last ranks wait longest for the pipeline to fill: often the largest
        if bound >= enough:
            return bound
        bound = max(bound, one_machine_bound(*(np.concatenate(x) for x in zip(*cols))))
    if memory_limit is None or table.split_backward or bound >= enough:
        return bound
    return max(bound, memory_bound(p, table.sub_mb_parent, lat, memory_limit), window_bound(p, table.sub_mb_parent, lat, memory_limit, parts))
