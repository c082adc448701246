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

Activation offload: a rank's copies (``O``, ``R``) run on a second *lane* of the rank, one after
another in table order, beside its compute lane. A copy also waits for the last node before it in
the table (its issue point: a floating action in between is not waited for, which the runtime,
issuing at the copy's place in the list, does; the planner's tables put moved encoder forwards
after the copies before their slot), and the gradient action waits for its reload; those inputs
across lanes are timed like messages of no cost. A table with copies frees and takes memory at
the copies' times, not in list order (``pipetune.simulate.simulator``).

Nodes are numbered in a topological order that respects every edge and each rank's order, so one
forward pass over node indices times the whole schedule (the simulator takes it a wave of
independent nodes at a time, ``CompiledSchedule.waves``). What does not depend on a table's rank
lists (dependencies, messages, buffers) is kept per shape, so the planner's many tables of one
layout compile by walking their rank lists only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np
from scipy.sparse import csr_matrix

from pipetune.schedule.lowering import Message, MessageKind
from pipetune.schedule.table import Action, Module, Op, Placement, ScheduleError, ScheduleTable

KINDS = ((Module.BACKBONE, Op.FORWARD), (Module.BACKBONE, Op.BACKWARD), (Module.ENCODER, Op.FORWARD), (Module.ENCODER, Op.BACKWARD),
         (Module.BACKBONE, Op.BACKWARD_INPUT), (Module.BACKBONE, Op.BACKWARD_WEIGHT), (Module.BACKBONE, Op.OFFLOAD),
         (Module.BACKBONE, Op.RELOAD))
KIND = {k: i for i, k in enumerate(KINDS)}
MESSAGE_KINDS = tuple(MessageKind)
COPY_KINDS = (KIND[(Module.BACKBONE, Op.OFFLOAD)], KIND[(Module.BACKBONE, Op.RELOAD)])
ACROSS_LANES = (-1, -1)
"""``_Shape.needs`` marker of an input from the rank's other lane (compute or copy): timed, free."""


def kind_of(a: Action) -> int:
    return KIND[(a.module, a.op)]


@dataclass(frozen=True)
class Waves:
    """A compiled schedule's nodes grouped by depth (a node's wave is one past the deepest of its
    producers and its rank's previous node), so the simulator times a whole wave in one vectorised
    step. A rank runs its nodes one after another, so a wave holds at most one node per rank.

    Node arrays are laid out in wave order (``order``: the node at each position; ``inverse``:
    back), wave ``w`` at positions ``bounds[w]:bounds[w + 1]``. A node starts at the latest of
    its inputs' end plus cost: its rank's previous node plus the floating work attached to it, and
    each producer on another rank plus its message (a producer on its own rank ends no later than
    the rank's previous node). Wave ``w`` lists ``rows[w]`` inputs per node in ``src`` (positions
    in wave order, ``N``: none, which ends at 0) and ``cost`` (rows of ``[floating work per
    position (N); message costs (M); zero]``), row-major ``[rows[w], wave size]``, waves one after
    another."""

    order: np.ndarray
    inverse: np.ndarray
    bounds: np.ndarray
    rows: np.ndarray
    src: np.ndarray
    cost: np.ndarray


@dataclass(frozen=True)
class CompiledSchedule:
    """Arrays over nodes (index = node id, topological order), messages, floating actions and buffers.

    ``kind``/``chunk``/``unit``/``rank``: what each node runs (``kind`` indexes ``KINDS``).
    ``edges[n]``: ``(producer node, message index, or -1 for a hand-over on the node's lane, or -2
    for one from the rank's other lane)`` pairs.
    ``msg_kind``/``msg_unit``: each message's ``MessageKind`` index and the unit sizing it.
    ``rank_prev``: previous node on the same rank and lane (-1 for a lane's first node);
    ``rank_nodes[r]``: rank ``r``'s compute nodes, ``copy_nodes[r]`` its copies; ``issue_node[n]``:
    the compute node a copy is issued after (-1: none, or not a copy).
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
    copy_nodes: tuple[np.ndarray, ...]
    issue_node: np.ndarray
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
    def has_copies(self) -> bool:
        return any(len(nodes) for nodes in self.copy_nodes)

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

    @cached_property
    def waves(self) -> "Waves":
        """The nodes grouped by depth, for the simulator's vectorised pass (see ``Waves``)."""
        N, M = self.num_nodes, len(self.msg_kind)
        prev = np.where(self.rank_prev >= 0, self.rank_prev, N).tolist()
        depth = [0] * N + [-1]
        nodes, cols, into, msg = [], [], [], []  # every cross-rank input: its node, column, producer and message
        for n, deps in enumerate(self.edges):  # plain lists: a walk over numpy scalars costs several times more
            deep, j = depth[prev[n]], 1
            for d, e in deps:
                if depth[d] > deep:
                    deep = depth[d]
                if e != -1:  # a producer on the same lane ends no later than the lane's previous node
                    nodes.append(n)
                    cols.append(j)
                    into.append(d)
                    msg.append(N + e if e >= 0 else N + M)  # from the other lane: no cost
                    j += 1
            depth[n] = deep + 1
        depth = np.array(depth, np.int64)
        D = 1 + max(cols, default=0)
        src = np.full((N, D), N, np.int64)  # per node: its rank's previous node, then producers on other ranks
        cost = np.full((N, D), N + M, np.int64)
        src[:, 0] = prev
        src[nodes, cols], cost[nodes, cols] = into, msg
        order = np.argsort(depth[:N], kind="stable")
        pos = np.append(np.argsort(order), N)
        src, cost = pos[src[order]], cost[order]
        cost[:, 0] = np.arange(N)  # the floating work before the node, by its position
        bounds = np.concatenate([[0], np.flatnonzero(np.diff(depth[order])) + 1, [N]])
        used = np.maximum.reduceat((src < N) * np.arange(1, D + 1), bounds[:-1], axis=0).max(axis=1)
        rows = np.maximum(used, 1)  # a wave's inputs sit in its first rows[w] columns
        wave = np.repeat(np.arange(len(rows)), np.diff(bounds))
        at, col = np.nonzero(np.arange(D)[None, :] < rows[wave][:, None])
        take = np.argsort((wave[at] * D + col) * N + at, kind="stable")  # per wave, column by column, as _run reads them
        at, col = at[take], col[take]
        return Waves(order, pos[:N], bounds, rows, src[at, col], cost[at, col])

    def rank_position(self) -> np.ndarray:
        """Position of each node within its rank's node list."""
        pos = np.empty(self.num_nodes, np.int64)
        for nodes in self.rank_nodes:
            pos[nodes] = np.arange(len(nodes))
        return pos

    def action(self, n: int) -> Action:
        module, op = KINDS[self.kind[n]]
        return Action(int(self.chunk[n]), op, int(self.unit[n]), module)


@dataclass(frozen=True)
class _Shape:
    """What a table's dependencies and memory are, which depends only on its placement, micro-batch
    count, sub-microbatches and backward split, not on its orders: kept per shape, so compiling a
    table the planner just generated walks only its rank lists. ``needs[a]``: ``a``'s producers
    that are nodes, each with its message (kind index, unit) or ``None`` on the same rank;
    ``floating``: the floating actions in the simulator's order; ``buffers``: as
    ``ScheduleTable.buffers``."""

    needs: dict[Action, tuple[tuple[Action, tuple[int, int] | None], ...]]
    floating: tuple[Action, ...]
    consumers: dict[Action, tuple[Action, ...]]
    buffers: tuple[tuple[int, int, int, Action, Action], ...]


@lru_cache(maxsize=64)
def _action_facts(placement: Placement, split_backward: bool, sub_mb_parent: tuple[int, ...] | None) -> dict:
    """Per action: whether it floats, its ``_Shape.needs`` and, if it floats, its consumers; filled
    in on demand. ``sub_mb_parent`` None: one sub-microbatch per micro-batch (or no encoder), where
    an action's facts do not depend on the micro-batch count, so one map serves every count."""
    return {}


@lru_cache(maxsize=64)
def _shape(placement: Placement, num_micro_batches: int, sub_mb_parent: tuple[int, ...], split_backward: bool) -> _Shape:
    t = ScheduleTable(placement, num_micro_batches, ((),) * placement.num_ranks, sub_mb_parent, split_backward=split_backward)
    one_to_one = not placement.encoder or sub_mb_parent == tuple(range(num_micro_batches))
    facts = _action_facts(placement, split_backward, None if one_to_one else sub_mb_parent)
    rank_of = {Module.BACKBONE: placement.backbone, Module.ENCODER: placement.encoder}

    def message(d: Action, a: Action) -> tuple[int, int] | None:
        if rank_of[d.module][d.chunk] == rank_of[a.module][a.chunk]:
            return None
        msg = Message(d, a)
        return MESSAGE_KINDS.index(msg.kind), msg.unit

    floats = {}

    def floating(a: Action) -> bool:
        if a not in floats:
            floats[a] = facts[a][0] if a in facts else t.floats(a)
        return floats[a]

    actions = t.expected_actions()
    for a in actions:
        if a not in facts:
            fl = floating(a)
            facts[a] = (fl, () if fl else tuple((d, message(d, a)) for d in t.producers(a) if not floating(d)), t.consumers(a) if fl else ())
    moving = sorted((a for a in actions if facts[a][0]), key=lambda a: (a.module != Module.ENCODER, a.chunk, a.unit))
    buffers = tuple((kind.value, c, u, alloc, free) for kind, c, u, alloc, free in t.buffers())
    return _Shape({a: facts[a][1] for a in actions if not facts[a][0]}, tuple(moving), {f: facts[f][2] for f in moving}, buffers)


def compile_schedule(table: ScheduleTable, *, validate: bool = True) -> CompiledSchedule:
    """Validate ``table`` and order its non-floating actions topologically (``ScheduleError`` on
    deadlock). ``validate=False`` skips the full check for a table a generator just built (valid
    by construction, which the generators' tests check): the planner's hot path."""
    if validate:
        table.validate()
    shape = _shape(table.placement, table.num_micro_batches, table.sub_mb_parent, table.split_backward)
    floating = shape.floating
    is_float = set(floating)
    work = [[a for a in acts if a not in is_float] for acts in table.ranks]
    done: dict[Action, int] = {}
    ptr = [0] * len(work)
    order: list[Action] = []
    order_rank: list[int] = []
    needs, issue = _with_copies(shape.needs, table, work) if table.offloaded else (shape.needs, {})
    while True:
        progressed = False
        for r, acts in enumerate(work):
            k = ptr[r]
            while k < len(acts):
                a = acts[k]
                for d, _ in needs[a]:
                    if d not in done:
                        break
                else:
                    done[a] = len(order)
                    order.append(a)
                    order_rank.append(r)
                    k += 1
                    continue
                break
            progressed |= k > ptr[r]
            ptr[r] = k
        if all(q == len(a) for q, a in zip(ptr, work)):
            break
        if not progressed:
            stuck = ", ".join(f"rank {r} at {work[r][ptr[r]]}" for r in range(len(work)) if ptr[r] < len(work[r]))
            raise ScheduleError(f"schedule deadlocks: {stuck}")
    msg_kind, msg_unit, edges = [], [], []
    for a in order:
        mine = []
        for d, msg in needs[a]:
            if msg is None:
                mine.append((done[d], -1))
            elif msg is ACROSS_LANES:
                mine.append((done[d], -2))
            else:
                mine.append((done[d], len(msg_kind)))
                msg_kind.append(msg[0])
                msg_unit.append(msg[1])
        edges.append(tuple(mine))
    issue_node = np.full(len(order), -1, np.int64)
    for a, at_node in issue.items():
        issue_node[done[a]] = done[at_node]
    rank_nodes = tuple(np.array([done[a] for a in acts if not a.op.is_copy], np.int64) for acts in work)
    copy_nodes = tuple(np.array([done[a] for a in acts if a.op.is_copy], np.int64) for acts in work)
    rank_prev = np.full(len(order), -1, np.int64)
    for nodes in (*rank_nodes, *copy_nodes):
        rank_prev[nodes[1:]] = nodes[:-1]
    slot_of: dict[Action, int] = {}
    for acts in table.ranks:
        pending = []
        for a in acts:
            if a in is_float:
                pending.append(a)
            elif pending and not a.op.is_copy:
                slot_of.update((f, done[a]) for f in pending)
                pending = []
        if pending:
            raise ScheduleError(f"{pending[0]} runs after every action that consumes it")
    float_slot = np.array([slot_of[f] for f in floating], np.int64)
    float_first_use = np.array([min(done[c] for c in shape.consumers[f]) for f in floating], np.int64)
    float_index = {f: i for i, f in enumerate(floating)}
    at = lambda a: (slot_of[a], float_index[a]) if a in float_index else (done[a], -1)  # noqa: E731
    buffers = tuple((kind.value, c, u, alloc, free) for kind, c, u, alloc, free in table.buffers()) if table.offloaded else shape.buffers
    bufs = np.array([(kind, c, u, *at(alloc), done[free]) for kind, c, u, alloc, free in buffers], np.int64).reshape(-1, 6)
    return CompiledSchedule(
        table=table,
        kind=np.array([KIND[(a.module, a.op)] for a in order], np.int8),
        chunk=np.array([a.chunk for a in order], np.int64),
        unit=np.array([a.unit for a in order], np.int64),
        rank=np.array(order_rank, np.int64),
        edges=tuple(edges),
        msg_kind=np.array(msg_kind, np.int8),
        msg_unit=np.array(msg_unit, np.int64),
        rank_prev=rank_prev,
        rank_nodes=rank_nodes,
        copy_nodes=copy_nodes,
        issue_node=issue_node,
        floating=floating,
        float_slot=float_slot,
        float_first_use=float_first_use,
        buf_kind=bufs[:, 0],
        buf_chunk=bufs[:, 1],
        buf_unit=bufs[:, 2],
        buf_alloc=bufs[:, 3],
        buf_float=bufs[:, 4],
        buf_free=bufs[:, 5],
        one_to_one=not table.encoder or table.sub_mb_parent == tuple(range(table.num_micro_batches)),
    )


def _with_copies(needs: dict, table: ScheduleTable, work: list[list[Action]]) -> tuple[dict, dict[Action, Action]]:
    """``needs`` of a table with copies: each copy its data input and its issue point (the last
    compute node before it in its rank's list), each reloaded gradient action its reload; and
    each copy's issue point."""
    needs, issued = dict(needs), {}
    grad = table.grad_op(Module.BACKBONE)
    for acts in work:
        issue = None
        for a in acts:
            if not a.op.is_copy:
                issue = a
                continue
            c, u = a.chunk, a.unit
            data = (Action(c, Op.FORWARD, u), ACROSS_LANES) if a.op is Op.OFFLOAD else (Action(c, Op.OFFLOAD, u), None)
            needs[a] = (data,) + (((issue, ACROSS_LANES),) if issue is not None and issue != data[0] else ())
            if issue is not None:
                issued[a] = issue
            if a.op is Op.RELOAD:
                g = Action(c, grad, u)
                needs[g] = (*needs[g], (a, ACROSS_LANES))
    return needs, issued
