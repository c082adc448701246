"""Co-located schedule generators: pure functions from (stages, micro-batch order) to a ``ScheduleTable``.

``order`` is the execution order of micro-batches (a permutation of ``range(m)``): the k-th
micro-batch to enter the pipeline is ``order[k]``. With an encoder, the layout is PipeTune's: one
encoder chunk beside backbone chunk 0, sub-microbatch ``j`` = the images of micro-batch ``j``; its
forward ``E0F{j}`` sits immediately before ``0F{j}`` and, when the encoder is trained, its
backward ``E0B{j}`` immediately after ``0B{j}``. ``place_encoders`` moves encoder forwards earlier
(pre-computation). Generated tables are valid by construction (the tests check it);
``ScheduleTable.validate`` and ``compile_schedule`` check any table, generated or not. The
separated layout's tables come from ``pipetune.plan.interleave``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from enum import StrEnum

from pipetune.schedule.table import Action, Module, Op, Placement, ScheduleError, ScheduleTable


def _check_order(order: Sequence[int]) -> list[int]:
    order = [int(x) for x in order]
    if sorted(order) != list(range(len(order))):
        raise ScheduleError(f"micro-batch order {order} is not a permutation of 0..{len(order) - 1}")
    if not order:
        raise ScheduleError("a schedule needs at least one micro-batch")
    return order


def _with_encoder(actions: list[Action], stage: int, placement: Placement) -> list[Action]:
    if not (placement.encoder and stage == 0):
        return actions
    out = []
    for a in actions:
        if a.op is Op.FORWARD:
            out.append(Action(0, Op.FORWARD, a.unit, Module.ENCODER))
        out.append(a)
        if a.op is Op.BACKWARD and placement.encoder_trained:
            out.append(Action(0, Op.BACKWARD, a.unit, Module.ENCODER))
    return out


def _table(per_stage: list[list[Action]], m: int, placement: Placement, name: str, max_in_flight=None) -> ScheduleTable:
    return ScheduleTable(
        placement=placement,
        num_micro_batches=m,
        ranks=tuple(tuple(_with_encoder(acts, s, placement)) for s, acts in enumerate(per_stage)),
        sub_mb_parent=tuple(range(m)) if placement.encoder else (),
        max_in_flight=max_in_flight,
        name=name,
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


class Schedule(StrEnum):
    """The co-located generators by the name configs and the command line use for them."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"
    SERIAL = "serial"

    def build(self, num_stages: int, order: Sequence[int], *, encoder: bool = False, encoder_trained: bool = False) -> ScheduleTable:
        generator = {Schedule.ONE_F_ONE_B: one_f_one_b, Schedule.GPIPE: gpipe, Schedule.SERIAL: serial}[self]
        return generator(num_stages, order, encoder=encoder, encoder_trained=encoder_trained)


def place_encoders(table: ScheduleTable, before: dict[int, int]) -> ScheduleTable:
    """Pre-compute encoders (co-located layout): ``before[k] = i`` runs ``E0F{k}`` before the
    i-th action of its rank that is not an encoder forward (it must still precede ``0F`` of its
    micro-batch); the others stay right before that forward. Encoders moved to the same action run
    in forward order, ahead of that action's own encoder."""
    p = table.placement
    if not p.encoder:
        raise ScheduleError("this schedule has no encoder actions to place")
    if not p.colocated_encoder:
        raise ScheduleError("encoder pre-computation moves encoder forwards on the rank of backbone chunk 0; "
                            "this placement spreads the encoder over chunks of its own")
    rank = p.encoder[0]
    is_enc_fwd = lambda a: a.is_encoder and a.op is Op.FORWARD  # noqa: E731
    work = [a for a in table.ranks[rank] if not is_enc_fwd(a)]
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
    ranks = list(table.ranks)
    ranks[rank] = tuple(a for k, w in enumerate(work) for a in (*slots[k], w))
    return replace(table, ranks=tuple(ranks)).validate()


def onto_ranks(table: ScheduleTable, stage_rank: tuple[int, ...]) -> ScheduleTable:
    """A one-stage-per-rank table's actions placed on ``stage_rank``'s ranks (e.g. every stage on
    rank 0: a whole pipeline in one process): each rank takes, in turns, the next action of its
    stages whose inputs are done (stages in index order)."""
    S = table.num_stages
    placement = Placement.colocated(S, encoder=table.encoder, encoder_trained=table.placement.encoder_trained, stage_rank=stage_rank)
    pos, done = [0] * S, set()
    ranks: list[list[Action]] = [[] for _ in range(placement.num_ranks)]
    while any(pos[s] < len(table.ranks[s]) for s in range(S)):
        before = sum(pos)
        for r in range(len(ranks)):
            for s in (s for s in range(S) if stage_rank[s] == r):
                if pos[s] < len(table.ranks[s]) and set(table.producers(table.ranks[s][pos[s]])) <= done:
                    ranks[r].append(table.ranks[s][pos[s]])
                    done.add(table.ranks[s][pos[s]])
                    pos[s] += 1
                    break
        if sum(pos) == before:
            raise ScheduleError(f"this schedule cannot run with its stages on ranks {list(stage_rank)}: no rank can proceed")
    return replace(table, placement=placement, ranks=tuple(map(tuple, ranks)), max_in_flight=None).validate()
