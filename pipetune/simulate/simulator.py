"""Time a compiled schedule: start/end of every action, makespan, idle time and memory per rank.

Model: each rank runs its actions one at a time in table order; an action starts when its rank is
free and its inputs have arrived (a message across ranks costs its ``*p2p`` time, by what it
carries, and sends do not occupy the sender). Floating actions (a co-located encoder's forwards)
run back to back on their rank just before the node they are attached to. Memory per rank follows
the rank's own action order, so it does not depend on timing: every buffer of the compiled
schedule (activations until their backward, image features until backbone chunk 0's backward) is
added at its allocating node, the peak taken, and freed buffers removed. A table with activation
offload is the exception: its copies run beside the compute (``pipetune.simulate.dag``), so its
memory is counted by time (``_peak_memory_timed``).

Everything is vectorised over ``C`` candidates (the last axis of the internal arrays), so the
planner times thousands of orders and pre-compute placements per call; one candidate (most of the
planner's calls) takes a node-by-node pass over plain floats with the same arithmetic.
``simulate`` is the one-candidate case with per-action detail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pipetune.schedule.lowering import MessageKind
from pipetune.schedule.table import Action, Buffer, Module, Op, ScheduleTable
from pipetune.simulate.contention import concurrent_time, overlaps
from pipetune.simulate.dag import COPY_KINDS, KINDS, MESSAGE_KINDS, CompiledSchedule, compile_schedule

CHUNK = 512  # candidates per pass: [nodes x CHUNK] arrays stay in cache


@dataclass(frozen=True)
class Latencies:
    """Seconds and bytes per unit (rows) and chunk (columns).

    Backbone, per micro-batch ``[m, S]`` (``p2p``: one activation message, ``[m]``); encoder, per
    sub-microbatch and encoder chunk ``[n, E]`` (a vector is one chunk; ``encoder_bwd`` zero when
    frozen; ``encoder_p2p``: one message between encoder chunks; ``feature_p2p``: one
    sub-microbatch's image features to backbone chunk 0; ``image_feature_bytes``: those features
    held there). Left out, encoder arrays are zeros with one chunk and ``n = m``, and ``p2p`` and
    ``activation_bytes`` zeros. ``bwd_input``: the input-gradient part of ``bwd`` (``[m, S]``),
    what a split backward's ``I`` action takes (``W`` takes the rest); left out, half of ``bwd``
    (a stage of matmuls: both gradients cost one forward each). ``weight_grad_bytes`` (``[m, S]``):
    what a split backward holds from ``I`` to ``W`` (zeros when left out). ``contention``: the slow-down of work while another rank is busy
    (``pipetune.simulate.contention``); every makespan adds it times the concurrent time. ``copy``
    (``[m, S]``): one way of a chunk's activations between device and host, what an offload and a
    reload each take (left out: infinite, no host link to offload over).
    """

    fwd: np.ndarray
    bwd: np.ndarray
    encoder: np.ndarray | None = None
    p2p: np.ndarray | None = None
    activation_bytes: np.ndarray | None = None
    image_feature_bytes: np.ndarray | None = None
    encoder_bwd: np.ndarray | None = field(default=None, kw_only=True)
    encoder_p2p: np.ndarray | None = field(default=None, kw_only=True)
    feature_p2p: np.ndarray | None = field(default=None, kw_only=True)
    encoder_activation_bytes: np.ndarray | None = field(default=None, kw_only=True)
    bwd_input: np.ndarray | None = field(default=None, kw_only=True)
    weight_grad_bytes: np.ndarray | None = field(default=None, kw_only=True)
    contention: float = field(default=0.0, kw_only=True)
    copy: np.ndarray | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        m = self.fwd.shape[0]
        n = len(self.encoder) if self.encoder is not None else m
        enc = np.zeros((n, 1)) if self.encoder is None else np.asarray(self.encoder, np.float64)
        enc = enc[:, None] if enc.ndim == 1 else enc
        shapes = {"encoder": enc.shape, "p2p": (m,), "activation_bytes": self.fwd.shape, "image_feature_bytes": (n,),
                  "encoder_bwd": enc.shape, "encoder_p2p": (n,), "feature_p2p": (n,), "encoder_activation_bytes": enc.shape,
                  "weight_grad_bytes": self.fwd.shape, "copy": self.fwd.shape}
        for name, shape in shapes.items():
            given = getattr(self, name)
            missing = np.full(shape, np.inf) if name == "copy" else np.zeros(shape)
            object.__setattr__(self, name, missing if given is None else np.asarray(given, np.float64).reshape(shape))
        bwd_input = 0.5 * np.asarray(self.bwd, np.float64) if self.bwd_input is None else np.asarray(self.bwd_input, np.float64)
        if bwd_input.shape != self.fwd.shape or (bwd_input > self.bwd + 1e-12).any() or (bwd_input < 0).any():
            raise ValueError(f"bwd_input must be [m, S] = {self.fwd.shape} and between 0 and bwd")
        object.__setattr__(self, "bwd_input", bwd_input)

    @classmethod
    def from_costs(cls, costs) -> "Latencies":
        """From ``pipetune.cost.StageCosts``."""
        return cls(costs.fwd, costs.bwd, costs.encoder, costs.p2p, costs.activation_bytes, costs.image_feature_bytes,
                   encoder_bwd=costs.encoder_bwd, encoder_p2p=costs.encoder_p2p, feature_p2p=costs.feature_p2p,
                   encoder_activation_bytes=costs.encoder_activation_bytes, bwd_input=costs.bwd_input,
                   weight_grad_bytes=costs.weight_grad_bytes,
                   contention=costs.contention, copy=costs.copy)

    @classmethod
    def uniform(cls, m: int, S: int, t_f: float, t_b: float, *, t_e: float = 0.0, p2p: float = 0.0) -> "Latencies":
        return cls(np.full((m, S), t_f), np.full((m, S), t_b), np.full(m, t_e), np.full(m, p2p))

    @property
    def num_sub_micro_batches(self) -> int:
        return self.encoder.shape[0]


def _per_node(slots: np.ndarray, values: np.ndarray, N: int) -> np.ndarray:
    """``[N, C]`` sums of ``values[c, k]`` over the ``k`` with ``slots[c, k] == n`` (-1: nowhere)."""
    C = slots.shape[0]
    has = slots >= 0
    flat = (slots * C + np.arange(C)[:, None])[has]
    return np.bincount(flat, weights=values[has], minlength=N * C).reshape(N, C)


@dataclass(frozen=True)
class _Gathered:
    """One block of candidates' numbers, laid out for the DAG: durations ``[N, C]``, message costs
    ``[messages, C]``, floating-action durations and buffer bytes ``[C, *]``."""

    dur: np.ndarray
    comm: np.ndarray
    float_dur: np.ndarray
    buf_bytes: np.ndarray


def durations(lat: Latencies, module: Module, op: Op) -> np.ndarray:
    """Seconds of ``module``'s ``op`` actions, ``[units, chunks]``."""
    if module is Module.ENCODER:
        return lat.encoder if op is Op.FORWARD else lat.encoder_bwd
    return {Op.FORWARD: lat.fwd, Op.BACKWARD: lat.bwd, Op.BACKWARD_INPUT: lat.bwd_input, Op.BACKWARD_WEIGHT: lat.bwd - lat.bwd_input,
            Op.OFFLOAD: lat.copy, Op.RELOAD: lat.copy}[op]


def split_times(lat: Latencies, order: np.ndarray, *, encoder: bool, encoder_trained: bool) -> dict[Op, np.ndarray]:
    """Seconds of a co-located split table's backbone ``F``, ``I`` and ``W`` actions, ``[units,
    chunks]`` with unit ``k`` micro-batch ``order[k]``; the encoder's actions, which run right
    beside chunk 0's, count in its ``F`` and (trained) its ``I``: what ``list_scheduled`` takes as
    ``times`` to time a batch's table as the simulator does."""
    times = {op: durations(lat, Module.BACKBONE, op)[order] for op in (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)}
    if encoder:
        times[Op.FORWARD][:, 0] += durations(lat, Module.ENCODER, Op.FORWARD).sum(axis=1)[order]
        if encoder_trained:
            times[Op.BACKWARD_INPUT][:, 0] += durations(lat, Module.ENCODER, Op.BACKWARD).sum(axis=1)[order]
    return times


def message_costs(lat: Latencies, kind: MessageKind) -> np.ndarray:
    """Seconds of one message of ``kind`` per unit (see ``Message.unit``)."""
    return {MessageKind.ACTIVATION: lat.p2p, MessageKind.ENCODER_ACTIVATION: lat.encoder_p2p, MessageKind.FEATURES: lat.feature_p2p}[kind]


def buffer_bytes(lat: Latencies, kind: Buffer) -> np.ndarray:
    """Bytes of one buffer of ``kind`` per unit (``[units, chunks]``; image features ``[units]``)."""
    return {Buffer.ACTIVATION: lat.activation_bytes, Buffer.ENCODER_ACTIVATION: lat.encoder_activation_bytes,
            Buffer.FEATURES: lat.image_feature_bytes, Buffer.WEIGHT_GRAD: lat.weight_grad_bytes}[kind]


def _gather(dag: CompiledSchedule, lat: Latencies, orders: np.ndarray) -> _Gathered:
    """``orders[c, k]``: the micro-batch in slot ``k`` (and, for one-to-one encoder units, the
    sub-microbatch in slot ``k``)."""
    C = len(orders)
    subs = orders if dag.one_to_one else np.broadcast_to(np.arange(lat.num_sub_micro_batches), (C, lat.num_sub_micro_batches))
    by_kind = [durations(lat, module, op) for module, op in KINDS]
    perm = [subs if module is Module.ENCODER else orders for module, _ in KINDS]
    dur = np.empty((dag.num_nodes, C))
    for k in range(len(KINDS)):
        idx = np.flatnonzero(dag.kind == k)
        if len(idx):
            dur[idx] = by_kind[k][perm[k][:, dag.unit[idx]], dag.chunk[idx]].T
    comm = np.empty((len(dag.msg_kind), C))
    for k, kind in enumerate(MESSAGE_KINDS):
        idx = np.flatnonzero(dag.msg_kind == k)
        if len(idx):
            comm[idx] = message_costs(lat, kind)[(orders if kind is MessageKind.ACTIVATION else subs)[:, dag.msg_unit[idx]]].T
    float_dur = np.empty((C, len(dag.floating)))
    f_kind, f_chunk, f_unit = dag.float_arrays
    for k in np.unique(f_kind).tolist():
        idx = np.flatnonzero(f_kind == k)
        float_dur[:, idx] = by_kind[k][perm[k][:, f_unit[idx]], f_chunk[idx]]
    buf_bytes = np.empty((C, len(dag.buf_kind)))
    for kind in Buffer:
        idx = np.flatnonzero(dag.buf_kind == kind.value)
        if len(idx):
            arr, p = buffer_bytes(lat, kind), (orders if kind in (Buffer.ACTIVATION, Buffer.WEIGHT_GRAD) else subs)
            buf_bytes[:, idx] = arr[p[:, dag.buf_unit[idx]], dag.buf_chunk[idx]] if arr.ndim == 2 else arr[p[:, dag.buf_unit[idx]]]
    return _Gathered(dur, comm, float_dur, buf_bytes)


def _run(dag: CompiledSchedule, g: _Gathered, slots: np.ndarray):
    """Core pass, one vectorised step per wave of nodes (``CompiledSchedule.waves``);
    ``slots[c, f]``: node before which floating action ``f`` runs.
    Returns start, end, pre (floating work) as ``[N, C]``."""
    N, C = g.dur.shape
    pre = _per_node(slots, g.float_dur, N)
    w = dag.waves
    cost = np.vstack([pre[w.order], g.comm, np.zeros((1, C))])[w.cost]  # every input's cost, in wave order
    dur = g.dur[w.order]
    if C == 1:
        start, end = _run_one(w, cost[:, 0].tolist(), dur[:, 0].tolist())
        return start[w.inverse, None], end[w.inverse, None], pre
    start = np.empty((N, C))
    end = np.zeros((N + 1, C))  # row N: "no node", ends at 0
    e = 0
    for lo, hi, k in zip(w.bounds[:-1].tolist(), w.bounds[1:].tolist(), w.rows.tolist()):
        n = (hi - lo) * k
        t = (end[w.src[e:e + n]] + cost[e:e + n]).reshape(k, hi - lo, C).max(axis=0)
        start[lo:hi] = t
        end[lo:hi] = t + dur[lo:hi]
        e += n
    return start[w.inverse], end[w.inverse], pre


def _run_one(w, cost: list[float], dur: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """``_run``'s pass for one candidate, node by node over plain floats (the same sums and maxima,
    so the same times): with nothing to vectorise over, numpy's per-wave calls cost more than the
    arithmetic. Start and end ``[N]`` in wave order."""
    src = w.src.tolist()
    N = len(dur)
    start, end = [0.0] * N, [0.0] * (N + 1)  # end[N]: "no node", ends at 0
    e = 0
    for lo, hi, k in zip(w.bounds[:-1].tolist(), w.bounds[1:].tolist(), w.rows.tolist()):
        size = hi - lo
        for i in range(lo, hi):
            t = end[src[e]] + cost[e]
            for j in range(e + size, e + k * size, size):
                x = end[src[j]] + cost[j]
                if x > t:
                    t = x
            start[i] = t
            end[i] = t + dur[i]
            e += 1
        e += (k - 1) * size
    return np.array(start), np.array(end[:N])


def _busy(dag: CompiledSchedule, start: np.ndarray, end: np.ndarray, pre: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every busy interval of compute, ``[2N, C]`` starts and ends: each node, and the floating work
    before it (run from the end of its rank's previous node); copies count as empty."""
    prev = dag.rank_prev
    free = np.where((prev >= 0)[:, None], end[np.maximum(prev, 0)], 0.0)
    if dag.has_copies:
        end = np.where(np.isin(dag.kind, COPY_KINDS)[:, None], start, end)
    return np.concatenate([start, free]), np.concatenate([end, free + pre])


def _makespan(dag: CompiledSchedule, start: np.ndarray, end: np.ndarray, pre: np.ndarray, contention: float) -> np.ndarray:
    """``[C]``: the last end, plus ``contention`` times the concurrent time."""
    span = end.max(axis=0)
    return span + contention * concurrent_time(*_busy(dag, start, end, pre)) if contention else span


def _peak_memory(dag: CompiledSchedule, g: _Gathered, slots: np.ndarray, times: tuple[np.ndarray, ...] | None = None) -> np.ndarray:
    """Peak bytes per rank ``[C, R]``; a table with copies needs its ``times`` (``_run``'s start,
    end and pre) and is counted by them (``_peak_memory_timed``)."""
    if dag.has_copies:
        return _peak_memory_timed(dag, g, slots, *times)
    C = g.buf_bytes.shape[0]
    fixed, freed = dag.buffer_matrices
    alloc = fixed @ g.buf_bytes.T
    moving = np.flatnonzero(dag.buf_float >= 0)
    if len(moving):
        alloc += _per_node(slots[:, dag.buf_float[moving]], g.buf_bytes[:, moving], dag.num_nodes)
    free = freed @ g.buf_bytes.T
    peaks = np.zeros((C, len(dag.rank_nodes)))
    for r, nodes in enumerate(dag.rank_nodes):
        if len(nodes):  # held after each node, plus that node's own allocation: the peak is at an allocation
            a, f = alloc[nodes], free[nodes]
            peaks[:, r] = np.maximum((np.cumsum(a - f, axis=0) + f).max(axis=0), 0.0)
    return peaks


def _buffer_times(dag: CompiledSchedule, slots: np.ndarray, start: np.ndarray, end: np.ndarray, pre: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """When each buffer is taken (its allocating node starts, or its floating work, when allocated
    there; a reload's at its issue point, where the runtime allocates it) and given back (its
    freeing node ends), ``[B, C]`` each."""
    taken = start[dag.buf_alloc].copy()
    reloads = np.flatnonzero(dag.kind[dag.buf_alloc] == COPY_KINDS[1])
    if len(reloads):
        issued = dag.issue_node[dag.buf_alloc[reloads]]
        taken[reloads] = np.where((issued >= 0)[:, None], end[np.maximum(issued, 0)], 0.0)
    moving = np.flatnonzero(dag.buf_float >= 0)
    if len(moving):
        slot = slots[:, dag.buf_float[moving]].T  # [b, C]: the node each candidate runs that floating action before
        taken[moving] = np.take_along_axis(start, slot, 0) - np.take_along_axis(pre, slot, 0)
    return taken, end[dag.buf_free]


def _peak_memory_timed(dag: CompiledSchedule, g: _Gathered, slots: np.ndarray, start: np.ndarray, end: np.ndarray,
                       pre: np.ndarray) -> np.ndarray:
    """Peak bytes per rank ``[C, R]`` by time (``_buffer_times``); at one instant returns come
    first. Without copies this is the list-order count (tests check it)."""
    C = g.buf_bytes.shape[0]
    taken, given = _buffer_times(dag, slots, start, end, pre)
    size = g.buf_bytes.T
    owner = dag.rank[dag.buf_free]
    peaks = np.zeros((C, len(dag.rank_nodes)))
    for r in range(len(dag.rank_nodes)):
        mine = np.flatnonzero(owner == r)
        if len(mine):
            t = np.concatenate([taken[mine], given[mine]])
            d = np.concatenate([size[mine], -size[mine]])
            order = np.lexsort((d, t), axis=0)
            peaks[:, r] = np.maximum(np.take_along_axis(d, order, 0).cumsum(axis=0).max(axis=0), 0.0)
    return peaks


def _check_shapes(dag: CompiledSchedule, lat: Latencies) -> None:
    t = dag.table
    m, S = lat.fwd.shape
    n, E = lat.encoder.shape
    if m != t.num_micro_batches or S != t.num_stages or (t.encoder and (n != t.num_sub_micro_batches or E != len(t.placement.encoder))):
        raise ValueError(f"latencies are for {m} micro-batches x {S} backbone chunks and {n} sub-microbatches x {E} encoder chunks; "
                         f"the schedule has {t.num_micro_batches} x {t.num_stages} and {t.num_sub_micro_batches} x "
                         f"{len(t.placement.encoder)}")


def _orders(dag: CompiledSchedule, orders) -> np.ndarray:
    orders = np.atleast_2d(np.asarray(orders, dtype=np.int64))
    if not dag.one_to_one and len(orders) and (orders != np.arange(orders.shape[1])).any():
        raise ValueError("micro-batch orders permute sub-microbatches only when each is one micro-batch's images "
                         "(the co-located layout); compile a table per order instead")
    return orders


def timelines(dag: CompiledSchedule, lat: Latencies, orders: np.ndarray, float_slots: np.ndarray) -> tuple[np.ndarray, ...]:
    """Start, end and floating work before every node, ``[N, C]`` each, for ``C`` candidates."""
    o = _orders(dag, orders)
    return _run(dag, _gather(dag, lat, o), np.atleast_2d(float_slots))


@dataclass(frozen=True)
class MemoryTimeline:
    """One candidate's node times ``[N]`` and its buffers' bytes, owner rank and times ``[B]``."""

    start: np.ndarray
    end: np.ndarray
    size: np.ndarray
    owner: np.ndarray
    taken: np.ndarray
    given: np.ndarray


def memory_timeline(dag: CompiledSchedule, lat: Latencies, order: np.ndarray, float_slots: np.ndarray | None = None) -> MemoryTimeline:
    """Node and buffer times of ``dag`` for one micro-batch ``order`` (``evaluate``'s arguments, one row)."""
    o = _orders(dag, order)
    slots = np.atleast_2d(dag.float_slot if float_slots is None else float_slots)
    g = _gather(dag, lat, o)
    start, end, pre = _run(dag, g, slots)
    taken, given = _buffer_times(dag, slots, start, end, pre)
    return MemoryTimeline(start[:, 0], end[:, 0], g.buf_bytes[0], dag.rank[dag.buf_free], taken[:, 0], given[:, 0])


@dataclass(frozen=True)
class BatchResult:
    makespan: np.ndarray
    peak_bytes: np.ndarray | None


def evaluate(
    dag: CompiledSchedule,
    lat: Latencies,
    orders: np.ndarray,
    float_slots: np.ndarray | None = None,
    *,
    memory: bool = False,
) -> BatchResult:
    """Makespan (and optionally peak memory per rank) of ``C`` candidates on one compiled schedule.

    ``dag`` must be compiled from a schedule in slot space (order ``0..m-1``). ``orders[c]`` puts
    micro-batch ``orders[c, k]`` into slot ``k`` (rows of ``lat``; in the co-located layout the
    encoder's sub-microbatch ``k`` moves with it); ``float_slots[c, f]`` is the node before which
    floating action ``f`` (``dag.floating``; co-located: slot ``f``'s encoder forward) runs
    (default: the schedule's own placement).
    """
    _check_shapes(dag, lat)
    orders = _orders(dag, orders)
    if float_slots is None:
        float_slots = np.broadcast_to(dag.float_slot, (len(orders), len(dag.float_slot)))
    spans, peaks = [], []
    for lo in range(0, len(orders), CHUNK):
        o, slots = orders[lo : lo + CHUNK], float_slots[lo : lo + CHUNK]
        g = _gather(dag, lat, o)
        times = _run(dag, g, slots)
        spans.append(_makespan(dag, *times, lat.contention))
        if memory:
            peaks.append(_peak_memory(dag, g, slots, times))
    return BatchResult(np.concatenate(spans), np.concatenate(peaks) if memory else None)


def makespans_over(dag: CompiledSchedule, lats: Sequence[Latencies], orders: np.ndarray, float_slots: np.ndarray | None = None) -> np.ndarray:
    """Makespan of ``C`` candidates under each of several latencies of one batch (e.g. jitter
    draws), ``[len(lats), C]``: every (latencies, candidate) pair shares the vectorised axis of one
    pass. Arguments as ``evaluate``'s."""
    for lat in lats:
        _check_shapes(dag, lat)
    if len({lat.contention for lat in lats}) > 1:
        raise ValueError("makespans_over: the latencies differ in contention; time them separately")
    orders = _orders(dag, orders)
    if float_slots is None:
        float_slots = np.broadcast_to(dag.float_slot, (len(orders), len(dag.float_slot)))
    K, block = len(lats), max(1, CHUNK // len(lats))
    out = []
    for lo in range(0, len(orders), block):
        o, slots = orders[lo : lo + block], float_slots[lo : lo + block]
        gs = [_gather(dag, lat, o) for lat in lats]
        g = _Gathered(np.hstack([x.dur for x in gs]), np.hstack([x.comm for x in gs]), np.vstack([x.float_dur for x in gs]),
                      np.vstack([x.buf_bytes for x in gs]))
        out.append(_makespan(dag, *_run(dag, g, np.vstack([slots] * K)), lats[0].contention).reshape(K, len(o)))
    return np.hstack(out)


@dataclass(frozen=True)
class TimedAction:
    rank: int
    action: Action
    start: float
    end: float
    precomputed: bool = False


@dataclass(frozen=True)
class SimResult:
    """One schedule, timed. ``bubble_ratio`` = idle time / (ranks x makespan). With contention
    (``Latencies.contention``), ``actions`` keep their uncontended times, ``contention_s`` is what
    the makespan adds for them, and each rank's busy time adds its share (its work's overlap with
    other ranks' times the contention)."""

    table: ScheduleTable
    actions: tuple[TimedAction, ...]
    makespan: float
    busy: np.ndarray
    idle: np.ndarray
    bubble_ratio: float
    peak_bytes: np.ndarray
    contention_s: float = 0.0

    def time_of(self, text: str) -> tuple[float, float]:
        a = Action.parse(text)
        for t in self.actions:
            if t.action == a:
                return t.start, t.end
        raise KeyError(text)


def simulate(table: ScheduleTable, lat: Latencies) -> SimResult:
    """Time ``table`` (units numbered as in ``lat``) with per-action detail."""
    dag = compile_schedule(table)
    _check_shapes(dag, lat)
    identity = np.arange(table.num_micro_batches)[None]
    g = _gather(dag, lat, identity)
    slots = dag.float_slot[None, :]
    start, end, pre = (x[:, 0] for x in _run(dag, g, slots))
    timed = [TimedAction(int(dag.rank[n]), dag.action(n), float(start[n]), float(end[n])) for n in range(dag.num_nodes)]
    index = {a: f for f, a in enumerate(dag.floating)}
    for r, acts in enumerate(table.ranks):  # floating actions: back to back before their slot, in table order
        waiting: list = []
        for a in acts:
            if a in index:
                waiting.append(a)
                continue
            if waiting:
                slot = int(dag.float_slot[index[waiting[0]]])
                prev = dag.rank_prev[slot]
                t = float(end[prev]) if prev >= 0 else 0.0
                for f in waiting:
                    d = float(g.float_dur[0, index[f]])
                    timed.append(TimedAction(r, f, t, t + d, precomputed=slot != dag.float_first_use[index[f]]))
                    t += d
                waiting = []
    busy = np.array([float((end[nodes] - start[nodes]).sum() + pre[nodes].sum()) for nodes in dag.rank_nodes])
    extra = 0.0
    if lat.contention:
        shared, concurrent = overlaps(*_busy(dag, start[:, None], end[:, None], pre[:, None]))
        N = dag.num_nodes
        busy += lat.contention * np.array([shared[nodes, 0].sum() + shared[N + nodes, 0].sum() for nodes in dag.rank_nodes])
        extra = lat.contention * float(concurrent[0])
    makespan = float(end.max()) + extra
    idle = makespan - busy
    peaks = _peak_memory(dag, g, slots, (start[:, None], end[:, None], pre[:, None]))[0]
    return SimResult(
        table=table,
        actions=tuple(sorted(timed, key=lambda t: (t.rank, t.start, t.end))),
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_ratio=float(idle.sum() / (len(busy) * makespan)) if makespan > 0 else 0.0,
        peak_bytes=peaks,
        contention_s=extra,
    )
