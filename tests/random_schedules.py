"""Random executable schedule tables, shared by the transport check (test_lowering_fifo.py) and the
gloo workers that execute them (pipeline_worker.py, titan_separated_worker.py): any valid order must
lower and run."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pipetune.data.batch import BatchMeta
from pipetune.packing import PackingConfig
from pipetune.packing.sub_batches import SubBatches
from pipetune.plan.plan import IterationPlan, plan_from_table
from pipetune.schedule import Action, Op, Placement, ScheduleTable


def random_order(rng: np.random.Generator, proto: ScheduleTable) -> ScheduleTable:
    """``proto``'s actions (its placement, micro-batches and sub-microbatches; its rank lists are
    ignored) in a random order that respects every dependency: any interleaving of a rank's chunks,
    of forwards and backwards, and of micro-batches. Not validated here: the simulator and the
    lowering validate what they are given."""
    missing = {a: len(proto.producers(a)) for a in proto.expected_actions()}
    ready = [a for a, n in missing.items() if n == 0]
    ranks: list[list[Action]] = [[] for _ in range(proto.placement.num_ranks)]
    while ready:
        a = ready.pop(int(rng.integers(len(ready))))
        ranks[proto.placement.rank_of(a)].append(a)
        for c in proto.consumers(a):
            missing[c] -= 1
            if missing[c] == 0:
                ready.append(c)
    return replace(proto, ranks=tuple(map(tuple, ranks)))


def separated_table(rng: np.random.Generator, *, ranks: int, segments: int, images_per_mb, image_sub_batch: int,
                    trained: bool, name: str = "random separated") -> ScheduleTable:
    """DIP's separated layout on ``ranks`` ranks (``ranks * segments`` encoder chunks, chunk ``k``
    on rank ``k mod ranks``), each micro-batch's images in sub-microbatches of ``image_sub_batch``,
    the actions in a random valid order (``random_order``)."""
    sub = SubBatches.split(np.asarray(images_per_mb), image_sub_batch)
    placement = Placement.separated(ranks, ranks * segments, encoder_trained=trained)
    proto = ScheduleTable(placement=placement, num_micro_batches=len(images_per_mb), ranks=((),) * ranks,
                          sub_mb_parent=tuple(sub.parent.tolist()), name=name)
    return random_order(rng, proto)


def random_separated_table(rng: np.random.Generator) -> ScheduleTable:
    """A random executable plan of the separated layout (DIP): ``P`` ranks, ``P * K`` encoder chunks
    (so each rank holds several), each micro-batch's images in sub-microbatches of ``B`` (some
    micro-batches without images), a frozen or trained encoder, in a random valid order."""
    P, K = int(rng.integers(2, 7)), int(rng.integers(1, 4))
    m = int(rng.integers(1, 9))
    images = rng.integers(0, 7, size=m) * (rng.random(m) < 0.8)
    return separated_table(rng, ranks=P, segments=K, images_per_mb=images, image_sub_batch=int(rng.integers(1, 5)),
                           trained=bool(rng.random() < 0.5))


def packed_separated_plan(rng: np.random.Generator, model, meta: BatchMeta, *, ranks: int, segments: int, image_sub_batch: int,
                          trained: bool, max_seq_len: int, mbs: int = 2) -> tuple[IterationPlan, list[int]]:
    """``meta``'s batch balance-packed at ``mbs`` and run as a separated plan in a random valid
    order (``separated_table``); the validated plan and each micro-batch's image count."""
    packing = PackingConfig(packer="balanced", mbs=mbs, max_seq_len=max_seq_len).build(model)(meta.table.lengths, meta.step)
    groups = [meta.table.ids[g].tolist() for g in packing.groups()]
    images = [int(meta.table.num_images[g].sum()) for g in packing.groups()]
    table = separated_table(rng, ranks=ranks, segments=segments, images_per_mb=images, image_sub_batch=image_sub_batch, trained=trained)
    order = [a.unit for a in table.ranks[0] if a == Action(0, Op.FORWARD, a.unit)]
    plan = plan_from_table(table, step=meta.step, micro_batches=groups, order=order, mbs=mbs, max_seq_len=max_seq_len,
                           image_sub_batch=image_sub_batch).validate()
    return plan, images
