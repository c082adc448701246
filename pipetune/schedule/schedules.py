"""Co-located schedule generators: pure functions from (stages, micro-batch order) to a ``ScheduleTable``.

``order`` is the execution order of micro-batches (a permutation of ``range(m)``): the k-th
micro-batch to enter the pipeline is ``order[k]``. With an encoder, the layout is PipeTune's: one
encoder chunk beside backbone chunk 0, sub-microbatch ``j`` = the images of micro-batch ``j``; its
forward ``E0F{j}`` sits immediately before ``0F{j}`` and, when the encoder is trained, its
backward ``E0B{j}`` immediately after ``0B{j}``. ``place_encoders`` moves encoder forwards earlier
(pre-computation). Generated tables are valid by construction (the tests check it);
``ScheduleTable.validate`` and ``compile_schedule`` check any table, generated or not. The
separated layout's tables come from ``pipetune.plan.separated.interleave``.

Virtual stages and split backward (``list_scheduled``): TorchTitan's ``Interleaved1F1B`` (``V``
backbone chunks per rank) and zero-bubble tables (every backward split into ``I`` and ``W``, the
``W`` deferred into bubbles) come from one list scheduler rather than from closed-form rank
lists (Megatron's formulas assume ``m`` a multiple of the ranks; a plan's ``m`` is whatever the
packing gives).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from enum import StrEnum

import numpy as np

from pipetune.schedule.table import Action, ChunkStyle, Module, Op, Placement, ScheduleError, ScheduleTable
from pipetune.schedule.v_shaped import dual_pipe_v_rank_ops, zbv_rank_ops


def _check_order(order: Sequence[int]) -> list[int]:
    order = [int(x) for x in order]
    if sorted(order) != list(range(len(order))):
        raise ScheduleError(f"micro-batch order {order} is not a permutation of 0..{len(order) - 1}")
    if not order:
        raise ScheduleError("a schedule needs at least one micro-batch")
    return order


def _with_encoder(actions: list[Action], placement: Placement) -> list[Action]:
    """The co-located encoder's forward right before backbone chunk 0's forward of its micro-batch,
    its backward (trained) right after chunk 0's gradient action."""
    if not placement.encoder:
        return actions
    out = []
    for a in actions:
        first = a.chunk == 0 and not a.is_encoder
        if first and a.op is Op.FORWARD:
            out.append(Action(0, Op.FORWARD, a.unit, Module.ENCODER))
        out.append(a)
        if first and a.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and placement.encoder_trained:
            out.append(Action(0, Op.BACKWARD, a.unit, Module.ENCODER))
    return out


def _table(per_rank: list[list[Action]], m: int, placement: Placement, name: str, max_in_flight=None,
           split_backward: bool = False) -> ScheduleTable:
    return ScheduleTable(
        placement=placement,
        num_micro_batches=m,
        ranks=tuple(tuple(_with_encoder(acts, placement)) for acts in per_rank),
        sub_mb_parent=tuple(range(m)) if placement.encoder else (),
        max_in_flight=max_in_flight,
        name=name,
        split_backward=split_backward,
    )


def one_f_one_b(num_stages: int, order: Sequence[int], *, encoder: bool = False, encoder_trained: bool = False) -> ScheduleTable:
    """1F1B: stage s runs ``num_stages - s`` warm-up forwards, then alternates one backward and
    one forward, then drains the backwards (the order of torch's ``Schedule1F1B``)."""
    order = _check_order(order)
    m = len(order)
    per_stage = []
    for s in range(num_stages):
        warmup = min(m, num_stages - s)
        acts = [Action(s, Op.FORWARD, mb) for mb in order[:warmup]]
        for k in range(m):
            acts.append(Action(s, Op.BACKWARD, order[k]))
            if warmup + k < m:
                acts.append(Action(s, Op.FORWARD, order[warmup + k]))
        per_stage.append(acts)
    placement = Placement.colocated(num_stages, encoder=encoder, encoder_trained=encoder_trained)
    return _table(per_stage, m, placement, "1F1B", tuple(num_stages - s for s in range(num_stages)))


def gpipe(num_stages: int, order: Sequence[int], *, encoder: bool = False, encoder_trained: bool = False) -> ScheduleTable:
    """GPipe: every forward, then every backward, in the same micro-batch order."""
    order = _check_order(order)
    per_stage = [[Action(s, Op.FORWARD, mb) for mb in order] + [Action(s, Op.BACKWARD, mb) for mb in order] for s in range(num_stages)]
    placement = Placement.colocated(num_stages, encoder=encoder, encoder_trained=encoder_trained)
    return _table(per_stage, len(order), placement, "GPipe")


def serial(num_stages: int, order: Sequence[int], *, encoder: bool = False, encoder_trained: bool = False) -> ScheduleTable:
    """No pipelining: each micro-batch's forward and backward run on every stage before the next
    micro-batch starts, so no two ranks ever compute at once. The same actions as a pipelined
    table of the same micro-batches, without overlap: calibration times both to measure what
    ranks working at once cost each other (``pipetune.simulate.contention``); never a plan to
    train with."""
    order = _check_order(order)
    per_stage = [[Action(s, op, mb) for mb in order for op in (Op.FORWARD, Op.BACKWARD)] for s in range(num_stages)]
    placement = Placement.colocated(num_stages, encoder=encoder, encoder_trained=encoder_trained)
    return _table(per_stage, len(order), placement, "serial", (1,) * num_stages)


FWD, GRAD, WEIGHT = 0, 1, 2  # list_scheduled's actions: (op, chunk, chunk * m + unit), GRAD a B or an I
UNIT_TIME = {Op.FORWARD: 1, Op.BACKWARD: 2, Op.BACKWARD_INPUT: 1, Op.BACKWARD_WEIGHT: 1}


def activation_caps(num_ranks: int, chunks_per_rank: int, style: ChunkStyle = ChunkStyle.LOOP) -> tuple[int, ...]:
    """Warm-up forwards of each rank, which is also the number of chunk activations it holds at
    once: 1F1B's ``P - r``; with ``V >= 2`` chunks per rank, Megatron's interleaved warm-up plus
    one, ``(V - 1) P + 2 (P - r - 1) + 1``; V-shaped, ZB-V's ``2P`` on every rank (as many
    layers' activations as 1F1B's first rank: each chunk is half a rank's layers)."""
    P, V = num_ranks, chunks_per_rank
    if style is ChunkStyle.V and V > 1:
        return (2 * P,) * P
    return tuple(P - r if V == 1 else (V - 1) * P + 2 * (P - r - 1) + 1 for r in range(P))


def list_scheduled(num_ranks: int, chunks_per_rank: int, order: Sequence[int], *, split_backward: bool = False,
                   encoder: bool = False, encoder_trained: bool = False, caps: Sequence[int] | None = None,
                   times: Mapping[Op, np.ndarray] | None = None, p2p: np.ndarray | None = None,
                   lazy_weights_from: int | None = None, within: float = math.inf,
                   style: ChunkStyle = ChunkStyle.LOOP) -> ScheduleTable | None:
    """Interleaved 1F1B (``chunks_per_rank >= 2``), V-shaped (``style`` V) and zero-bubble
    (``split_backward``) tables.

    ``LOOP``: backbone chunk ``c`` sits on rank ``c mod P``. Each rank's forwards and backwards follow
    Megatron's interleaved order (micro-batches in rounds of ``P`` following ``order``; within a
    round, the rank's chunks ascending for forwards, descending for backwards) and its compute
    sequence is 1F1B's: ``activation_caps(P, V)[r]`` warm-up forwards, then one backward and one
    forward in turn, then the remaining backwards. Megatron's sequence needs whole rounds, so a
    short last round is padded with phantom micro-batches whose actions are then left out (a
    runnable sequence stays runnable without whole micro-batches). ``V`` (two chunks per rank,
    ``Placement.v_shaped``): each rank's forwards and gradient actions follow torch's ZB-V order
    (``v_shaped.zbv_rank_ops`` without its ``W``). With ``split_backward`` each
    backward is its ``I``, and the ``W`` actions are placed by a run of the sequences: a rank runs
    its oldest deferred ``W`` when its next action is not ready yet (a bubble) or is a forward
    while the rank holds ``caps[r]`` micro-batches' activations, and the rest at the end. The run
    takes unit times (``UNIT_TIME``: F 1, B 2, I 1, W 1; messages free) unless given ``times``
    (per op of the table, ``[units, chunks]`` seconds; the co-located encoder's actions count in
    their chunk-0 forward and gradient action) and ``p2p`` (``[units]``: a message between ranks):
    the planner passes a batch's latencies so that ``W`` fill the bubbles that batch has. The run
    is event-driven (a rank is looked at only when it frees up or an input reaches it) over
    actions numbered by op, chunk and unit: the planner builds such tables in its search.
    ``caps`` defaults to the largest of 1F1B's caps on every rank: ZB-H1's rule (no rank holds
    more than 1F1B's first rank; later ranks defer their ``W`` into the drain's bubbles).
    ``lazy_weights_from``: ranks from this one on leave their bubbles empty and run a ``W`` only
    when their activations are capped, or after their last ``F`` and ``I``. With few micro-batches
    the ranks late in the pipeline finish their input gradients early, and a ``W`` filling one of
    their bubbles delays the next input gradient, which every earlier rank is waiting for (an
    exact solver's tables for such batches do this).
    ``within``: None as soon as an action of the run ends at or after it. With ``times`` and
    ``p2p`` the run is the table's own timing (each action starts when its rank is free and its
    inputs are there), so a caller keeping the table only if it beats a plan of ``within`` seconds
    is spared building and timing a table that cannot (the simulator's contention and jitter only
    add time).
    ``ScheduleError`` when the sequence cannot run (no rank able to proceed).
    """
    order = _check_order(order)
    m, P, V = len(order), num_ranks, chunks_per_rank
    S = P * V
    placement = Placement.virtual(P, V, style, encoder=encoder, encoder_trained=encoder_trained)
    rank_of = placement.backbone
    warmups = activation_caps(P, V, style)
    caps = tuple(caps) if caps is not None else (max(warmups),) * P if split_backward else warmups
    ops = (Op.FORWARD, Op.BACKWARD_INPUT if split_backward else Op.BACKWARD, Op.BACKWARD_WEIGHT)[:2 + split_backward]
    seqs = [deque((FWD if a.op is Op.FORWARD else GRAD, a.chunk, a.chunk * m + order[a.unit])
                  for a in zbv_rank_ops(P, r, m) if a.op is not Op.BACKWARD_WEIGHT)
            for r in range(P)] if style is ChunkStyle.V else _loop_sequences(P, V, order, warmups, caps)
    took = [np.broadcast_to(np.asarray(times[op], float) if times is not None else float(UNIT_TIME[op]), (m, S)).T.ravel().tolist()
            for op in ops]
    # message delays by receiving action: F(c) from chunk c - 1, a gradient of chunk c from c + 1 (none on one rank)
    cross = np.array(rank_of[:-1]) != np.array(rank_of[1:])
    hops = np.broadcast_to(np.asarray(p2p, float), (S, m)) if p2p is not None else np.zeros((S, m))
    fhop = (hops * np.concatenate([[False], cross])[:, None]).ravel().tolist()
    ghop = (hops * np.concatenate([cross, [False]])[:, None]).ravel().tolist()
    ends = [[math.inf] * (S * m), [math.inf] * (S * m)]  # F and G (B or I); a W feeds nothing the run waits on

    def ready_at(op: int, c: int, k: int) -> float:
        if op == FWD:
            return ends[FWD][k - m] + fhop[k] if c > 0 else 0.0
        at = ends[FWD][k]
        return max(at, ends[GRAD][k + m] + ghop[k]) if c < S - 1 else at

    lists: list[list[tuple[int, int, int]]] = [[] for _ in range(P)]
    weights: list[deque[tuple[int, int, int]]] = [deque() for _ in range(P)]
    free_at, live = [0.0] * P, [0] * P
    left = sum(len(q) + split_backward * sum(op == GRAD for op, _, _ in q) for q in seqs)  # every action, and a W per I
    lazy_from = P if lazy_weights_from is None else lazy_weights_from
    wake = [(0.0, r) for r in range(P)]  # (time, rank): when a rank frees up or an input reaches it
    while left:
        if not wake:
            stuck = ", ".join(f"rank {r} at {Action(c, ops[op], k - c * m)}" for r in range(P) if seqs[r] for op, c, k in [seqs[r][0]])
            raise ScheduleError(f"the {P} x {V} interleaved sequence of {m} micro-batches cannot run ({stuck})")
        t, r = heapq.heappop(wake)
        if free_at[r] > t:
            continue
        seq = seqs[r]
        capped = bool(seq) and seq[0][0] == FWD and live[r] >= caps[r]
        if seq and ready_at(*seq[0]) <= t and not (weights[r] and capped):
            a = seq.popleft()
            if a[0] == FWD:
                live[r] += 1
            elif split_backward:
                weights[r].append((WEIGHT, a[1], a[2]))
            else:
                live[r] -= 1
        elif weights[r] and (r < lazy_from or capped or not seq):
            a = weights[r].popleft()
            live[r] -= 1
        else:
            continue
        op, c, k = a
        lists[r].append(a)
        free_at[r] = end = t + took[op][k]
        if end >= within:
            return None
        heapq.heappush(wake, (end, r))
        if op == FWD:
            ends[FWD][k] = end
            if c < S - 1:
                heapq.heappush(wake, (end + fhop[k + m], rank_of[c + 1]))
        elif op == GRAD:
            ends[GRAD][k] = end
            if c > 0:
                heapq.heappush(wake, (end + ghop[k - m], rank_of[c - 1]))
        left -= 1
    per_rank = [[Action(c, ops[op], k - c * m) for op, c, k in acts] for acts in lists]
    name = ("V" if style is ChunkStyle.V else "Interleaved" if V > 1 else "") + ("ZB" if split_backward else "1F1B")
    return _table(per_rank, m, placement, name, caps, split_backward)


def _loop_sequences(P: int, V: int, order: list[int], warmups: tuple[int, ...], caps: tuple[int, ...]) -> list[deque]:
    """``list_scheduled``'s per-rank forward and gradient sequences on a loop placement (its doc)."""
    m, S = len(order), P * V
    padded = order + list(range(m, -(-m // P) * P))
    rounds = [padded[i:i + P] for i in range(0, len(padded), P)]
    seqs = []
    for r in range(P):
        own = range(r, S, P)
        fwd = [(FWD, c, j) for g in rounds for c in own for j in g]
        bwd = [(GRAD, c, j) for g in rounds for c in reversed(own) for j in g]
        warm = min(len(fwd), warmups[r], caps[r])
        steady = [x for k in range(len(fwd) - warm) for x in (bwd[k], fwd[warm + k])]
        seqs.append(deque((op, c, c * m + j) for op, c, j in fwd[:warm] + steady + bwd[len(fwd) - warm:] if j < m))
    return seqs


def zbv_zero_bubble(num_ranks: int, order: Sequence[int], *, encoder: bool = False, encoder_trained: bool = False) -> ScheduleTable:
    """torch's ``ScheduleZBVZeroBubble`` table (``v_shaped.zbv_rank_ops``) over ``order``: what a
    TorchTitan job with that schedule runs, every step."""
    return _v_table(zbv_rank_ops, "ZBVZeroBubble", num_ranks, order, encoder, encoder_trained)


def dual_pipe_v(num_ranks: int, order: Sequence[int], *, encoder: bool = False, encoder_trained: bool = False) -> ScheduleTable:
    """torch's ``ScheduleDualPipeV`` table over ``order``, its overlapped forward-and-backward
    actions run one after the other (``v_shaped`` module doc)."""
    return _v_table(dual_pipe_v_rank_ops, "DualPipeV", num_ranks, order, encoder, encoder_trained)


def torch_v_tables(num_ranks: int, order: Sequence[int], *, encoder: bool = False, encoder_trained: bool = False) -> list[ScheduleTable]:
    """torch's V-shaped tables over ``order``: ZB-V's, and DualPipeV's where it takes that many micro-batches."""
    tables = [zbv_zero_bubble(num_ranks, order, encoder=encoder, encoder_trained=encoder_trained)]
    if len(order) >= 2 * num_ranks:
        tables.append(dual_pipe_v(num_ranks, order, encoder=encoder, encoder_trained=encoder_trained))
    return tables


def _v_table(rank_ops, name: str, P: int, order: Sequence[int], encoder: bool, encoder_trained: bool) -> ScheduleTable:
    order = _check_order(order)
    placement = Placement.v_shaped(P, encoder=encoder, encoder_trained=encoder_trained)
    per_rank = [[Action(a.chunk, a.op, order[a.unit]) for a in rank_ops(P, r, len(order))] for r in range(P)]
    return _table(per_rank, len(order), placement, name, split_backward=True).validate()


class Schedule(StrEnum):
    """The co-located generators by the name configs and the command line use for them."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"
    SERIAL = "serial"

    def build(self, num_stages: int, order: Sequence[int], *, encoder: bool = False, encoder_trained: bool = False,
              chunks_per_rank: int = 1, split_backward: bool = False, style: ChunkStyle = ChunkStyle.LOOP) -> ScheduleTable:
        """``num_stages`` backbone chunks; with ``chunks_per_rank`` V > 1 (1F1B only) on
        ``num_stages / V`` ranks, in ``style``; ``split_backward`` (1F1B only): zero-bubble."""
        if chunks_per_rank > 1 or split_backward:
            if self is not Schedule.ONE_F_ONE_B:
                raise ScheduleError(f"virtual stages and split backward come with 1F1B tables, not {self.value}")
            if num_stages % chunks_per_rank:
                raise ScheduleError(f"{num_stages} backbone chunks do not split into {chunks_per_rank} per rank")
            return list_scheduled(num_stages // chunks_per_rank, chunks_per_rank, order, split_backward=split_backward,
                                  encoder=encoder, encoder_trained=encoder_trained, style=style)
        generator = {Schedule.ONE_F_ONE_B: one_f_one_b, Schedule.GPIPE: gpipe, Schedule.SERIAL: serial}[self]
        return generator(num_stages, order, encoder=encoder, encoder_trained=encoder_trained)


def in_order(table: ScheduleTable, order: Sequence[int]) -> ScheduleTable:
    """A co-located table built over positions (unit ``k``: the ``k``-th micro-batch to enter,
    and its images) with position ``k`` given to micro-batch ``order[k]``: the generators' table
    for ``order`` from their table for ``range(m)``, and the same for a table the planner built
    over positions (a valid table stays valid: the dependencies are per unit)."""
    order = _check_order(order)
    if len(order) != table.num_micro_batches or (table.encoder and table.sub_mb_parent != tuple(range(len(order)))):
        raise ScheduleError(f"in_order needs a co-located table of {len(order)} micro-batches with one encoder unit per micro-batch")
    return replace(table, ranks=tuple(tuple(Action(a.chunk, a.op, order[a.unit], a.module) for a in r) for r in table.ranks))


def place_encoders(table: ScheduleTable, before: dict[int, int], *, validate: bool = True) -> ScheduleTable:
    """Pre-compute encoders (co-located layout): ``before[k] = i`` runs ``E0F{k}`` before the
    i-th compute action of its rank that is not an encoder forward (it must still precede ``0F`` of its
    micro-batch); the others stay right before that forward. Encoders moved to the same action run
    in forward order, ahead of that action's own encoder. ``validate=False`` leaves the check of
    the result to the caller (the planner's plans are validated before they run)."""
    p = table.placement
    if not p.encoder:
        raise ScheduleError("this schedule has no encoder actions to place")
    if not p.colocated_encoder:
        raise ScheduleError("encoder pre-computation moves encoder forwards on the rank of backbone chunk 0; "
                            "this placement spreads the encoder over chunks of its own")
    rank = p.encoder[0]
    is_enc_fwd = lambda a: a.is_encoder and a.op is Op.FORWARD  # noqa: E731
    rest = [a for a in table.ranks[rank] if not is_enc_fwd(a)]
    work = [a for a in rest if not a.op.is_copy]  # positions count compute actions (the simulator's nodes)
    slots: list[list[Action]] = [[] for _ in range(len(work) + 1)]
    fwd_pos = {a.unit: k for k, a in enumerate(work) if a.chunk == 0 and a.op is Op.FORWARD and not a.is_encoder}
    sub_pos = {k: fwd_pos[j] for k, j in enumerate(table.sub_mb_parent)}
    for sub, k in sorted(sub_pos.items(), key=lambda kv: kv[1]):
        target = before.get(sub, k)
        if not 0 <= target <= k:
            raise ScheduleError(f"encoder of sub-microbatch {sub} must run before its forward (position {k}), not at {target}")
        slots[target].append(Action(0, Op.FORWARD, sub, Module.ENCODER))
    for k in range(len(work)):  # moved encoders first, the slot's own ones just before their forward
        slots[k].sort(key=lambda e: sub_pos[e.unit] == k)
    ranks, out, k = list(table.ranks), [], 0
    for a in rest:  # a copy stays where it was among the compute actions
        if not a.op.is_copy:
            out += slots[k]
            k += 1
        out.append(a)
    ranks[rank] = tuple(out)
    placed = replace(table, ranks=tuple(ranks))
    return placed.validate() if validate else placed


def onto_ranks(table: ScheduleTable, rank_of: tuple[int, ...]) -> ScheduleTable:
    """A table's actions moved from each rank ``r`` onto rank ``rank_of[r]`` (e.g. every rank onto
    rank 0: a whole pipeline, interleaved, split or separated, in one process): each new rank takes,
    in turns, the next action of its old ranks whose inputs are done (old ranks in index order)."""
    P = table.num_ranks
    if len(rank_of) != P:
        raise ScheduleError(f"onto_ranks: {len(rank_of)} new ranks given for a table of {P} ranks")
    old = table.placement
    placement = Placement(tuple(rank_of[r] for r in old.backbone), tuple(rank_of[r] for r in old.encoder), old.encoder_trained)
    pos, done = [0] * P, set()
    ranks: list[list[Action]] = [[] for _ in range(placement.num_ranks)]
    while any(pos[r] < len(table.ranks[r]) for r in range(P)):
        before = sum(pos)
        for new in range(len(ranks)):
            for r in (r for r in range(P) if rank_of[r] == new):
                if pos[r] < len(table.ranks[r]) and set(table.producers(table.ranks[r][pos[r]])) <= done:
                    ranks[new].append(table.ranks[r][pos[r]])
                    done.add(table.ranks[r][pos[r]])
                    pos[r] += 1
                    break
        if sum(pos) == before:
            raise ScheduleError(f"this schedule cannot run with its ranks moved onto ranks {list(rank_of)}: no rank can proceed")
    return replace(table, placement=placement, ranks=tuple(map(tuple, ranks)), max_in_flight=None).validate()
