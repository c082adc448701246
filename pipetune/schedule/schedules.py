"""Schedule generators: pure functions from (stages, micro-batch order) to a ``ScheduleTable``.

``order`` is the execution order of micro-batches (a permutation of ``range(m)``): the k-th
micro-batch to enter the pipeline is ``order[k]``. Encoder actions, when the model has an encoder,
sit immediately before their stage-0 forward; ``place_encoders`` moves them earlier
(pre-computation). Generated tables are valid by construction (the tests check it);
``ScheduleTable.validate`` and ``compile_schedule`` check any table, generated or not.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetune.schedule.table import Action, Op, ScheduleError, ScheduleTable


def _check_order(order: Sequence[int]) -> list[int]:
    order = [int(x) for x in order]
    if sorted(order) != list(range(len(order))):
        raise ScheduleError(f"micro-batch order {order} is not a permutation of 0..{len(order) - 1}")
    if not order:
        raise ScheduleError("a schedule needs at least one micro-batch")
    return order


def _with_encoder(actions: list[Action], stage: int, encoder: bool) -> list[Action]:
    if not (encoder and stage == 0):
        return actions
    out = []
    for a in actions:
        if a.op is Op.FORWARD:
            out.append(Action(0, Op.ENCODER, a.mb))
        out.append(a)
    return out


def one_f_one_b(num_stages: int, order: Sequence[int], *, encoder: bool = False) -> ScheduleTable:
    """1F1B: stage s runs ``num_stages - s`` warm-up forwards, then alternates one backward and
    one forward, then drains the backwards (the order of torch's ``Schedule1F1B``)."""
    order = _check_order(order)
    m = len(order)
    ranks = []
    for s in range(num_stages):
        warmup = min(m, num_stages - s)
        acts = [Action(s, Op.FORWARD, mb) for mb in order[:warmup]]
        for k in range(m):
            acts.append(Action(s, Op.BACKWARD, order[k]))
            if warmup + k < m:
                acts.append(Action(s, Op.FORWARD, order[warmup + k]))
        ranks.append(tuple(_with_encoder(acts, s, encoder)))
    return ScheduleTable(
        num_stages=num_stages,
        num_micro_batches=m,
        stage_rank=tuple(range(num_stages)),
        ranks=tuple(ranks),
        encoder=encoder,
        max_in_flight=tuple(num_stages - s for s in range(num_stages)),
        name="1F1B",
    )


def gpipe(num_stages: int, order: Sequence[int], *, encoder: bool = False) -> ScheduleTable:
    """GPipe: every forward, then every backward, in the same micro-batch order."""
    order = _check_order(order)
    ranks = []
    for s in range(num_stages):
        acts = [Action(s, Op.FORWARD, mb) for mb in order] + [Action(s, Op.BACKWARD, mb) for mb in order]
        ranks.append(tuple(_with_encoder(acts, s, encoder)))
    return ScheduleTable(
        num_stages=num_stages,
        num_micro_batches=len(order),
        stage_rank=tuple(range(num_stages)),
        ranks=tuple(ranks),
        encoder=encoder,
        name="GPipe",
    )


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


def place_encoders(table: ScheduleTable, before: dict[int, int]) -> ScheduleTable:
    """Pre-compute encoders: ``before[mb] = k`` runs ``0E{mb}`` before the k-th non-encoder action
    of stage 0's rank (it must still precede ``0F{mb}``); others stay right before their forward.
    Encoders moved to the same action run in forward order, ahead of that action's own encoder."""
    if not table.encoder:
        raise ScheduleError("this schedule has no encoder actions to place")
    rank0 = table.stage_rank[0]
    work = [a for a in table.ranks[rank0] if a.op is not Op.ENCODER]
    slots: list[list[Action]] = [[] for _ in range(len(work) + 1)]
    fwd_pos = {a.mb: k for k, a in enumerate(work) if a.stage == 0 and a.op is Op.FORWARD}
    for mb, k in sorted(fwd_pos.items(), key=lambda kv: kv[1]):
        target = before.get(mb, k)
        if not 0 <= target <= k:
            raise ScheduleError(f"encoder of micro-batch {mb} must run before its forward (position {k}), not at {target}")
        slots[target].append(Action(0, Op.ENCODER, mb))
    for k in range(len(work)):  # moved encoders first, the slot's own one just before its forward
        slots[k].sort(key=lambda e: fwd_pos[e.mb] == k)
    ranks = list(table.ranks)
    ranks[rank0] = tuple(a for k, w in enumerate(work) for a in (*slots[k], w))
    return ScheduleTable(
        num_stages=table.num_stages,
        num_micro_batches=table.num_micro_batches,
        stage_rank=table.stage_rank,
        ranks=tuple(ranks),
        encoder=True,
        max_in_flight=table.max_in_flight,
        name=table.name,
    ).validate()
