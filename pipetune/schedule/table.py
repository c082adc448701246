"""Pipeline schedules as tables: for every rank, its ordered list of compute actions on model chunks.

A model is a chain of modality modules (``Module``): the vision encoder feeds the backbone. Each
module is cut into *chunks*, contiguous layer ranges numbered along the module (encoder chunk ``k``
feeds encoder chunk ``k + 1``; the last encoder chunk feeds backbone chunk 0, which holds the
embeddings and the projector; the last backbone chunk holds the head and the loss). A
``Placement`` puts every chunk on a rank, so a rank may hold several chunks of either module.

Work comes in *units*: the backbone's are the iteration's micro-batches ``0..m-1``; the encoder's
are image sub-microbatches ``0..n-1``, each holding images of exactly one micro-batch
(``ScheduleTable.sub_mb_parent``). An action is ``(chunk, F|B, unit)``. Its inputs:

* ``F(c, u)`` needs ``F(c-1, u)`` of its module; backbone ``F(0, j)`` needs the last encoder
  chunk's ``F`` of every sub-microbatch of ``j``; encoder ``F(0, k)`` needs nothing (pixels come
  with the batch every rank holds);
* ``B(c, u)`` needs ``F(c, u)`` (its saved activations) and ``B(c+1, u)``; the last encoder
  chunk's ``B(k)`` needs backbone ``B(0, parent(k))`` (the gradient of the image features).

A frozen encoder has no ``B`` actions. An input produced on another rank is a message.

Activation offload (OptPipe's): a backbone ``(chunk, unit)`` may have an ``O`` (copy its saved
activations to host memory; needs ``F``) and an ``R`` (copy them back; needs ``O``), and its
gradient action (``B`` or ``I``) then also needs ``R``. Copies run on the rank's copy engine,
beside its compute: each starts when its rank's list reaches it (the compute action before it has
ended) and the copy engine is free, copies run one at a time in list order, and device memory is
freed when an ``O`` ends and taken again when its rank's list reaches the ``R`` (``pipetune.simulate``).

Split backward (``ScheduleTable.split_backward``, zero-bubble schedules): every backbone ``B`` is
two actions, ``I(c, u)`` (input gradient: needs ``F(c, u)`` and ``I(c+1, u)``, feeds ``I(c-1, u)``)
and ``W(c, u)`` (weight gradient: needs ``I(c, u)``, feeds nothing). A chunk's saved activations
live until its ``W`` (torch's ``stage_backward_input`` keeps the autograd graph for
``stage_backward_weight``). Encoder chunks keep whole backwards.

Several backbone chunks may share a rank, in one of torch's two styles (``ChunkStyle``):
``Placement.interleaved`` (chunk ``c`` on rank ``c mod P``, TorchTitan's ``Interleaved1F1B`` stage
layout) or ``Placement.v_shaped`` (two chunks per rank, chunk ``c`` and ``2P - 1 - c`` on rank ``c``:
``ZBVZeroBubble`` and ``DualPipeV``; chunks ``P - 1`` and ``P`` share the last rank, so their
hand-over is no message, and the first and last chunks share rank 0, beside the encoder).

Layouts are placements: PipeTune's co-located layout is one encoder chunk on the rank of backbone
chunk 0 with backbone chunk ``s`` on rank ``s`` and sub-microbatch ``j`` = all images of
micro-batch ``j``; DIP's separated layout spreads ``P * K`` encoder chunks over ``P`` ranks and
splits each micro-batch's images into fixed-size sub-microbatches.

Text form: backbone actions keep torch.distributed.pipelining's ``_Action`` form (``1F3``: chunk 1
forward of micro-batch 3), so backbone-only tables load in torch (``to_csv``); encoder actions are
prefixed with ``E`` (``E0F3``: encoder chunk 0 forward of sub-microbatch 3); ``I`` and ``W`` are torch's letters. ``Action.parse`` reads
both. A table only orders work; latencies come from the cost model and times from the simulator.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import NamedTuple

ACTION_RE = re.compile(r"^(E?)(\d+)([FBIWOR])(\d+)$")


class Module(str, Enum):
    BACKBONE = ""
    ENCODER = "E"


class Op(str, Enum):
    """torch's ``_ComputationType`` letters: a full backward ``B``, or split into the input
    gradient ``I`` (what the previous chunk waits for) and the weight gradient ``W`` (which
    nothing waits for, so a schedule can defer it into a bubble: zero-bubble pipelining)."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    OFFLOAD = "O"
    RELOAD = "R"

    @property
    def is_backward(self) -> bool:
        return self in (Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)

    @property
    def is_copy(self) -> bool:
        """A host-device copy of saved activations (pipetune's, not torch's): runs beside compute."""
        return self in (Op.OFFLOAD, Op.RELOAD)


class ChunkStyle(Enum):
    """How virtual stages sit on ranks: torch's ``generate_stage_to_rank_mapping`` styles."""

    LOOP = "loop"
    V = "v"


class Buffer(Enum):
    """What a memory buffer holds (``ScheduleTable.buffers``), which sets its size."""

    ACTIVATION = 0
    ENCODER_ACTIVATION = 1
    FEATURES = 2
    WEIGHT_GRAD = 3


class Action(NamedTuple):
    """``op`` of ``module``'s chunk ``chunk`` on unit ``unit`` (micro-batch or sub-microbatch).
    A named tuple: schedules hash and compare thousands of them per plan."""

    chunk: int
    op: Op
    unit: int
    module: Module = Module.BACKBONE

    def __str__(self) -> str:
        return f"{self.module.value}{self.chunk}{self.op.value}{self.unit}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        m = ACTION_RE.match(text.strip()) if isinstance(text, str) else None
        if not m:
            raise ValueError(f"not an action: {text!r} (expected like 0F3, 1B0, 1I0 or 1W0 for the backbone, E0F2 or E3B1 for "
                             "encoder chunks)")
        return cls(int(m.group(2)), Op(m.group(3)), int(m.group(4)), Module(m.group(1)))

    @property
    def is_encoder(self) -> bool:
        return self.module is Module.ENCODER


class ScheduleError(ValueError):
    """A schedule table that cannot run; the message names the offending action."""


@dataclass(frozen=True)
class Placement:
    """The rank of every chunk: ``backbone[c]`` and ``encoder[c]`` (empty without an encoder).
    ``encoder_trained``: the encoder is trained, so its chunks have backward actions."""

    backbone: tuple[int, ...]
    encoder: tuple[int, ...] = ()
    encoder_trained: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "backbone", tuple(int(r) for r in self.backbone))
        object.__setattr__(self, "encoder", tuple(int(r) for r in self.encoder))
        ranks = self.backbone + self.encoder
        if not self.backbone or min(ranks) < 0 or set(ranks) != set(range(max(ranks) + 1)):
            raise ScheduleError(f"placement {self}: chunks must sit on ranks 0..R-1, every rank holding at least one, "
                                "and there must be at least one backbone chunk")
        if self.encoder_trained and not self.encoder:
            raise ScheduleError("placement: a trained encoder needs encoder chunks")

    @classmethod
    def colocated(cls, num_stages: int, *, encoder: bool = False, encoder_trained: bool = False,
                  stage_rank: tuple[int, ...] | None = None) -> "Placement":
        """PipeTune's layout: backbone chunk ``s`` on ``stage_rank[s]`` (default rank ``s``) and the
        whole encoder as one chunk beside backbone chunk 0."""
        backbone = tuple(stage_rank) if stage_rank is not None else tuple(range(num_stages))
        return cls(backbone, (backbone[0],) if encoder else (), encoder_trained and encoder)

    @classmethod
    def separated(cls, num_ranks: int, encoder_chunks: int, *, encoder_trained: bool) -> "Placement":
        """DIP's layout: backbone chunk ``s`` on rank ``s``; encoder chunk ``k`` on rank ``k mod P``,
        so each of the encoder's ``encoder_chunks / P`` segments passes every rank once."""
        if encoder_chunks < 1 or encoder_chunks % num_ranks:
            raise ScheduleError(f"a separated layout needs a positive multiple of {num_ranks} encoder chunks, got {encoder_chunks}")
        return cls(tuple(range(num_ranks)), tuple(k % num_ranks for k in range(encoder_chunks)), encoder_trained)

    @classmethod
    def interleaved(cls, num_ranks: int, chunks_per_rank: int, *, encoder: bool = False, encoder_trained: bool = False) -> "Placement":
        """Virtual stages: ``num_ranks * chunks_per_rank`` backbone chunks, chunk ``c`` on rank
        ``c mod num_ranks`` (so every hand-over between chunks crosses ranks, and the loop comes
        back to rank 0), the whole encoder beside chunk 0."""
        if num_ranks < 1 or chunks_per_rank < 1:
            raise ScheduleError(f"an interleaved layout needs at least one rank and one chunk per rank, got {num_ranks} and {chunks_per_rank}")
        return cls.colocated(num_ranks * chunks_per_rank, encoder=encoder, encoder_trained=encoder_trained,
                             stage_rank=tuple(c % num_ranks for c in range(num_ranks * chunks_per_rank)))

    @classmethod
    def v_shaped(cls, num_ranks: int, *, encoder: bool = False, encoder_trained: bool = False) -> "Placement":
        """Two backbone chunks per rank in a V: chunk ``c < P`` on rank ``c``, chunk ``c >= P`` on
        rank ``2P - 1 - c`` (torch's "v" style), the whole encoder beside chunk 0 on rank 0, which
        so also holds the head and the loss."""
        if num_ranks < 1:
            raise ScheduleError(f"a V-shaped layout needs at least one rank, got {num_ranks}")
        return cls.colocated(2 * num_ranks, encoder=encoder, encoder_trained=encoder_trained,
                             stage_rank=(*range(num_ranks), *reversed(range(num_ranks))))

    @classmethod
    def virtual(cls, num_ranks: int, chunks_per_rank: int, style: ChunkStyle, *, encoder: bool = False,
                encoder_trained: bool = False) -> "Placement":
        """``chunks_per_rank`` backbone chunks per rank in ``style`` (V-shaped: exactly two)."""
        if style is ChunkStyle.V:
            if chunks_per_rank != 2:
                raise ScheduleError(f"a V-shaped layout holds two backbone chunks per rank, not {chunks_per_rank}")
            return cls.v_shaped(num_ranks, encoder=encoder, encoder_trained=encoder_trained)
        return cls.interleaved(num_ranks, chunks_per_rank, encoder=encoder, encoder_trained=encoder_trained)

    @property
    def num_ranks(self) -> int:
        return max(self.backbone + self.encoder) + 1

    @property
    def style(self) -> ChunkStyle:
        """``V`` when the backbone sits as ``v_shaped`` puts it on two or more ranks, else ``LOOP``."""
        P = self.num_ranks
        return ChunkStyle.V if P > 1 and self.backbone == (*range(P), *reversed(range(P))) else ChunkStyle.LOOP

    @property
    def chunks_per_rank(self) -> int:
        """Backbone chunks per rank (``V``; 1 without virtual stages); ``ScheduleError`` when ranks hold different numbers."""
        counts = {self.backbone.count(r) for r in range(self.num_ranks)}
        if len(counts) != 1:
            raise ScheduleError(f"placement {self}: ranks hold different numbers of backbone chunks")
        return counts.pop()

    @property
    def num_stages(self) -> int:
        """Backbone chunks."""
        return len(self.backbone)

    @property
    def colocated_encoder(self) -> bool:
        """One encoder chunk on the rank of backbone chunk 0 (PipeTune's layout)."""
        return len(self.encoder) == 1 and self.encoder[0] == self.backbone[0]

    def chunks(self, module: Module) -> tuple[int, ...]:
        return self.encoder if module is Module.ENCODER else self.backbone

    def rank_of(self, a: Action) -> int:
        return self.chunks(a.module)[a.chunk]


class Placed:
    """Shorthands for anything with a ``placement`` (schedule tables, iteration plans)."""

    placement: Placement

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    @property
    def stage_rank(self) -> tuple[int, ...]:
        """The rank of each backbone chunk (stage)."""
        return self.placement.backbone

    @property
    def encoder(self) -> bool:
        return bool(self.placement.encoder)

    @property
    def separated(self) -> bool:
        """The encoder runs in chunks of its own (DIP's layout), not beside backbone stage 0."""
        return self.encoder and not self.placement.colocated_encoder


@dataclass(frozen=True)
class ScheduleTable(Placed):
    """Per-rank ordered actions of ``placement``'s chunks over ``num_micro_batches`` micro-batches
    and ``len(sub_mb_parent)`` encoder sub-microbatches (``sub_mb_parent[k]``: the micro-batch
    whose images sub-microbatch ``k`` holds; empty without an encoder).

    ``max_in_flight[r]``, when set, bounds the backbone micro-batches whose activations rank ``r``
    holds (forwards minus the actions that free them: ``B``, or ``W`` with ``split_backward``) at
    any point of its list (1F1B's activation-memory guarantee: ``num_stages - r``).
    """

    placement: Placement
    num_micro_batches: int
    ranks: tuple[tuple[Action, ...], ...]
    sub_mb_parent: tuple[int, ...] = ()
    max_in_flight: tuple[int, ...] | None = None
    name: str = ""
    split_backward: bool = False

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_sub_micro_batches(self) -> int:
        return len(self.sub_mb_parent)

    @cached_property
    def sub_micro_batches(self) -> tuple[tuple[int, ...], ...]:
        """For each micro-batch, its sub-microbatches in order."""
        out: list[list[int]] = [[] for _ in range(self.num_micro_batches)]
        for k, j in enumerate(self.sub_mb_parent):
            if 0 <= j < self.num_micro_batches:
                out[j].append(k)
        return tuple(map(tuple, out))

    def units(self, module: Module) -> int:
        return self.num_sub_micro_batches if module is Module.ENCODER else self.num_micro_batches

    def grad_op(self, module: Module) -> Op:
        """The action that passes ``module``'s gradients back: ``I`` for split backbone backwards, else ``B``."""
        return Op.BACKWARD_INPUT if self.split_backward and module is Module.BACKBONE else Op.BACKWARD

    def release_op(self, module: Module) -> Op:
        """The action after which a chunk's saved activations are freed: ``W`` for split backbone backwards, else ``B``."""
        return Op.BACKWARD_WEIGHT if self.split_backward and module is Module.BACKBONE else Op.BACKWARD

    @cached_property
    def offloaded(self) -> frozenset[tuple[int, int]]:
        """The backbone ``(chunk, unit)`` pairs whose saved activations go to host memory (have an ``O``)."""
        return frozenset((a.chunk, a.unit) for acts in self.ranks for a in acts if a.op is Op.OFFLOAD)

    def producers(self, a: Action) -> tuple[Action, ...]:
        """The actions whose outputs ``a`` consumes (see the module doc)."""
        last = len(self.placement.chunks(a.module)) - 1
        if a.op.is_copy:
            return (Action(a.chunk, Op.FORWARD if a.op is Op.OFFLOAD else Op.OFFLOAD, a.unit),)
        if a.op is self.grad_op(a.module) and not a.is_encoder and (a.chunk, a.unit) in self.offloaded:
            return (*self._producers(a, last), Action(a.chunk, Op.RELOAD, a.unit))
        return self._producers(a, last)

    def _producers(self, a: Action, last: int) -> tuple[Action, ...]:
        if a.op is Op.FORWARD:
            if a.chunk > 0:
                return (Action(a.chunk - 1, Op.FORWARD, a.unit, a.module),)
            if a.is_encoder or not self.encoder:
                return ()
            e = len(self.placement.encoder) - 1
            return tuple(Action(e, Op.FORWARD, k, Module.ENCODER) for k in self.sub_micro_batches[a.unit])
        if a.op is Op.BACKWARD_WEIGHT:
            return (Action(a.chunk, Op.BACKWARD_INPUT, a.unit, a.module),)
        own = Action(a.chunk, Op.FORWARD, a.unit, a.module)
        if a.chunk < last:
            return own, Action(a.chunk + 1, self.grad_op(a.module), a.unit, a.module)
        if a.is_encoder:
            return own, Action(0, self.grad_op(Module.BACKBONE), self.sub_mb_parent[a.unit])
        return (own,)

    def consumers(self, a: Action) -> tuple[Action, ...]:
        """The actions that consume ``a``'s outputs (inverse of ``producers``)."""
        if a.op.is_copy:
            return (Action(a.chunk, Op.RELOAD, a.unit) if a.op is Op.OFFLOAD else Action(a.chunk, self.grad_op(Module.BACKBONE), a.unit),)
        copy = (Action(a.chunk, Op.OFFLOAD, a.unit),) if a.op is Op.FORWARD and not a.is_encoder and (a.chunk, a.unit) in self.offloaded else ()
        return self._consumers(a) + copy

    def _consumers(self, a: Action) -> tuple[Action, ...]:
        last = len(self.placement.chunks(a.module)) - 1
        trained = self.placement.encoder_trained or not a.is_encoder
        if a.op is Op.FORWARD:
            nxt: tuple[Action, ...]
            if a.chunk < last:
                nxt = (Action(a.chunk + 1, Op.FORWARD, a.unit, a.module),)
            elif a.is_encoder:
                nxt = (Action(0, Op.FORWARD, self.sub_mb_parent[a.unit]),)
            else:
                nxt = ()
            return nxt + ((Action(a.chunk, self.grad_op(a.module), a.unit, a.module),) if trained else ())
        if a.op is Op.BACKWARD_WEIGHT:
            return ()
        weight = (Action(a.chunk, Op.BACKWARD_WEIGHT, a.unit, a.module),) if a.op is Op.BACKWARD_INPUT else ()
        if a.chunk > 0:
            return (Action(a.chunk - 1, self.grad_op(a.module), a.unit, a.module),) + weight
        if not a.is_encoder and self.placement.encoder_trained:
            e = len(self.placement.encoder) - 1
            return tuple(Action(e, Op.BACKWARD, k, Module.ENCODER) for k in self.sub_micro_batches[a.unit]) + weight
        return weight

    def floats(self, a: Action) -> bool:
        """``a`` needs no input and feeds other chunks on its own rank only: it can run at any
        point of its rank's list before its consumers (a co-located encoder's forward, i.e. encoder
        pre-computation). The simulator attaches such actions to the next action of their rank
        instead of giving them nodes."""
        if a.op is not Op.FORWARD or a.chunk or self.producers(a):
            return False
        rank = self.placement.rank_of(a)
        consumers = self.consumers(a)
        return (all(self.placement.rank_of(c) == rank for c in consumers)
                and any((c.module, c.chunk) != (a.module, a.chunk) for c in consumers))

    def buffers(self) -> list[tuple["Buffer", int, int, Action, Action]]:
        """Memory each action keeps alive, as ``(kind, chunk, unit, allocating action, freeing
        action)``, both actions on one rank: a forward's saved activations (a trained encoder's
        too) until its backward; a sub-microbatch's image features on the rank of backbone chunk 0,
        from the encoder forward that makes them there (co-located) or from backbone chunk 0's
        forward that receives them, until backbone chunk 0's backward (the projector keeps them);
        with a split backward, from ``I`` to ``W``, the output gradients of the chunk's weight
        operations, which the weight gradient still needs (torch keeps them in its parameter groups).
        An offloaded chunk's activations are two buffers: from ``F`` to ``O``, and from ``R`` on."""
        p = self.placement
        release = self.release_op(Module.BACKBONE)
        out = [(Buffer.ACTIVATION, s, j, Action(s, Op.FORWARD, j), Action(s, release, j))
               for s in range(p.num_stages) for j in range(self.num_micro_batches) if (s, j) not in self.offloaded]
        out += [buf for s, j in sorted(self.offloaded) for buf in (  # on the device until its O, again from its R
            (Buffer.ACTIVATION, s, j, Action(s, Op.FORWARD, j), Action(s, Op.OFFLOAD, j)),
            (Buffer.ACTIVATION, s, j, Action(s, Op.RELOAD, j), Action(s, release, j)))]
        if self.split_backward:
            out += [(Buffer.WEIGHT_GRAD, s, j, Action(s, Op.BACKWARD_INPUT, j), Action(s, Op.BACKWARD_WEIGHT, j))
                    for s in range(p.num_stages) for j in range(self.num_micro_batches)]
        last = len(p.encoder) - 1
        for k, j in enumerate(self.sub_mb_parent):
            if p.encoder_trained:
                out += [(Buffer.ENCODER_ACTIVATION, c, k, Action(c, Op.FORWARD, k, Module.ENCODER), Action(c, Op.BACKWARD, k, Module.ENCODER))
                        for c in range(len(p.encoder))]
            made = Action(last, Op.FORWARD, k, Module.ENCODER) if p.encoder[last] == p.backbone[0] else Action(0, Op.FORWARD, j)
            out.append((Buffer.FEATURES, 0, k, made, Action(0, release, j)))
        return out

    def expected_actions(self) -> list[Action]:
        """Every action the table must hold, once each."""
        out = []
        for module in (Module.ENCODER, Module.BACKBONE):
            if module is Module.ENCODER and not self.placement.encoder_trained:
                ops: tuple[Op, ...] = (Op.FORWARD,)
            elif self.split_backward and module is Module.BACKBONE:
                ops = (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
            else:
                ops = (Op.FORWARD, Op.BACKWARD)
            for c in range(len(self.placement.chunks(module))):
                out += [Action(c, op, u, module) for op in ops for u in range(self.units(module))]
        return out

    def validate(self) -> "ScheduleTable":
        """Check that the table can execute; raise ``ScheduleError`` naming the first problem."""
        p, m = self.placement, self.num_micro_batches
        if len(self.ranks) != p.num_ranks:
            raise ScheduleError(f"the table has {len(self.ranks)} rank lists but its placement uses {p.num_ranks} ranks")
        if m < 1:
            raise ScheduleError("a schedule needs at least one micro-batch")
        if self.sub_mb_parent and not p.encoder:
            raise ScheduleError("sub-microbatches need encoder chunks")
        bad = [k for k, j in enumerate(self.sub_mb_parent) if not 0 <= j < m]
        if bad:
            raise ScheduleError(f"sub-microbatch {bad[0]} belongs to micro-batch {self.sub_mb_parent[bad[0]]}, not one of 0..{m - 1}")
        if list(self.sub_mb_parent) != sorted(self.sub_mb_parent):
            raise ScheduleError(f"sub-microbatches must be numbered micro-batch by micro-batch, got parents {list(self.sub_mb_parent)}")
        seen: set[Action] = set()
        for rank, actions in enumerate(self.ranks):
            done: set[Action] = set()
            for pos, a in enumerate(actions):
                where = f"rank {rank}, position {pos} ({a})"
                chunks = p.chunks(a.module)
                if not (0 <= a.chunk < len(chunks) and 0 <= a.unit < self.units(a.module)):
                    raise ScheduleError(f"{where}: chunk or unit out of range ({p.num_stages} backbone chunks, {len(p.encoder)} encoder "
                                        f"chunks, {m} micro-batches, {self.num_sub_micro_batches} sub-microbatches)")
                if a.is_encoder and a.op is not Op.FORWARD and not p.encoder_trained:
                    raise ScheduleError(f"{where}: a frozen encoder has no backward actions")
                if a.op.is_copy and a.is_encoder:
                    raise ScheduleError(f"{where}: only backbone chunks' activations are offloaded")
                if a.op in (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT) and (a.is_encoder or not self.split_backward):
                    raise ScheduleError(f"{where}: split backward actions (I, W) belong to backbone chunks of a split_backward table")
                if a.op is Op.BACKWARD and not a.is_encoder and self.split_backward:
                    raise ScheduleError(f"{where}: a split_backward table runs backbone backwards as I and W, not B")
                if chunks[a.chunk] != rank:
                    raise ScheduleError(f"{where}: {'encoder ' if a.is_encoder else ''}chunk {a.chunk} is placed on rank {chunks[a.chunk]}")
                if a in seen:
                    raise ScheduleError(f"{where}: {a} appears twice")
                seen.add(a)
                for need in self.producers(a):
                    if p.rank_of(need) == rank and need not in done:
                        raise ScheduleError(f"{where}: needs {need}, which this rank has not run before it")
                done.add(a)
        missing = [a for a in self.expected_actions() if a not in seen]
        missing += [Action(c, Op.RELOAD, u) for c, u in sorted(self.offloaded) if Action(c, Op.RELOAD, u) not in seen]
        if missing:
            raise ScheduleError(f"action {missing[0]} is missing")
        if self.max_in_flight is not None:
            release = self.release_op(Module.BACKBONE)
            for r, actions in enumerate(self.ranks):
                live = 0
                for a in actions:
                    if not a.is_encoder:
                        live += 1 if a.op in (Op.FORWARD, Op.RELOAD) else -1 if a.op in (release, Op.OFFLOAD) else 0
                        if live > self.max_in_flight[r]:
                            raise ScheduleError(f"rank {r} holds {live} micro-batches' activations at {a}, over its limit of "
                                                f"{self.max_in_flight[r]}")
        return self

    def to_csv(self, *, compute_only: bool = True) -> str:
        """One row per rank, one action per cell: the format of torch's ``_load_csv``
        (``compute_only`` leaves out encoder actions and copies, which torch does not know)."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        for actions in self.ranks:
            writer.writerow([str(a) for a in actions if not (compute_only and (a.is_encoder or a.op.is_copy))])
        return buf.getvalue()

    @classmethod
    def from_csv(cls, text: str, *, num_stages: int, num_micro_batches: int, name: str = "csv") -> "ScheduleTable":
        """A backbone-only table in torch's CSV form (the chunk placement read off the rows)."""
        rows = [[Action.parse(c) for c in row if c.strip()] for row in csv.reader(io.StringIO(text))]
        if any(a.is_encoder for r in rows for a in r):
            raise ScheduleError("a torch schedule CSV holds backbone actions only")
        stage_rank = [-1] * num_stages
        for rank, row in enumerate(rows):
            for a in row:
                if 0 <= a.chunk < num_stages:
                    stage_rank[a.chunk] = rank
        return cls(
            placement=Placement(tuple(stage_rank)),
            num_micro_batches=num_micro_batches,
            ranks=tuple(tuple(r) for r in rows),
            name=name,
            split_backward=any(a.op is Op.BACKWARD_INPUT for r in rows for a in r),
        ).validate()
