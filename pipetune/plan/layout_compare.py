"""Co-located layouts (even and searched backbone split) against the separated layout (DIP), in
simulation: the same iterations planned in ``pipetune`` mode on each, so the figures differ only
by layout (and by the schedules each layout's planner can build)."""

from __future__ import annotations

from dataclasses import dataclass

from pipetune.config.model import ModelConfig
from pipetune.cost.cost_model import CostModel
from pipetune.cost.layout import StageLayout
from pipetune.data.samples import SampleTable
from pipetune.plan.compare import ModeSummary, compare_modes
from pipetune.plan.layout import LayoutSearch, balanced_shapes, sample_batches
from pipetune.plan.partitioner import Partition, partition
from pipetune.plan.search import Mode


@dataclass(frozen=True)
class LayoutRun:
    """One layout's planned iterations, or why none could be planned (``error``)."""

    name: str
    layout: StageLayout
    summary: ModeSummary | None
    error: str = ""


def separated_layout(model: ModelConfig, cost: CostModel, metas, *, max_seq_len: int, seed: int) -> Partition:
    """The partitioner's layout, from sampled batches of the job's data (balanced, micro-batch size 1)."""
    shapes = [balanced_shapes(model, meta, 1, max_seq_len=max_seq_len, seed=seed) for meta in metas]
    return partition(model, cost, shapes, max_seq_len=max_seq_len)


def compare_layouts(model: ModelConfig, cost: CostModel, data: SampleTable, *, gbs: int, max_seq_len: int, memory_bytes: float,
                    iters: int, sample: int = 8, seed: int = 0, overlong="truncate") -> tuple[list[LayoutRun], Partition]:
    """``even``, ``auto`` (the layout search) and ``separated`` (the partitioner), each planned on
    the same ``iters`` batches; a layout on which no plan fits memory is reported with its error."""
    even = cost.with_layout(StageLayout.even(model.backbone.n_layers, cost.num_stages))
    metas = sample_batches(data, model, gbs=gbs, max_seq_len=max_seq_len, count=sample, seed=seed, overlong=overlong)
    layouts = {"even": even.layout}
    try:
        layouts["auto"] = LayoutSearch(model, even, metas, max_seq_len=max_seq_len, memory_bytes=memory_bytes, seed=seed).search().best.layout
    except ValueError as e:
        layouts["auto"] = even.layout
        auto_error = str(e)
    else:
        auto_error = ""
    part = separated_layout(model, even, metas, max_seq_len=max_seq_len, seed=seed)
    layouts["separated"] = part.layout
    runs = []
    for name, layout in layouts.items():
        if name == "auto" and auto_error:
            runs.append(LayoutRun(name, layout, None, auto_error))
            continue
        try:
            summary = compare_modes(model, cost.with_layout(layout), data, gbs=gbs, max_seq_len=max_seq_len, memory_bytes=memory_bytes,
                                    iters=iters, overlong=overlong, seed=seed, modes=(Mode.PIPETUNE,), best_static=False)["pipetune"]
            runs.append(LayoutRun(name, layout, summary))
        except ValueError as e:
            runs.append(LayoutRun(name, layout, None, str(e)))
    return runs, part
