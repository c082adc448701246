"""Time a compiled schedule: start/end of every action, makespan, idle time and memory per rank.

Model: each rank runs its actions one at a time in table order; an action starts when its rank is
free and its inputs have arrived (a message across ranks costs the micro-batch's ``p2p`` time,
and sends do not occupy the sender). Encoder forwards attached to a stage-0 node run back to back
on that rank just before it. Memory per rank follows the rank's own action order, so it does not
depend on timing: a forward holds its activations until its backward ends, and an encoder's image
features are held from the encoder until the backward of stage 0 (the projector keeps them).

Everything is vectorised over ``C`` candidates (the last axis of the internal arrays), so the
planner times thousands of orders and pre-compute placements per call; ``simulate`` is the
one-candidate case with per-action detail.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetune.schedule.table import Action, Op, ScheduleTable
from pipetune.simulate.dag import OP_F, CompiledSchedule, compile_schedule

CHUNK = 512  # candidates per pass: [nodes x CHUNK] arrays stay in cache


@dataclass(frozen=True)
class Latencies:
    """Per micro-batch (rows, as numbered in the schedule) and stage (columns), in seconds/bytes.

    ``encoder``/``image_feature_bytes`` may be zero when the model has no encoder.
    """

    fwd: np.ndarray
    bwd: np.ndarray
    encoder: np.ndarray
    p2p: np.ndarray
    activation_bytes: np.ndarray
    image_feature_bytes: np.ndarray

    @classmethod
    def from_costs(cls, costs) -> "Latencies":
        """From ``pipetune.cost.StageCosts``."""
        return cls(costs.fwd, costs.bwd, costs.encoder, costs.p2p, costs.activation_bytes, costs.image_feature_bytes)

    @classmethod
    def uniform(cls, m: int, S: int, t_f: float, t_b: float, *, t_e: float = 0.0, p2p: float = 0.0) -> "Latencies":
        return cls(np.full((m, S), t_f), np.full((m, S), t_b), np.full(m, t_e), np.full(m, p2p), np.zeros((m, S)), np.zeros(m))


def _per_node(slots: np.ndarray, values: np.ndarray, N: int) -> np.ndarray:
    """``[N, C]`` sums of ``values[c, k]`` over the ``k`` with ``slots[c, k] == n`` (-1: nowhere)."""
    C = slots.shape[0]
    has = slots >= 0
    flat = (slots * C + np.arange(C)[:, None])[has]
    return np.bincount(flat, weights=values[has], minlength=N * C).reshape(N, C)


def _run(dag: CompiledSchedule, fwd, bwd, p2p, enc, slots):
    """Core pass. Shapes: fwd/bwd ``[C, m, S]``, p2p/enc ``[C, m]``, slots ``[C, m]`` (node before
    which each encoder runs, -1 for none). Returns start, end, pre (encoder work) as ``[N, C]``."""
    C = fwd.shape[0]
    N = dag.num_nodes
    dur = np.ascontiguousarray(np.where(dag.op[None, :] == OP_F, fwd[:, dag.mb, dag.stage], bwd[:, dag.mb, dag.stage]).T)
    comm = np.ascontiguousarray(p2p[:, dag.mb].T)
    pre = _per_node(slots, enc, N)
    start = np.empty((N, C))
    end = np.empty((N, C))
    zero = np.zeros(C)
    prev = dag.rank_prev.tolist()
    deps = dag.dep.tolist()
    comms = dag.dep_comm.tolist()
    for n in range(N):
        t = (end[prev[n]] if prev[n] >= 0 else zero) + pre[n]
        for d, c in zip(deps[n], comms[n]):
            if d >= 0:
                t = np.maximum(t, end[d] + comm[n] if c else end[d])
        start[n] = t
        end[n] = t + dur[n]
    return start, end, pre


def _peak_memory(dag: CompiledSchedule, act, feat, slots) -> np.ndarray:
    """Peak bytes per rank ``[C, R]``: act ``[C, m, S]``, feat ``[C, m]``, slots ``[C, m]``."""
    C = act.shape[0]
    held_feat = _per_node(slots, feat, dag.num_nodes)
    node_act = np.ascontiguousarray(act[:, dag.mb, dag.stage].T)
    freed_feat = np.where((dag.stage == 0)[:, None] & (slots >= 0).T[dag.mb], feat.T[dag.mb], 0.0)
    peaks = np.zeros((C, len(dag.rank_nodes)))
    for r, nodes in enumerate(dag.rank_nodes):
        mem = np.zeros(C)
        peak = np.zeros(C)
        for n in nodes.tolist():
            mem = mem + held_feat[n]
            if dag.op[n] == OP_F:
                mem = mem + node_act[n]
                peak = np.maximum(peak, mem)
            else:
                peak = np.maximum(peak, mem)
                mem = mem - node_act[n] - freed_feat[n]
        peaks[:, r] = peak
    return peaks


def timelines(dag: CompiledSchedule, lat: Latencies, orders: np.ndarray, encoder_slots: np.ndarray) -> tuple[np.ndarray, ...]:
    """Start, end and encoder work before every node, ``[N, C]`` each, for ``C`` candidates."""
    o = np.atleast_2d(np.asarray(orders, dtype=np.int64))
    return _run(dag, lat.fwd[o], lat.bwd[o], lat.p2p[o], lat.encoder[o], np.atleast_2d(encoder_slots))


@dataclass(frozen=True)
class BatchResult:
    makespan: np.ndarray
    peak_bytes: np.ndarray | None


def evaluate(
    dag: CompiledSchedule,
    lat: Latencies,
    orders: np.ndarray,
    encoder_slots: np.ndarray | None = None,
    *,
    memory: bool = False,
) -> BatchResult:
    """Makespan (and optionally peak memory per rank) of ``C`` candidates on one compiled schedule.

    ``dag`` must be compiled from a schedule in slot space (order ``0..m-1``). ``orders[c]`` puts
    micro-batch ``orders[c, k]`` into slot ``k``; ``encoder_slots[c, k]`` is the node before which
    slot ``k``'s encoder runs (default: the schedule's own placement).
    """
    orders = np.atleast_2d(np.asarray(orders, dtype=np.int64))
    if encoder_slots is None:
        encoder_slots = np.broadcast_to(dag.encoder_slot, orders.shape)
    spans, peaks = [], []
    for lo in range(0, len(orders), CHUNK):
        o, slots = orders[lo : lo + CHUNK], encoder_slots[lo : lo + CHUNK]
        _, end, _ = _run(dag, lat.fwd[o], lat.bwd[o], lat.p2p[o], lat.encoder[o], slots)
        spans.append(end.max(axis=0))
        if memory:
            peaks.append(_peak_memory(dag, lat.activation_bytes[o], lat.image_feature_bytes[o], slots))
    return BatchResult(np.concatenate(spans), np.concatenate(peaks) if memory else None)


@dataclass(frozen=True)
class TimedAction:
    rank: int
    action: Action
    start: float
    end: float
    precomputed: bool = False


@dataclass(frozen=True)
class SimResult:
    """One schedule, timed. ``bubble_ratio`` = idle time / (ranks x makespan)."""

    table: ScheduleTable
    actions: tuple[TimedAction, ...]
    makespan: float
    busy: np.ndarray
    idle: np.ndarray
    bubble_ratio: float
    peak_bytes: np.ndarray

    def time_of(self, text: str) -> tuple[float, float]:
        a = Action.parse(text)
        for t in self.actions:
            if t.action == a:
                return t.start, t.end
        raise KeyError(text)


def simulate(table: ScheduleTable, lat: Latencies) -> SimResult:
    """Time ``table`` (micro-batches numbered as in ``lat``) with per-action detail."""
    dag = compile_schedule(table)
    m, S = lat.fwd.shape
    if m != table.num_micro_batches or S != table.num_stages:
        raise ValueError(f"latencies are for {m} micro-batches x {S} stages, the schedule has "
                         f"{table.num_micro_batches} x {table.num_stages}")
    slots = dag.encoder_slot[None, :]
    args = (lat.fwd[None], lat.bwd[None], lat.p2p[None], lat.encoder[None], slots)
    start, end, pre = _run(dag, *args)
    start, end, pre = start[:, 0], end[:, 0], pre[:, 0]
    timed = []
    for n in range(dag.num_nodes):
        op = Op.FORWARD if dag.op[n] == OP_F else Op.BACKWARD
        timed.append(TimedAction(int(dag.rank[n]), Action(int(dag.stage[n]), op, int(dag.mb[n])), float(start[n]), float(end[n])))
    if table.encoder:
        fwd_node = {int(dag.mb[n]): n for n in range(dag.num_nodes) if dag.op[n] == OP_F and dag.stage[n] == 0}
        for n in sorted(set(dag.encoder_slot.tolist()) - {-1}):
            prev = dag.rank_prev[n]
            t = float(end[prev]) if prev >= 0 else 0.0
            for mb in sorted(np.flatnonzero(dag.encoder_slot == n), key=lambda i: (fwd_node[i] == n, fwd_node[i])):
                e = float(lat.encoder[mb])
                timed.append(TimedAction(int(dag.rank[n]), Action(0, Op.ENCODER, int(mb)), t, t + e, precomputed=n != fwd_node[mb]))
                t += e
    makespan = float(end.max())
    busy = np.array([float((end[nodes] - start[nodes]).sum() + pre[nodes].sum()) for nodes in dag.rank_nodes])
    idle = makespan - busy
    peaks = _peak_memory(dag, lat.activation_bytes[None], lat.image_feature_bytes[None], slots)[0]
    return SimResult(
        table=table,
        actions=tuple(sorted(timed, key=lambda t: (t.rank, t.start, t.end))),
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_ratio=float(idle.sum() / (len(busy) * makespan)) if makespan > 0 else 0.0,
        peak_bytes=peaks,
    )
