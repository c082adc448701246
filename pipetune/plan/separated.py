"""The per-iteration planner on the separated layout (DIP): the same search as ``Planner``'s, with
greedy interleaved tables in place of 1F1B with encoder placement.

Per batch, in ``pipetune`` mode: every micro-batch size is balance-packed, its images split into
sub-microbatches (``pipetune.packing.sub_batches``) and scheduled by the dual-queue greedy
(``pipetune.plan.interleave``) in packing order under each rank's memory (budget minus the rank's
model states, so every candidate fits); the ``top_sizes`` fastest sizes then get the segment-order
search: the clustered micro-batch orders of ``pipetune.plan.ordering`` (the co-located
planner's, at most ``MAX_CLUSTERS`` clusters), each with the encoder running ``LEADS``
micro-batches ahead of the backbone, and the fastest table wins. Fixed-size modes mean what they
mean for ``Planner``.

Search size, measured on DIP's 5B + 8B (H100 estimate, TP 4, PP 4, GBS 128, DataMix3, four
batches, recomputed encoder): mean predicted iteration 2.999 / 2.998 / 2.989 / 2.987 s with 2 / 3
/ 4 / 5 clusters and no lead, 2.955 s with leads 0-2 at any cluster count, and no gain from leads
up to 6; search time grows about 3x per extra cluster. Hence 3 clusters and leads 0-2.

Segment order by cluster permutation rather than DIP's MCTS: DIP's observation that segments of
one micro-batch may share a priority leaves a permutation of micro-batches, which is what the
clustered orders already cover (balanced packing makes micro-batches alike, so few clusters
suffice), with a fixed, small number of greedy runs per size and a deterministic result.
``benchmarks/separated.py`` compares it with random orders given the same number of greedy runs.
"""

from __future__ import annotations

import numpy as np

from pipetune.cost.cost_model import MicroBatchShapes
from pipetune.data.batch import BatchMeta
from pipetune.packing.config import PackerKind, PackingConfig
from pipetune.plan.candidate import Candidate
from pipetune.plan.interleave import Interleaved, interleave, segment_priorities
from pipetune.plan.ordering import candidate_orders
from pipetune.plan.plan import IterationPlan, plan_from_table
from pipetune.plan.planner import Planner
from pipetune.schedule.table import ScheduleTable
from pipetune.simulate.lower_bound import placement_lower_bound
from pipetune.simulate.simulator import Latencies, simulate

LEADS = (0, 1, 2)
MAX_CLUSTERS = 3


class SeparatedPlanner(Planner):
    """``Planner`` for a cost model whose layout is separated (see the module doc)."""

    separated = True

    def _schedule(self, lat: Latencies, parent: tuple[int, ...], order, lead: int, *, limited: bool = True) -> Interleaved | None:
        pr, sub_pr = segment_priorities(order, parent, lead)
        limit = self.budget - self.states if limited else None
        return interleave(self.cost.placement(), parent, lat, pr, sub_pr, limit, name=f"separated lead {lead}")

    def _candidate(self, meta: BatchMeta, mbs: int, packer: PackerKind) -> Candidate:
        packing = PackingConfig(packer=packer, mbs=mbs, max_seq_len=self.config.max_seq_len, seed=self.config.seed).build(self.model)(
            meta.table.lengths, meta.step
        )
        costs = self.cost.stage_costs(MicroBatchShapes.from_packing(meta.table, packing))
        lat = Latencies.from_costs(costs)
        parent = tuple(costs.sub_batches.parent.tolist())
        identity = np.arange(packing.num_micro_batches)
        best = self._schedule(lat, parent, identity, 0)
        fits = best is not None
        best = best or self._schedule(lat, parent, identity, 0, limited=False)
        proto = ScheduleTable(placement=self.cost.placement(), num_micro_batches=packing.num_micro_batches, ranks=(),
                              sub_mb_parent=parent)
        c = Candidate(mbs, packing, lat, None, best.makespan, placement_lower_bound(proto, lat), fits)
        c.best_s, c.order, c.schedule = (best.makespan if fits else np.inf), identity, best
        return c

    def _improve(self, c: Candidate) -> None:
        """Segment orders (clustered micro-batch orders x encoder leads) for one packing, in place."""
        parent = c.schedule.table.sub_mb_parent
        for order in candidate_orders(c.lat, min(self.config.max_clusters, MAX_CLUSTERS), parent):
            for lead in LEADS:
                s = self._schedule(c.lat, parent, order, lead)
                if s is not None and s.makespan < c.best_s:
                    c.best_s, c.order, c.schedule = s.makespan, order, s

    def _to_plan(self, meta: BatchMeta, c: Candidate, search_s: float, *, lower_bound_s: float, fallback: bool = False) -> IterationPlan:
        ids = meta.table.ids
        return plan_from_table(
            c.schedule.table,
            step=meta.step,
            micro_batches=[ids[g] for g in c.packing.groups()],
            order=c.order,
            mbs=c.mbs,
            max_seq_len=self.config.max_seq_len,
            image_sub_batch=self.cost.layout.image_sub_batch,
            mode=self.config.mode,
            predicted_s=simulate(c.schedule.table, c.lat).makespan if c.lat.contention else c.schedule.makespan,
            lower_bound_s=lower_bound_s,
            peak_bytes=tuple(float(x) for x in c.schedule.peak_bytes + self.states),
            estimate=self.cost.table.estimate,
            search_s=search_s,
            fallback=fallback,
        )
