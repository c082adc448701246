"""The per-iteration planner on the separated layout (DIP).

Fixed-size modes (``original``, ``balanced``) mean what they mean for ``Planner``: one packing at
one micro-batch size, its micro-batches in packing order, scheduled by the dual-queue greedy
(``pipetune.plan.separated.interleave``) under each rank's memory (budget minus the rank's model states, so
every table fits), at the layout's image sub-microbatch size ``B``.

``reorder`` and ``pipetune`` run the joint search of ``pipetune.plan.separated.segment_search``: ``reorder``
over orders and encoder leads and lags at the fixed size and ``B``; ``pipetune`` also over every
micro-batch size that fits, over the counts of micro-batches between two sizes' (size ``k``'s
micro-batches spread over up to ``P`` more of them, fewer than size ``k - 1`` packs: DIP's 5B + 8B
without recomputation, DataMix3, size 2 packs a batch into 5 and size 1 into 10, and 6-8
micro-batches of at most 2 rows are often faster than both), and over ``B`` and ``B / 2`` per
batch (the plan carries its ``B``; the runtime pads each sub-microbatch to it).

The search's work is counted in greedy actions, so it does not grow with a batch's images (a
video batch's configuration holds 2,000-4,700 actions, DataMix3's about 250): it opens a
configuration (builds its greedy problem and scores its packing order) only while the
configuration's lower bound can beat the best table so far and ``OPENING`` actions last; scans the
opened ones fastest first and climbs (``CLIMB`` moves in each of the ``TOP_CONFIGURATIONS`` best)
while ``ACTIONS`` scheduled actions last; starts from the previous batch's choice, and past a
``deadline`` returns the best table found so far. The plan's lower bound is the smallest over
every configuration of the space, opened or not, so its gap says how far the plan is from
anything that search space allows (memory enters the bound only through its memory and window
terms). A configuration's bound is computed only as far as a decision needs: its busiest rank's
work first (microseconds; on a video batch most configurations stop there), then whether one
micro-batch fits alone, then ``placement_lower_bound`` (milliseconds).
"""

from __future__ import annotations

import time
from dataclasses import replace
from itertools import chain

import numpy as np

from pipetune.cost.cost_model import CostModel, MicroBatchShapes
from pipetune.data.batch import BatchMeta
from pipetune.packing.config import PackerKind, PackingConfig
from pipetune.plan.search.candidate import Candidate
from pipetune.plan.separated.interleave import Interleaved
from pipetune.plan.mode import Mode
from pipetune.plan.plan import IterationPlan, plan_from_table
from pipetune.plan.search.planner import Planner, past
from pipetune.plan.separated.segment_search import Budget, Configuration, bound, climb, configuration, open_configuration, scan, sub_batch_sizes
from pipetune.simulate.simulator import Latencies, simulate

ACTIONS = 40_000  # greedy actions a batch's scans and climbs may schedule: about 160 runs at DataMix3's 250 actions
OPENING = 10_000  # actions of the configurations a batch may open: all it may on DataMix2/3 and web documents, 3 on video
CLIMB = 40
TOP_CONFIGURATIONS = 2


class SeparatedPlanner(Planner):
    """``Planner`` for a cost model whose layout is separated (see the module doc)."""

    separated = True

    def __init__(self, config, model, cost: CostModel):
        super().__init__(config, model, cost)
        self._warm: tuple[int, int, int, int] | None = None  # the previous batch's (mbs, B, lead, lag)

    def _cost_for(self, B: int) -> CostModel:
        return self.cost if B == self.cost.layout.image_sub_batch else self.cost.with_layout(replace(self.cost.layout, image_sub_batch=B))

    def _packing(self, meta: BatchMeta, mbs: int, packer: PackerKind, count: int | None = None):
        """``meta``'s batch packed at ``mbs`` into at least ``count`` micro-batches (default: the
        configuration's ``min_micro_batches``)."""
        cfg = PackingConfig(packer=packer, mbs=mbs, max_seq_len=self.config.max_seq_len, seed=self.config.seed,
                            min_micro_batches=count or self.config.min_micro_batches)
        packing = cfg.build(self.model)(meta.table.lengths, meta.step)
        return packing, MicroBatchShapes.from_packing(meta.table, packing)

    def _candidate(self, meta: BatchMeta, mbs: int, packer: PackerKind) -> Candidate:
        """The packing order at lead 0 (the fixed-size modes' plan and the fallback)."""
        packing, shapes = self._packing(meta, mbs, packer)
        limit = self.budget - self.states
        c = open_configuration(configuration(self.cost, packing, shapes, mbs), limit)
        bound(c, limit)
        fits = c.base is not None
        best = c.base or c.problem.run(c.problem.point_keys(c.order, 0, 0))
        out = Candidate(mbs, packing, c.lat, None, best.makespan, c.lower_bound_s, fits)
        out.best_s, out.order, out.schedule = (best.makespan if fits else np.inf), c.order, best
        return out

    def configurations(self, meta: BatchMeta, sizes, *, adaptive: bool, bounded: bool = True) -> list[Configuration]:
        """The search's configurations of one batch (``segment_search``), not yet opened, with
        their lower bounds when ``bounded``: every size's packing and, after a size, its batch
        spread over each count of micro-batches between its own and the next smaller size's, at
        most ``P`` more than its own (module doc). A packing seen before is left out."""
        limit = self.budget - self.states
        configs: list[Configuration] = []
        packings = set()
        counts: dict[int, int] = {}
        for mbs in sizes:
            natural = self._packing(meta, mbs, PackerKind.BALANCED)
            counts[mbs] = natural[0].num_micro_batches
            more = range(counts[mbs] + 1, min(counts.get(mbs - 1, 0), counts[mbs] + self.num_ranks + 1))
            spread = (self._packing(meta, mbs, PackerKind.BALANCED, count) for count in more)
            for packing, shapes in chain([natural], spread):
                groups = tuple(map(tuple, packing.groups()))
                if groups in packings:
                    continue
                packings.add(groups)
                for B in sub_batch_sizes(self.cost.layout, adaptive):
                    configs.append(configuration(self._cost_for(B), packing, shapes, mbs))
        for c in configs if bounded else ():
            bound(c, limit)
        return configs

    def _plan(self, meta: BatchMeta, deadline: float | None) -> IterationPlan:
        mode = self.config.mode
        if mode not in (Mode.REORDER, Mode.PIPETUNE):
            return super()._plan(meta, deadline)
        t0 = time.perf_counter()
        sizes = range(1, self.max_mbs + 1) if mode is Mode.PIPETUNE else [self.fixed_mbs]
        limit = self.budget - self.states
        configs = self.configurations(meta, sizes, adaptive=mode is Mode.PIPETUNE, bounded=False)
        warm = self._warm
        first = lambda c: warm is not None and (c.mbs, c.image_sub_batch) == warm[:2]  # noqa: E731
        # Opened (problem built, packing order scored) only while the bound can beat the best so far
        # (a configuration left unopened has a bound, so a base, no faster than it: any order is
        # lossless) and ``OPENING`` actions last: the previous batch's choice first, then most
        # micro-batches first (under a tight memory limit, fewer and larger ones wait for memory).
        # Each bound is computed only as far as a decision needs (``enough``): whether it beats the
        # best so far, then, lowest first, whether it is the smallest over all configurations (the
        # plan's bound).
        best, opening = None, OPENING
        for c in sorted(configs, key=lambda c: (not first(c), -c.packing.num_micro_batches)):
            if opening <= 0 or best is not None and past(deadline) and np.isfinite(best.best_s):
                break
            beat = np.inf if best is None else self._score(best) / self._factor(c.mbs)
            if bound(c, limit, enough=beat) >= beat:
                continue
            open_configuration(c, limit)
            opening -= c.problem.num_actions
            best = c if best is None else min(best, c, key=self._score)
        low = np.inf
        for c in sorted(configs, key=lambda c: c.lower_bound_s):
            if c.lower_bound_s >= low:
                break
            low = min(low, bound(c, limit, enough=low))
        budget = Budget(ACTIONS, deadline)
        opened = sorted((c for c in configs if c.problem is not None), key=lambda c: (not first(c), self._score(c)))
        for c in opened:
            if np.isfinite(c.base_s) and self._may_beat(c, best):
                scan(c, limit, budget, warm=warm[2:] if first(c) else None)
                best = min(best, c, key=self._score)
        rng = np.random.default_rng((self.config.seed, meta.step))
        for c in sorted(opened, key=lambda c: (not first(c), self._score(c)))[:TOP_CONFIGURATIONS]:
            if np.isfinite(c.best_s) and self._may_beat(c, best):
                climb(c, limit, budget, rng, CLIMB)
                best = min(best, c, key=self._score)
        if not np.isfinite(best.best_s):
            if mode is Mode.PIPETUNE:
                raise ValueError(
                    f"step {meta.step}: no micro-batch size in 1..{self.max_mbs} fits this batch in "
                    f"{self.budget / 2**30:.1f} GiB per GPU (trained-encoder activations of its images); "
                    "lower --max-seq-len, recompute the encoder or add memory"
                )
            best.best = best.problem.run(best.problem.point_keys(best.order, 0, 0))
        self.last_mbs = best.mbs
        self._warm = (best.mbs, best.image_sub_batch, best.lead, best.lag)
        return self._table_plan(meta, best.packing, best.order, best.mbs, best.image_sub_batch, best.lat, best.best,
                                time.perf_counter() - t0, lower_bound_s=low)

    def _to_plan(self, meta: BatchMeta, c: Candidate, search_s: float, *, lower_bound_s: float, fallback: bool = False) -> IterationPlan:
        return self._table_plan(meta, c.packing, c.order, c.mbs, self.cost.layout.image_sub_batch, c.lat, c.schedule, search_s,
                                lower_bound_s=lower_bound_s, fallback=fallback)

    def _table_plan(self, meta: BatchMeta, packing, order, mbs: int, B: int, lat: Latencies, schedule: Interleaved, search_s: float, *,
                    lower_bound_s: float, fallback: bool = False) -> IterationPlan:
        ids = meta.table.ids
        return plan_from_table(
            schedule.table,
            step=meta.step,
            micro_batches=[ids[g] for g in packing.groups()],
            order=order,
            mbs=mbs,
            max_seq_len=self.config.max_seq_len,
            image_sub_batch=B,
            mode=self.config.mode,
            predicted_s=simulate(schedule.table, lat).makespan if lat.contention else schedule.makespan,
            lower_bound_s=lower_bound_s,
            peak_bytes=tuple(float(x) for x in schedule.peak_bytes + self.states),
            estimate=self.cost.table.estimate,
            search_s=search_s,
            fallback=fallback,
        )
