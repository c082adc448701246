"""Pipeline schedules as tables: for every rank, its ordered list of compute actions.

An action is ``(stage, op, micro-batch)``, written like torch.distributed.pipelining's ``_Action``
(``1F3``: stage 1 forward of micro-batch 3; ``0B0``). We add ``E``, the vision-encoder forward of a
micro-batch, which runs on the rank of stage 0 before that micro-batch's ``0F`` (earlier when
pre-computed). Stages and ranks are distinct: ``stage_rank`` maps each stage to the rank that holds
it, so a rank may hold several stages (DIP's modality segments); PipeTune's layout is stage s on
rank s. A table only orders work; latencies come from the cost model and times from the simulator.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from enum import Enum

ACTION_RE = re.compile(r"^(\d+)([FBE])(\d+)$")


class Op(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    ENCODER = "E"


@dataclass(frozen=True)
class Action:
    stage: int
    op: Op
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        m = ACTION_RE.match(text.strip())
        if not m:
            raise ValueError(f"not an action: {text!r} (expected like 0F3, 1B0 or 0E2)")
        return cls(int(m.group(1)), Op(m.group(2)), int(m.group(3)))


class ScheduleError(ValueError):
    """A schedule table that cannot run; the message names the offending action."""


@dataclass(frozen=True)
class ScheduleTable:
    """Per-rank ordered actions for ``num_stages`` stages and ``num_micro_batches`` micro-batches.

    ``max_in_flight[s]``, when set, bounds forwards minus backwards on stage ``s`` at any point of
    its rank's list (1F1B's activation-memory guarantee: ``num_stages - s``).
    """

    num_stages: int
    num_micro_batches: int
    stage_rank: tuple[int, ...]
    ranks: tuple[tuple[Action, ...], ...]
    encoder: bool = False
    max_in_flight: tuple[int, ...] | None = None
    name: str = ""

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def validate(self) -> "ScheduleTable":
        """Check that the table can execute; raise ``ScheduleError`` naming the first problem."""
        S, m = self.num_stages, self.num_micro_batches
        if len(self.stage_rank) != S or any(not 0 <= r < self.num_ranks for r in self.stage_rank):
            raise ScheduleError(f"stage_rank {self.stage_rank} must map {S} stages to ranks 0..{self.num_ranks - 1}")
        seen: dict[tuple[int, Op, int], int] = {}
        for rank, actions in enumerate(self.ranks):
            done: set[tuple[int, Op, int]] = set()
            for pos, a in enumerate(actions):
                where = f"rank {rank}, position {pos} ({a})"
                if not (0 <= a.stage < S and 0 <= a.mb < m):
                    raise ScheduleError(f"{where}: stage or micro-batch out of range ({S} stages, {m} micro-batches)")
                if self.stage_rank[a.stage] != rank:
                    raise ScheduleError(f"{where}: stage {a.stage} belongs to rank {self.stage_rank[a.stage]}")
                key = (a.stage, a.op, a.mb)
                if key in seen:
                    raise ScheduleError(f"{where}: {a} appears twice")
                seen[key] = rank
                if a.op is Op.ENCODER and (not self.encoder or a.stage != 0):
                    raise ScheduleError(f"{where}: encoder actions belong to stage 0 of a schedule with an encoder")
                if a.op is Op.BACKWARD and (a.stage, Op.FORWARD, a.mb) not in done:
                    raise ScheduleError(f"{where}: backward before this rank ran forward {a.stage}F{a.mb}")
                if a.op is Op.FORWARD and a.stage == 0 and self.encoder and (0, Op.ENCODER, a.mb) not in done:
                    raise ScheduleError(f"{where}: forward before this rank ran its encoder 0E{a.mb}")
                done.add(key)
        ops = [Op.FORWARD, Op.BACKWARD] + ([Op.ENCODER] if self.encoder else [])
        for s in range(S):
            for op in ops:
                if op is Op.ENCODER and s != 0:
                    continue
                for mb in range(m):
                    if (s, op, mb) not in seen:
                        raise ScheduleError(f"action {s}{op.value}{mb} is missing")
        if self.max_in_flight is not None:
            for s in range(S):
                live = 0
                for a in self.ranks[self.stage_rank[s]]:
                    if a.stage == s and a.op is not Op.ENCODER:
                        live += 1 if a.op is Op.FORWARD else -1
                        if live > self.max_in_flight[s]:
                            raise ScheduleError(
                                f"stage {s} holds {live} micro-batches in flight at {a}, over its limit of {self.max_in_flight[s]}"
                            )
        return self

    def to_csv(self, *, compute_only: bool = True) -> str:
        """One row per rank, one action per cell: the format of torch's ``_load_csv``
        (``compute_only`` leaves out our encoder actions, which torch does not know)."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        for actions in self.ranks:
            writer.writerow([str(a) for a in actions if not (compute_only and a.op is Op.ENCODER)])
        return buf.getvalue()

    @classmethod
    def from_csv(cls, text: str, *, num_stages: int, num_micro_batches: int, name: str = "csv") -> "ScheduleTable":
        rows = [[Action.parse(c) for c in row if c.strip()] for row in csv.reader(io.StringIO(text))]
        stage_rank = [-1] * num_stages
        for rank, row in enumerate(rows):
            for a in row:
                if 0 <= a.stage < num_stages:
                    stage_rank[a.stage] = rank
        return cls(
            num_stages=num_stages,
            num_micro_batches=num_micro_batches,
            stage_rank=tuple(stage_rank),
            ranks=tuple(tuple(r) for r in rows),
            encoder=any(a.op is Op.ENCODER for r in rows for a in r),
            name=name,
        ).validate()
