"""Co-located layouts (even and searched backbone split) against the separated layout (DIP), in
simulation: the same iterations planned in ``pipetune`` mode on each, so the figures differ only
by layout (and by the schedules each layout's planner can build)."""

from __future__ import annotations

from dataclasses import dataclass

from pipetune.config.model import ModelConfig
from pipetune.cost.cost_model import CostModel
from pipetune.cost.stage_layout import StageLayout
from pipetune.data.samples import SampleTable
from pipetune.plan.compare import ModeSummary, compare_modes
from pipetune.plan.layout import LayoutSearch, sample_batches
from pipetune.plan.mode import Mode
from pipetune.plan.partitioner import Partition


@dataclass(frozen=True)
class LayoutRun:
    """One layout's planned iterations, or why none could be planned (``error``)."""

    name: str
    layout: StageLayout
    summary: ModeSummary | None
    error: str = ""


def compare_layouts(model: ModelConfig, cost: CostModel, data: SampleTable, *, gbs: int, max_seq_len: int, memory_bytes: float,
                    iters: int, sample: int = 8, seed: int = 0, overlong="truncate") -> tuple[list[LayoutRun], Partition]:
    """``even``, ``split`` (the layout search's best co-located split) and ``separated`` (the
    partitioner), each planned on the same ``iters`` batches; a layout on which no plan fits memory
    is reported with its error. ``--layout auto`` picks the faster of ``split`` and ``separated``
    on the sampled batches (``LayoutSearch.search(separated=True)``)."""
    even = cost.with_layout(StageLayout.even(model.backbone.n_layers, cost.num_stages))
    metas = sample_batches(data, model, gbs=gbs, max_seq_len=max_seq_len, count=sample, seed=seed, overlong=overlong)
    search = LayoutSearch(model, even, metas, max_seq_len=max_seq_len, memory_bytes=memory_bytes, seed=seed)
    layouts = {"even": (even.layout, "")}
    try:
        layouts["split"] = (search.search().split.layout, "")
    except ValueError as e:  # no co-located split fits memory
        layouts["split"] = (even.layout, str(e))
    part = search.partition()
    layouts["separated"] = (part.layout, "")
    runs = []
    for name, (layout, error) in layouts.items():
        if error:
            runs.append(LayoutRun(name, layout, None, error))
            continue
        try:
            summary = compare_modes(model, cost.with_layout(layout), data, gbs=gbs, max_seq_len=max_seq_len, memory_bytes=memory_bytes,
                                    iters=iters, overlong=overlong, seed=seed, modes=(Mode.PIPETUNE,), best_static=False)["pipetune"]
            runs.append(LayoutRun(name, layout, summary))
        except ValueError as e:
            runs.append(LayoutRun(name, layout, None, str(e)))
    return runs, part
