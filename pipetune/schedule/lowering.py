"""Lowering pass: a rank's compute actions -> compute + communication actions (runtime input).

Kept apart from the runtime, as torch.distributed.pipelining does with its ``_Action`` IR. For each
compute action the pass adds, in torch's vocabulary:

* ``{s}RECV_F{i}`` before the compute action that precedes ``{s}F{i}`` (one action of look-ahead,
  so the message can arrive while the rank computes), and ``{s}WAIT_F{i}`` right before it;
* ``{s}SEND_F{i}`` right after ``{s}F{i}`` when stage ``s + 1`` lives on another rank;
* the same for backward gradients (``RECV_B``/``WAIT_B``/``SEND_B``, towards stage ``s - 1``).

Messages are matched by ``(kind, micro-batch)``, not by arrival order, so any order of
micro-batches is safe; the runtime knows every message's shape from the batch itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetune.schedule.table import Action, Op, ScheduleTable

@dataclass(frozen=True)
class Step:
    """One lowered action: ``kind`` is F, B, E, RECV_F, WAIT_F, SEND_F, RECV_B, WAIT_B or SEND_B;
    ``peer`` is the other rank of a message."""

    kind: str
    stage: int
    mb: int
    peer: int = -1

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def lower(table: ScheduleTable, rank: int) -> list[Step]:
    """Rank ``rank``'s lowered action list for ``table`` (validated first)."""
    table.validate()
    acts = list(table.ranks[rank])
    out: list[Step] = []
    for k, a in enumerate(acts):
        for b in ((a,) if k == 0 else ()) + ((acts[k + 1],) if k + 1 < len(acts) else ()):
            src = _source(table, b)
            if src is not None:
                out.append(Step(f"RECV_{b.op.value}", b.stage, b.mb, src))
        src = _source(table, a)
        if src is not None:
            out.append(Step(f"WAIT_{a.op.value}", a.stage, a.mb, src))
        out.append(Step(a.op.value, a.stage, a.mb))
        dst = _destination(table, a)
        if dst is not None:
            out.append(Step(f"SEND_{a.op.value}", a.stage, a.mb, dst))
    return out


def _source(table: ScheduleTable, a: Action) -> int | None:
    """Rank a message for ``a`` comes from, if it needs one from another rank."""
    if a.op is Op.FORWARD and a.stage > 0:
        peer = table.stage_rank[a.stage - 1]
    elif a.op is Op.BACKWARD and a.stage < table.num_stages - 1:
        peer = table.stage_rank[a.stage + 1]
    else:
        return None
    return peer if peer != table.stage_rank[a.stage] else None


def _destination(table: ScheduleTable, a: Action) -> int | None:
    if a.op is Op.FORWARD and a.stage < table.num_stages - 1:
        peer = table.stage_rank[a.stage + 1]
    elif a.op is Op.BACKWARD and a.stage > 0:
        peer = table.stage_rank[a.stage - 1]
    else:
        return None
    return peer if peer != table.stage_rank[a.stage] else None
