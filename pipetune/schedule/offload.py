"""Activation offload in a schedule table: an ``O`` after a chunk's forward, an ``R`` ahead of its gradient.

``with_offload`` adds the copy pair of each chosen backbone ``(chunk, unit)`` to a table (see
``pipetune.schedule.table`` for what the copies mean): ``O`` right after the forward, so the copy
starts as soon as the activations exist, and ``R`` ``lead`` compute actions ahead of the gradient
action that needs them back, so the copy back overlaps that work (never before the ``O``). Which
pairs to offload, and how far ahead to reload, is the planner's choice
(``pipetune.plan.search.offload_choice``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from pipetune.schedule.table import Action, Module, Op, ScheduleError, ScheduleTable


def with_offload(table: ScheduleTable, pairs: Iterable[tuple[int, int]] | Mapping[tuple[int, int], int], *, lead: int = 1) -> ScheduleTable:
    """``table`` with ``pairs`` (backbone chunk, micro-batch) offloaded, each reloaded ``lead``
    compute actions ahead of its gradient (a mapping gives each pair its own lead); ``ScheduleError``
    for a pair already offloaded or out of range. Not validated (the caller's plan is)."""
    leads = dict(pairs) if isinstance(pairs, Mapping) else dict.fromkeys(pairs, lead)
    pairs = sorted(leads)
    if min(leads.values(), default=0) < 0:
        raise ScheduleError(f"an offload's reload lead must be >= 0 compute actions, got {min(leads.values())}")
    bad = [p for p in pairs if not (0 <= p[0] < table.num_stages and 0 <= p[1] < table.num_micro_batches) or p in table.offloaded]
    if bad:
        raise ScheduleError(f"cannot offload chunk {bad[0][0]} of micro-batch {bad[0][1]}: out of range or offloaded already")
    grad = table.grad_op(Module.BACKBONE)
    ranks = [list(acts) for acts in table.ranks]
    for c, u in pairs:
        acts = ranks[table.placement.backbone[c]]
        acts.insert(acts.index(Action(c, Op.FORWARD, u)) + 1, Action(c, Op.OFFLOAD, u))
        offload, k = acts.index(Action(c, Op.OFFLOAD, u)), acts.index(Action(c, grad, u))
        for _ in range(leads[c, u]):  # step back over that many compute actions, not past the O
            j = next((j for j in range(k - 1, offload, -1) if not acts[j].op.is_copy), None)
            if j is None:
                break
            k = j
        acts.insert(k, Action(c, Op.RELOAD, u))
    return replace(table, ranks=tuple(map(tuple, ranks)))
