"""Plan many iterations in every mode and summarise them the way PipeTune Table 2 does.

Besides the paper's modes, ``best-static`` is what a careful user would run without pipetune: one
micro-batch size and one packer (original or balanced) chosen once for the whole run, the pair
with the lowest mean simulated iteration time over the same iterations among those whose plans fit
memory on every iteration (PipeTune compares against ``original`` at the largest mbs that fits).
Since pipetune may spread a batch of few tokens over more micro-batches than rows (``Planner``'s
``finer_counts``), the balanced packer at mbs 1 is also tried with each of those counts as a
fixed minimum; on interleaved layouts, where pipetune also packs into whole rounds of the ranks
and spreads size 2 over the counts between, so is every size with each count from ``P`` to
``STATIC_ROUNDS`` rounds that torch's ``Interleaved1F1B`` accepts (``n`` a multiple of its
``n // P`` rounds: 8-15, 16, 18, 20, 22, 24, 27, 30, 32 at ``P`` 8), and on the separated
layout, where pipetune spreads a size's micro-batches over more of them, every size with every
count from 2 to ``STATIC_ROUNDS`` times the ranks (a fixed count of micro-batches, as TorchTitan's
``n_microbatches`` is).
When the planner may split backwards (``split_backward``), so may the fixed configuration: the
split is then one more fixed choice (and virtual stages come with the cost model's layout, for
both).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pipetune.data.images import ImageSizing
from pipetune.config.model import ModelConfig
from pipetune.cost.cost_model import CostModel
from pipetune.data.batch import BatchMeta, batch_meta
from pipetune.data.samples import Overlong, SampleTable
from pipetune.data.stream import BatchStream
from pipetune.plan.mode import Mode
from pipetune.plan.search.planner import Planner
from pipetune.plan.layout.planner_config import PlannerConfig, SplitBackward

STATIC_ROUNDS = 4  # fixed micro-batch counts up to this many rounds of the ranks (module doc)


@dataclass(frozen=True)
class ModeSummary:
    mode: str
    iter_s: np.ndarray
    lower_bound_s: np.ndarray
    search_s: np.ndarray
    mbs: Counter
    fallbacks: int
    choice: str = ""

    def to_dict(self, original_mean: float) -> dict:
        mean = float(self.iter_s.mean())
        return {
            "mean_iter_s": mean,
            "cut_vs_original": 1 - mean / original_mean,
            "lower_bound_s": float(self.lower_bound_s.mean()),
            "gap_to_lower_bound": float((self.iter_s / self.lower_bound_s - 1).mean()),
            "search_ms_p50": float(np.percentile(self.search_s, 50) * 1e3),
            "search_ms_p99": float(np.percentile(self.search_s, 99) * 1e3),
            "mbs_counts": {str(k): v for k, v in sorted(self.mbs.items())},
            "fallbacks": self.fallbacks,
            **({"choice": self.choice} if self.choice else {}),
        }


def compare_modes(
    model: ModelConfig,
    cost: CostModel,
    data: SampleTable,
    *,
    gbs: int,
    max_seq_len: int,
    memory_bytes: float,
    iters: int,
    mbs: int | None = None,
    overlong: Overlong | str = Overlong.TRUNCATE,
    seed: int = 0,
    modes=tuple(Mode),
    best_static: bool = True,
    split_backward: SplitBackward = SplitBackward.OFF,
    offload: bool = False,
) -> dict[str, ModeSummary]:
    """Plan ``iters`` batches of ``data`` in each mode (and ``best-static``, see module doc);
    simulated iteration times and search times. The paper's modes keep whole backwards and
    activations on the device; pipetune uses ``split_backward`` and ``offload``, and so may the
    best static configuration."""
    stream = BatchStream(num_rows=len(data), gbs=gbs, seed=seed)
    split_backward = SplitBackward(split_backward)
    planners = {
        Mode(m).value: PlannerConfig(mode=m, max_seq_len=max_seq_len, memory_bytes=memory_bytes, mbs=mbs, seed=seed,
                                     split_backward=split_backward if m is Mode.PIPETUNE else SplitBackward.OFF,
                                     offload=offload and m is Mode.PIPETUNE).build(model, cost)
        for m in modes
    }
    static = static_planners(model, cost, max_seq_len=max_seq_len, memory_bytes=memory_bytes, seed=seed,
                             split_backward=split_backward, offload=offload) if best_static else {}
    rows = {m: [] for m in [*planners, *static]}
    for step in range(iters):
        meta = batch_meta(data, stream, step, images=ImageSizing.for_model(model), max_seq_len=max_seq_len, overlong=overlong)
        for m, planner in [*planners.items(), *static.items()]:
            rows[m].append(planner.plan(meta))
    out = {m: _summary(m, rows[m]) for m in planners}
    choice = pick_best_static(static, rows)
    if choice is not None:
        out["best-static"] = _summary("best-static", rows[choice], choice=choice.describe())
    return out


class StaticKey(NamedTuple):
    """One fixed configuration: packer, micro-batch size, fewest micro-batches, backward split, and
    whether it offloads activations where a table does not fit otherwise."""

    packer: Mode
    mbs: int
    min_micro_batches: int
    split: SplitBackward
    offload: bool = False

    def describe(self) -> str:
        return (f"{self.packer.value} mbs={self.mbs}" + (f" >= {self.min_micro_batches} micro-batches" if self.min_micro_batches > 1 else "")
                + (f" split backward {self.split.value}" if self.split is not SplitBackward.OFF else "")
                + (" offload where memory binds" if self.offload else ""))


def static_planners(model: ModelConfig, cost: CostModel, *, max_seq_len: int, memory_bytes: float, seed: int = 0,
                    max_mbs: int = 64, jitter_draws: int = 0,
                    split_backward: SplitBackward = SplitBackward.OFF, offload: bool = False) -> dict[StaticKey, Planner]:
    """One planner per fixed configuration: packer (original or balanced) x every mbs pipetune may
    use (up to the largest any family's memory estimate allows) x each whole/split backward
    ``split_backward`` allows (each offloading where memory binds, with ``offload``), and on co-located layouts the balanced packer at mbs 1 with each of
    the pipetune planner's ``finer_counts`` as its fewest micro-batches; on interleaved layouts every size with each count ``Interleaved1F1B`` accepts up
    to ``STATIC_ROUNDS`` rounds as its fewest, on the separated layout with every count up to that
    (``jitter_draws``: predict expected times, as a jitter-aware planner they are compared with)."""
    probes = {}
    for split in (SplitBackward.ON if split else SplitBackward.OFF for split in SplitBackward(split_backward).families):
        try:
            probes[split] = PlannerConfig(mode=Mode.BALANCED, max_seq_len=max_seq_len, memory_bytes=memory_bytes, max_mbs=max_mbs,
                                          split_backward=split, offload=offload).build(model, cost)
        except ValueError:  # no micro-batch size of this family fits memory: a fixed configuration cannot run it
            continue
    if not probes:
        raise ValueError(f"no fixed configuration fits: not even one micro-batch of {max_seq_len} tokens fits in "
                         f"{memory_bytes / 2**30:.1f} GiB per GPU")
    splits = list(probes)
    sizes = range(1, max(probe.max_mbs for probe in probes.values()) + 1)  # pipetune's: a family may fit more than its estimate
    keys = [StaticKey(packer, size, 1, split, offload) for packer in (Mode.ORIGINAL, Mode.BALANCED) for split in splits for size in sizes]
    probe = next(iter(probes.values()))  # ranks, chunks and finer counts are the layout's, the same for every split
    P = probe.num_ranks
    if cost.layout.is_separated:
        counts = {(size, count) for size in sizes for count in range(2, STATIC_ROUNDS * P + 1)}
    else:
        counts = {(1, count) for count in probe.finer_counts}
        if probe.chunks_per_rank > 1:  # the counts torch's Interleaved1F1B runs: a whole number of equal rounds
            counts |= {(size, n) for size in sizes for n in range(P, STATIC_ROUNDS * P + 1) if n % (n // P) == 0}
    keys += [StaticKey(Mode.BALANCED, size, count, split, offload) for split in splits for size, count in sorted(counts)]
    planner_log = logging.getLogger(Planner.__module__)
    level = planner_log.level
    planner_log.setLevel(logging.ERROR)  # sizes over a family's full-row memory estimate are meant: each plan's memory is checked
    try:
        return {k: PlannerConfig(mode=k.packer, max_seq_len=max_seq_len, memory_bytes=memory_bytes, mbs=k.mbs, seed=seed,
                                 jitter_draws=jitter_draws, split_backward=k.split, min_micro_batches=k.min_micro_batches,
                                 offload=k.offload).build(model, cost)
                for k in keys}
    finally:
        planner_log.setLevel(level)


def pick_best_static(static: dict[StaticKey, Planner], rows: dict) -> StaticKey | None:
    """The configuration with the lowest mean simulated time over its planned ``rows`` among those
    whose plans all fit memory (None if none does)."""
    fits = {k: all(max(p.peak_bytes) <= static[k].budget for p in rows[k]) for k in static}
    means = {k: float(np.mean([p.predicted_s for p in rows[k]])) for k in static if fits[k]}
    return min(means, key=means.get) if means else None


def best_static_planner(model: ModelConfig, cost: CostModel, sample: list[BatchMeta], *, max_seq_len: int, memory_bytes: float,
                        seed: int = 0, max_mbs: int = 64, jitter_draws: int = 0,
                        split_backward: SplitBackward = SplitBackward.OFF, offload: bool = False) -> Planner:
    """The best fixed configuration on ``sample`` (batches drawn apart from the ones it will plan)."""
    static = static_planners(model, cost, max_seq_len=max_seq_len, memory_bytes=memory_bytes, seed=seed, max_mbs=max_mbs,
                             jitter_draws=jitter_draws, split_backward=split_backward, offload=offload)
    choice = pick_best_static(static, {k: [p.plan(meta) for meta in sample] for k, p in static.items()})
    if choice is None:
        raise ValueError(f"no fixed micro-batch size fits the sampled batches in {memory_bytes / 2**30:.1f} GiB")
    return static[choice]


def _summary(mode: str, plans, choice: str = "") -> ModeSummary:
    return ModeSummary(
        mode=mode,
        iter_s=np.array([p.predicted_s for p in plans]),
        lower_bound_s=np.array([p.lower_bound_s for p in plans]),
        search_s=np.array([p.search_s for p in plans]),
        mbs=Counter(p.mbs for p in plans),
        fallbacks=sum(p.fallback for p in plans),
        choice=choice,
    )
