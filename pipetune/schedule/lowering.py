"""Lowering pass: a schedule table's compute actions -> every rank's compute + communication steps.

The runtime's transport may ignore tags: NCCL runs the point-to-point operations between a pair of
ranks in the order they were posted, on both sides. So the lowering must give, for every pair of
ranks, the same sequence of messages on both sides (the k-th message one side posts to its peer is
the k-th the peer posts from it), with no circular wait; tags then only label messages.

This is torch.distributed.pipelining's ``_add_send_recv`` pass (``schedules.py``), re-implemented
because the planning core never imports torch, and extended with our encoder actions: all ranks'
compute actions are replayed in lockstep rounds (rank 0 first in each round); an action runs once
its input is there, and when it produces a message, its SEND goes into the sender's list and the
matching RECV into the receiver's list at that same moment. Every pair's messages are therefore
posted in one global order on both sides, and that order is a serial execution of the whole
plan, which is why no circular wait can arise, even with rendezvous sends. Receives are posted as
early as that order allows (the message then arrives while the rank computes) and waited on right
before the action that consumes them. We do not apply torch's ``_defer_recv_ops``: it moves a
higher rank's RECV after its SENDs to the same peer, which is safe only where sends are buffered,
and breaks the identical per-pair order. ``tests/test_lowering_fifo.py`` checks 1,000 random
plans on simulated in-order transports (one queue per pair, rendezvous sends, and one queue per
rank as NCCL runs batched point-to-point calls) and that this pass orders like torch's.

Adjacent posts (a send and receives placed between two compute actions) form one ``Post`` step,
which the executor issues as one ``batch_isend_irecv`` so that they are in flight together.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pipetune.schedule.table import Action, Op, ScheduleError, ScheduleTable


@dataclass(frozen=True)
class Message:
    """The activation (``op`` F) or gradient (``op`` B) that stage ``stage`` sends for micro-batch ``mb``."""

    op: Op
    stage: int
    mb: int

    @property
    def to_stage(self) -> int:
        return self.stage + 1 if self.op is Op.FORWARD else self.stage - 1

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.mb}->{self.to_stage}"


class Direction(Enum):
    SEND = "SEND"
    RECV = "RECV"


@dataclass(frozen=True)
class Transfer:
    """One half of a message: this rank sends it to, or receives it from, ``peer``."""

    direction: Direction
    message: Message
    peer: int

    def __str__(self) -> str:
        return f"{self.direction.value}({self.message}, peer {self.peer})"


@dataclass(frozen=True)
class Compute:
    """Run ``action`` (encoder, forward or backward)."""

    action: Action


@dataclass(frozen=True)
class Post:
    """Post these sends and receives together (non-blocking), in this order."""

    transfers: tuple[Transfer, ...]


@dataclass(frozen=True)
class Wait:
    """Block until the posted receive of ``message`` has completed."""

    message: Message


Step = Compute | Post | Wait


def lower_all(table: ScheduleTable) -> list[list[Step]]:
    """Every rank's lowered step list for ``table`` (validated first); raises ``ScheduleError``
    when the table cannot run at all (an action waits for one that never comes first)."""
    table.validate()
    n = table.num_ranks
    emitted: list[list[Action | Transfer]] = [[] for _ in range(n)]
    have: list[set] = [set() for _ in range(n)]  # actions done and messages posted for receipt, per rank
    pos = [0] * n
    while True:
        progress = False
        for r in range(n):
            if pos[r] == len(table.ranks[r]):
                continue
            a = table.ranks[r][pos[r]]
            need = _input(table, a)
            if need is not None and need not in have[r]:
                continue
            emitted[r].append(a)
            have[r].add(a)
            out = _output(table, a)
            if out is not None:
                dst = table.stage_rank[out.to_stage]
                emitted[r].append(Transfer(Direction.SEND, out, dst))
                emitted[dst].append(Transfer(Direction.RECV, out, r))
                have[dst].add(out)
            pos[r] += 1
            progress = True
        if not progress:
            break
    stuck = [f"rank {r} at {table.ranks[r][pos[r]]}" for r in range(n) if pos[r] < len(table.ranks[r])]
    if stuck:
        raise ScheduleError(f"schedule cannot run: no rank can proceed ({', '.join(stuck)}); each waits for an action that comes later")
    return [_steps(table, e) for e in emitted]


def lower(table: ScheduleTable, rank: int) -> list[Step]:
    """Rank ``rank``'s lowered step list (see ``lower_all``)."""
    return lower_all(table)[rank]


def _steps(table: ScheduleTable, emitted: list[Action | Transfer]) -> list[Step]:
    """Runs of transfers -> one ``Post`` each; a ``Wait`` before every action consuming a message."""
    out: list[Step] = []
    run: list[Transfer] = []
    for e in emitted:
        if isinstance(e, Transfer):
            run.append(e)
            continue
        if run:
            out.append(Post(tuple(run)))
            run = []
        need = _input(table, e)
        if isinstance(need, Message):
            out.append(Wait(need))
        out.append(Compute(e))
    if run:
        out.append(Post(tuple(run)))
    return out


def _input(table: ScheduleTable, a: Action) -> Message | Action | None:
    """What ``a`` consumes from another stage: a message from another rank, or the action of a
    stage on the same rank that hands it over locally."""
    if a.op is Op.FORWARD and a.stage > 0:
        src = a.stage - 1
    elif a.op is Op.BACKWARD and a.stage < table.num_stages - 1:
        src = a.stage + 1
    else:
        return None
    if table.stage_rank[src] == table.stage_rank[a.stage]:
        return Action(src, a.op, a.mb)
    return Message(a.op, src, a.mb)


def _output(table: ScheduleTable, a: Action) -> Message | None:
    """The message ``a`` sends to a stage on another rank, if any."""
    if a.op is Op.FORWARD and a.stage < table.num_stages - 1:
        dst = a.stage + 1
    elif a.op is Op.BACKWARD and a.stage > 0:
        dst = a.stage - 1
    else:
        return None
    return Message(a.op, a.stage, a.mb) if table.stage_rank[dst] != table.stage_rank[a.stage] else None
