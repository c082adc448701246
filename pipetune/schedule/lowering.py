"""Lowering pass: a schedule table's compute actions -> every rank's compute + communication steps.

The runtime's transport may ignore tags: NCCL runs the point-to-point operations between a pair of
ranks in the order they were posted, on both sides. So the lowering must give, for every pair of
ranks, the same sequence of messages on both sides (the k-th message one side posts to its peer is
the k-th the peer posts from it), with no circular wait; tags then only label messages.

This is torch.distributed.pipelining's ``_add_send_recv`` pass (``schedules.py``), re-implemented
because the planning core never imports torch, and extended to the chunk graph of
``pipetune.schedule.table`` (encoder chunks, sub-microbatches; an action may consume and produce
several messages, e.g. backbone chunk 0's forward takes the image features of every
sub-microbatch of its micro-batch): all ranks' compute actions are replayed in lockstep rounds
(rank 0 first in each round); an action runs once all its inputs are there, and for every message
it produces, its SEND goes into the sender's list and the matching RECV into the receiver's list
at that same moment. Every pair's messages are therefore posted in one global order on both
sides, and that order is a serial execution of the whole plan, which is why no circular wait can
arise, even with rendezvous sends. Receives are posted as early as that order allows (the message
then arrives while the rank computes) and waited on right before the action that consumes them.
We do not apply torch's ``_defer_recv_ops``: it moves a higher rank's RECV after its SENDs to the
same peer, which is safe only where sends are buffered, and breaks the identical per-pair order.
``tests/test_lowering_fifo.py`` checks 1,000 random plans on simulated in-order transports (one
queue per pair, rendezvous sends, and one queue per rank as NCCL runs batched point-to-point calls)
and that this pass orders like torch's.

Adjacent posts (sends and receives placed between two compute actions) form one ``Post`` step.
The runtime issues each of its transfers as its own operation, so that a ``Wait`` is not tied to
the other transfers of its ``Post``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from pipetune.schedule.table import Action, ScheduleError, ScheduleTable


class MessageKind(Enum):
    """What a message carries, which sets its size: backbone hidden states (tokens x dim), encoder
    hidden states between encoder chunks (images x patches x encoder dim), or image features
    from the last encoder chunk to backbone chunk 0 (images x tokens per image x merged dim).
    Gradients travel back with the size of the activations they belong to."""

    ACTIVATION = "activation"
    ENCODER_ACTIVATION = "encoder activation"
    FEATURES = "features"


class Message(NamedTuple):
    """The activations (``src`` a forward) or gradients (``src`` a backward) that ``src`` hands
    to ``dst`` on another rank."""

    src: Action
    dst: Action

    @property
    def kind(self) -> MessageKind:
        if self.src.module is not self.dst.module:
            return MessageKind.FEATURES
        return MessageKind.ENCODER_ACTIVATION if self.src.is_encoder else MessageKind.ACTIVATION

    @property
    def unit(self) -> int:
        """The unit whose data it carries: the sub-microbatch for image features (a backbone
        action exchanges one message per sub-microbatch of its micro-batch), else the sender's."""
        if self.kind is MessageKind.FEATURES:
            return self.dst.unit if self.dst.is_encoder else self.src.unit
        return self.src.unit

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}"


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
    """Run ``action``."""

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


def inputs(table: ScheduleTable, a: Action) -> list[Message | Action]:
    """What ``a`` consumes: messages from other ranks, and actions of its own rank that hand their
    output over locally."""
    rank = table.placement.rank_of(a)
    return [p if table.placement.rank_of(p) == rank else Message(p, a) for p in table.producers(a)]


def outputs(table: ScheduleTable, a: Action) -> list[Message]:
    """The messages ``a`` sends to actions on other ranks."""
    rank = table.placement.rank_of(a)
    return [Message(a, c) for c in table.consumers(a) if table.placement.rank_of(c) != rank]


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
            if any(need not in have[r] for need in inputs(table, a)):
                continue
            emitted[r].append(a)
            have[r].add(a)
            for out in outputs(table, a):
                dst = table.placement.rank_of(out.dst)
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
    """Runs of transfers -> one ``Post`` each; a ``Wait`` for every message an action consumes, before it."""
    out: list[Step] = []
    run: list[Transfer] = []
    for e in emitted:
        if isinstance(e, Transfer):
            run.append(e)
            continue
        if run:
            out.append(Post(tuple(run)))
            run = []
        out += [Wait(need) for need in inputs(table, e) if isinstance(need, Message)]
        out.append(Compute(e))
    if run:
        out.append(Post(tuple(run)))
    return out
