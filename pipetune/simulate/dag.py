"""A schedule table compiled into a DAG (PipeTune App. A.5, generalised to chunks of modality modules).

Nodes are the table's actions, except *floating* ones (``ScheduleTable.floats``: no input, outputs
used on their own rank only, such as a co-located encoder's forward). A floating action is
attached, as extra work, to the next node of its rank (its *slot*), which is how pre-computation is
expressed without changing the DAG's shape: many placements are evaluated on one compiled DAG.

Edges: a rank runs its nodes in table order; every node waits for its (non-floating) producers
(``ScheduleTable.producers``), plus a message when the producer sits on another rank. Memory is a
list of buffers, each allocated at one node (or a floating action's slot) and freed at another,
all on one rank: a forward's saved activations until its backward; image features on the rank of
backbone chunk 0 from the encoder forward that makes them there (or from backbone chunk 0's forward
that receives them) until backbone chunk 0's backward.

Nodes are numbered in a topological order that respects every edge and each rank's order, so one
forward pass over node indices times the whole schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from scipy.sparse import csr_matrix

from pipetune.schedule.lowering import Message, MessageKind
from pipetune.schedule.table import Action, Module, Op, ScheduleError, ScheduleTable

KINDS = ((Module.BACKBONE, Op.FORWARD), (Module.BACKBONE, Op.BACKWARD), (Module.ENCODER, Op.FORWARD), (Module.ENCODER, Op.BACKWARD),
         (Module.BACKBONE, Op.BACKWARD_INPUT), (Module.BACKBONE, Op.BACKWARD_WEIGHT))
KIND = {k: i for i, k in enumerate(KINDS)}
MESSAGE_KINDS = tuple(MessageKind)


def kind_of(a: Action) -> int:
    return KIND[(a.module, a.op)]


@dataclass(frozen=True)
class CompiledSchedule:
    """Arrays over nodes (index = node id, topological order), messages, floating actions and buffers.

    ``kind``/``chunk``/``unit``/``rank``: what each node runs (``kind`` indexes ``KINDS``).
    ``edges[n]``: ``(producer node, message index or -1 for a same-rank hand-over)`` pairs.
    ``msg_kind``/``msg_unit``: each message's ``MessageKind`` index and the unit sizing it.
    ``rank_prev``: previous node on the same rank (-1 for a rank's first node).
    ``floating``: the floating actions (by module, chunk, unit); ``float_slot[f]``: the node
    before which the table runs floating action ``f``; ``float_first_use[f]``: its first consumer.
    ``buf_*``: memory buffers; ``buf_float[b] >= 0`` means allocated at that floating action's slot.
    ``one_to_one``: no encoder, or sub-microbatch ``k`` is micro-batch ``k``'s images, so a micro-batch order
    permutes both kinds of units (see ``pipetune.simulate.simulator.evaluate``).
    """

    table: ScheduleTable
    kind: np.ndarray
    chunk: np.ndarray
    unit: np.ndarray
    rank: np.ndarray
    edges: tuple[tuple[tuple[int, int], ...], ...]
    msg_kind: np.ndarray
    msg_unit: np.ndarray
    rank_prev: np.ndarray
    rank_nodes: tuple[np.ndarray, ...]
    floating: tuple[Action, ...]
    float_slot: np.ndarray
    float_first_use: np.ndarray
    buf_kind: np.ndarray
    buf_chunk: np.ndarray
    buf_unit: np.ndarray
    buf_alloc: np.ndarray
    buf_float: np.ndarray
    buf_free: np.ndarray
    one_to_one: bool

    @property
    def num_nodes(self) -> int:
        return len(self.kind)

    @cached_property
    def float_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Kind, chunk and unit of every floating action."""
        return (np.array([kind_of(a) for a in self.floating], np.int64), np.array([a.chunk for a in self.floating], np.int64),
                np.array([a.unit for a in self.floating], np.int64))

    @cached_property
    def buffer_matrices(self) -> tuple[csr_matrix, csr_matrix]:
        """``[nodes, buffers]`` 0/1 matrices: which node allocates each buffer that is not
        allocated at a floating action's slot, and which node frees each buffer."""
        shape = (self.num_nodes, len(self.buf_kind))
        fixed = np.flatnonzero(self.buf_float < 0)
        alloc = csr_matrix((np.ones(len(fixed)), (self.buf_alloc[fixed], fixed)), shape=shape)
        free = csr_matrix((np.ones(len(self.buf_free)), (self.buf_free, np.arange(len(self.buf_free)))), shape=shape)
        return alloc, free

    def rank_position(self) -> np.ndarray:
        """Position of each node within its rank's node list."""
        pos = np.empty(self.num_nodes, np.int64)
        for nodes in self.rank_nodes:
            pos[nodes] = np.arange(len(nodes))
        return pos

    def action(self, n: int) -> Action:
        module, op = KINDS[self.kind[n]]
        return Action(int(self.chunk[n]), op, int(self.unit[n]), module)


def compile_schedule(table: ScheduleTable, *, validate: bool = True) -> CompiledSchedule:
    """Validate ``table`` and order its non-floating actions topologically (``ScheduleError`` on
    deadlock). ``validate=False`` skips the full check for a table a generator just built (valid
    by construction, which the generators' tests check): the planner's hot path."""
    if validate:
        table.validate()
    p = table.placement
    floating = sorted({a for acts in table.ranks for a in acts if table.floats(a)}, key=lambda a: (a.module != Module.ENCODER, a.chunk, a.unit))
    is_float = set(floating)
    work = [[a for a in acts if a not in is_float] for acts in table.ranks]
    done: dict[Action, int] = {}
    ptr = [0] * len(work)
    order: list[tuple[Action, int, list[Action]]] = []
    needs: dict[Action, list[Action]] = {}  # a rank's next action is asked again on every sweep until it is ready
    while True:
        progressed = False
        for r, acts in enumerate(work):
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                if a not in needs:
                    needs[a] = [q for q in table.producers(a) if q not in is_float]
                deps = needs[a]
                if any(d not in done for d in deps):
                    break
                done[a] = len(order)
                order.append((a, r, deps))
                ptr[r] += 1
                progressed = True
        if all(q == len(a) for q, a in zip(ptr, work)):
            break
        if not progressed:
            stuck = ", ".join(f"rank {r} at {work[r][ptr[r]]}" for r in range(len(work)) if ptr[r] < len(work[r]))
            raise ScheduleError(f"schedule deadlocks: {stuck}")
    msg_kind, msg_unit, edges = [], [], []
    for a, r, deps in order:
        mine = []
        for d in deps:
            if p.rank_of(d) == r:
                mine.append((done[d], -1))
            else:
                msg = Message(d, a)
                mine.append((done[d], len(msg_kind)))
                msg_kind.append(MESSAGE_KINDS.index(msg.kind))
                msg_unit.append(msg.unit)
        edges.append(tuple(mine))
    rank_nodes = tuple(np.array([done[a] for a in acts], np.int64) for acts in work)
    rank_prev = np.full(len(order), -1, np.int64)
    for nodes in rank_nodes:
        rank_prev[nodes[1:]] = nodes[:-1]
    slot_of: dict[Action, int] = {}
    for acts in table.ranks:
        pending = []
        for a in acts:
            if a in is_float:
                pending.append(a)
            else:
                slot_of.update((f, done[a]) for f in pending)
                pending = []
        if pending:
            raise ScheduleError(f"{pending[0]} runs after every action that consumes it")
    float_slot = np.array([slot_of[f] for f in floating], np.int64)
    float_first_use = np.array([min(done[c] for c in table.consumers(f)) for f in floating], np.int64)
    bufs = _buffers(table, done, slot_of, {f: i for i, f in enumerate(floating)})
    arr = lambda xs, k: np.array([x[k] for x in xs], np.int64)  # noqa: E731
    return CompiledSchedule(
        table=table,
        kind=np.array([kind_of(a) for a, _, _ in order], np.int8),
        chunk=np.array([a.chunk for a, _, _ in order], np.int64),
        unit=np.array([a.unit for a, _, _ in order], np.int64),
        rank=np.array([r for _, r, _ in order], np.int64),
        edges=tuple(edges),
        msg_kind=np.array(msg_kind, np.int8),
        msg_unit=np.array(msg_unit, np.int64),
        rank_prev=rank_prev,
        rank_nodes=rank_nodes,
        floating=tuple(floating),
        float_slot=float_slot,
        float_first_use=float_first_use,
        buf_kind=arr(bufs, 0),
        buf_chunk=arr(bufs, 1),
        buf_unit=arr(bufs, 2),
        buf_alloc=arr(bufs, 3),
        buf_float=arr(bufs, 4),
        buf_free=arr(bufs, 5),
        one_to_one=not table.encoder or table.sub_mb_parent == tuple(range(table.num_micro_batches)),
    )


def _buffers(table: ScheduleTable, node: dict, slot_of: dict, float_index: dict) -> list[tuple[int, int, int, int, int, int]]:
    """``(kind, chunk, unit, alloc node, floating index or -1, free node)`` of every memory buffer."""

    def at(a: Action) -> tuple[int, int]:
        return (slot_of[a], float_index[a]) if a in float_index else (node[a], -1)

    return [(kind.value, c, u, *at(alloc), node[free]) for kind, c, u, alloc, free in table.buffers()]
