"""The per-iteration planner (PipeTune Sec. 4, App. A.5) and its ablation modes.

For one batch's metadata, ``pipetune`` mode:

1. candidate micro-batch sizes: ``1 .. max_mbs`` (the largest that fits memory, see
   ``pipetune.cost.memory``), unless fixed; when one-row micro-batches are fewer than ``P`` or
   ``2 P`` (``P`` pipeline ranks), the batch is also spread over that many micro-batches of at
   most one row (``finer_counts``; plans say mbs 1): a batch of few tokens otherwise leaves most of
   a deep pipeline idle, and the cost model prices what smaller micro-batches lose per token;
2. for each: balance-pack (Alg. 1), estimate stage latencies, time the packing order (the
   ``balanced`` plan at that size);
3. visit the ``top_sizes`` sizes whose packing order is fastest, best first; skip a size whose
   lower bound cannot beat the best plan so far; otherwise evaluate the cluster-permutation orders in one vectorised simulator call, take the
   ``top_orders`` best, give each encoder pre-computation placements (strict and overflowing gap
   filling; frozen encoders only), evaluate them with memory, and keep the fastest plan that fits
   in memory (every candidate's simulated peak, trained-encoder activations included, is checked);
4. return the best as an ``IterationPlan``, with the lower bound of every size searched (so the
   gap to it says how far the plan is from anything the search space allows).

Schedule families: with ``PlannerConfig.split_backward=auto`` every packing is timed on both the
1F1B table and its zero-bubble twin (backwards split into ``I`` and ``W``); orders are ranked on
the faster one and the best few re-timed on the other. The stage layout's ``chunks_per_rank``
makes both interleaved. Memory decides too: a family whose simulated peak does not fit is not
chosen. The cached zero-bubble tables place ``W`` by unit times; for the two best packings
(``TIME_WEIGHTED``), each one's best order gets a zero-bubble table rebuilt with ``W`` placed by the
batch's own latencies (uneven micro-batches leave bubbles where unit times see none), kept when
faster and within memory: the packing that is second on unit-time tables is often first once its
``W`` fill its own bubbles (DataMix1 at PP 8: 8 micro-batches beat 6). A batch of no more
micro-batches than ranks also gets tables whose last ranks leave their ``W`` to their end
(``LAZY_WEIGHTS_FROM``): their bubbles stay free for the input gradients the earlier ranks wait
for, as CP-SAT's tables for such batches do (DataMix1 at PP 8: plans 0.9 % faster on average).
The lower bound then holds for split tables (``placement_lower_bound`` of a split table).
Encoder pre-computation is searched on one chunk per rank only: on interleaved layouts the ``W``
and the later chunks leave rank 0 little idle time, and searching it changed mean plan times by at
most 0.006 % on 13B + SigLIP at PP 4 / 8 (DataMix1-3, 20 batches each) and not at all on DIP's
5B + 8B with a frozen encoder, while taking a fifth of the search time (trying it on the chosen
plan alone changed none of 80 plans).
On interleaved layouts, each size of 2 or more also packs the batch into the next multiple of
``P`` above its count when that stays below size 1's count (``_whole_rounds``): Megatron's
interleaved order runs micro-batches in rounds of ``P``, and a packing between the sizes' own
counts that fills whole rounds is often faster than both (DataMix3 at PP 8: 16 micro-batches
beat 12-13 at size 2 and 24-25 at size 1). Those packings are time-weighted in their packing
order, without the order search, which keeps the search within its budget; their bounds count
in the plan's lower bound like every packing searched. Size 2 is also packed into each count up
to ``P`` above its own and below size 1's (``_between_counts``), each timed in packing order on
the zero-bubble unit-time table (which ranks such counts as their time-weighted tables do), and
the fastest is time-weighted: DataMix3 at PP 8 then runs 20-21 micro-batches, 0.9 % faster than
the whole rounds' 16. Their bounds count too.

V-shaped layouts (``StageLayout.style``) get the same families on their placement, and their
time-weighted step also times torch's ZB-V and DualPipeV tables of the order (``torch_v_tables``).

Activation offload (``PlannerConfig.offload``): a family's table that does not fit memory gets
offloads (``offload_choice.offload_to_fit``) when it could still beat the plan so far, sizes go up
to what fits with two micro-batches' activations per rank, and the packings that offload and those
that do not get their order search and time-weighting apart (``_top``).

Modes (the paper's ablation): ``original`` = random first-fit packing at the fixed maximum mbs in
packing order; ``balanced`` = Alg. 1 at that mbs; ``reorder`` = ``balanced`` + ordering and
pre-computation; ``pipetune`` = ``reorder`` + adaptive mbs. Every searched mode includes its
``balanced`` plan among the candidates, so it is never slower in simulation.

Jitter (``jitter_draws`` > 0, and a latency table with a variability model): every candidate
(packing order, orders, encoder placements) is scored by its expected makespan over that many
draws of per-action noise (``pipetune.simulate.jitter``; the same draws for every candidate of a
packing, seeded by the planner's seed and the step), so the search prefers plans whose advantage
survives noise; memory is checked on the deterministic peak. The expected makespan is never below
the deterministic one, so the lower bounds still prune. ``jitter_draws=0`` is the deterministic
search.

Time budget: with a ``deadline`` the search stops when it passes one and returns the balanced plan
at the last good mbs (the previous plan's), flagged ``fallback``. The search is deterministic:
same seed, same metadata, same plans (as long as no deadline hits).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from pipetune.config.model import ModelConfig
from pipetune.cost.cost_model import CostModel, MicroBatchShapes
from pipetune.cost.memory import max_micro_batch_size, model_state_bytes
from pipetune.data.batch import BatchMeta
from pipetune.packing.config import PackerKind, PackingConfig
from pipetune.plan.search.candidate import Candidate
from pipetune.plan.mode import Mode
from pipetune.plan.search.offload_choice import offload_to_fit
from pipetune.plan.search.ordering import candidate_orders
from pipetune.plan.plan import IterationPlan, plan_from_table
from pipetune.plan.search.precompute import move_encoders_into_gaps
from pipetune.schedule.schedules import in_order, list_scheduled, place_encoders, torch_v_tables
from pipetune.schedule.table import ChunkStyle
from pipetune.simulate.dag import CompiledSchedule, compile_schedule
from pipetune.simulate.jitter import JitteredLatencies, expected_makespan, jitter
from pipetune.simulate.lower_bound import makespan_lower_bound, placement_lower_bound
from pipetune.simulate.simulator import Latencies, evaluate, split_times

if TYPE_CHECKING:
    from pipetune.plan.layout.planner_config import PlannerConfig

log = logging.getLogger(__name__)
PRECOMPUTE_OVERFLOWS = np.array([0.0, 0.5])
TIME_WEIGHTED = 2  # packings whose best order gets a zero-bubble table placed by the batch's own latencies
LAZY_WEIGHTS_FROM = (0.625, 0.75)  # of the ranks: where W may stop filling bubbles (best at PP 8 on DataMix1: ranks 5, 6)


def past(deadline: float | None) -> bool:
    """Whether ``deadline`` (``time.perf_counter()`` seconds; None: none) has passed."""
    return deadline is not None and time.perf_counter() > deadline


class Planner:
    """Plans iterations for one model, cost model and configuration (co-located layout; the
    separated layout's ``SeparatedPlanner`` overrides how a candidate is scheduled and improved).

    ``set_cost`` swaps in a recalibrated cost model between plans (thread-safe: a plan is made
    with one cost model throughout).
    """

    separated = False

    def __init__(self, config: PlannerConfig, model: ModelConfig, cost: CostModel):
        if cost.layout.is_separated != self.separated:
            raise ValueError(f"{type(self).__name__} plans the {'separated' if self.separated else 'co-located'} layout; "
                             "build planners with PlannerConfig.build, which picks the one for the layout")
        self.config = config
        self.model = model
        self.cost = cost
        self.states = model_state_bytes(cost)
        self.budget = config.memory_bytes * (1 - config.reserve)
        fit = max(max_micro_batch_size(cost, config.max_seq_len, config.memory_bytes, reserve=config.reserve, limit=config.max_mbs,
                                       split_backward=split, in_flight=2 if config.offload else None)
                  for split in config.split_backward.families)
        if fit == 0:
            raise ValueError(
                f"no micro-batch size fits: model states need up to {self.states.max() / 2**30:.1f} GiB per GPU and "
                f"one micro-batch of {config.max_seq_len} tokens does not fit in {self.budget / 2**30:.1f} GiB"
            )
        if config.mbs is not None and config.mbs > fit:
            log.warning("mbs=%d exceeds the memory estimate's maximum of %d; using it as asked", config.mbs, fit)
        self.max_mbs = fit
        self.fixed_mbs = config.mbs or fit
        self.last_mbs = self.fixed_mbs
        self._dags: dict[tuple[int, bool], CompiledSchedule] = {}
        self.encoder = model.encoder is not None
        self.families = config.split_backward.families
        self.chunks_per_rank = cost.placement().chunks_per_rank
        self.num_ranks = cost.num_stages // self.chunks_per_rank
        # frozen encoders' pre-computation, on one chunk per rank (module doc)
        self.precompute = self.encoder and config.precompute and not cost.encoder_trainable and self.chunks_per_rank == 1
        self.finer_counts = (self.num_ranks, 2 * self.num_ranks)  # micro-batch counts a batch of few tokens is also spread over
        self.room = self.budget - self.states  # bytes of activations each rank may hold
        self.correction: dict[int, float] = {}
        self._lock = threading.Lock()

    def set_cost(self, cost: CostModel) -> None:
        """Use ``cost`` from the next plan on (same model and stage layout; memory is not re-derived)."""
        if cost.layout != self.cost.layout or cost.table.model != self.cost.table.model:
            raise ValueError("set_cost needs a cost model of the same model and stage layout")
        with self._lock:
            self.cost = cost

    def set_correction(self, factors: Mapping[int, float]) -> None:
        """From the next plan on, compare micro-batch sizes by their simulated time times
        ``factors[mbs]`` (``pipetune.calibrate.correction``; sizes not given: 1). Plans still report
        the uncorrected simulated time as ``predicted_s``."""
        with self._lock:
            self.correction = dict(factors)

    def _factor(self, mbs: int) -> float:
        return self.correction.get(mbs, 1.0)

    def _score(self, c: Candidate) -> float:
        return c.best_s * self._factor(c.mbs)

    def _may_beat(self, c: Candidate, best: Candidate) -> bool:
        """Whether ``c``'s lower bound leaves it a chance against ``best`` (else its search is skipped)."""
        return c.lower_bound_s * self._factor(c.mbs) < self._score(best)

    def _dag(self, m: int, split_backward: bool) -> CompiledSchedule:
        key = (m, split_backward)
        if key not in self._dags:
            table = self.config.schedule.build(self.cost.num_stages, range(m), encoder=self.encoder,
                                               encoder_trained=self.cost.encoder_trainable, chunks_per_rank=self.chunks_per_rank,
                                               split_backward=split_backward, style=self.cost.layout.style)
            self._dags[key] = compile_schedule(table, validate=False)
        return self._dags[key]

    def _candidate(self, meta: BatchMeta, mbs: int, packer: PackerKind, min_micro_batches: int | None = None, *,
                   families: tuple[bool, ...] | None = None, bound_above: float = np.inf, offload_within: float = np.inf) -> Candidate:
        """One packing timed in its packing order on each of ``families`` (default: the planner's).
        Its lower bound is exact unless a cheaper one (the co-located bound, else the first terms of
        the exact one) already reaches ``bound_above``: then that one, since the packing cannot lower
        a plan's bound of ``bound_above``. With offload, a family's table that does not fit gets
        offloads only if its makespan is under ``offload_within`` and the fitting families' (copies
        only add constraints, so they cannot make it faster)."""
        lengths = meta.table.lengths
        packing = PackingConfig(packer=packer, mbs=mbs, max_seq_len=self.config.max_seq_len, seed=self.config.seed,
                                min_micro_batches=min_micro_batches or self.config.min_micro_batches).build(self.model)(lengths, meta.step)
        lat = Latencies.from_costs(self.cost.stage_costs(MicroBatchShapes.from_packing(meta.table, packing)))
        identity = np.arange(packing.num_micro_batches)
        draws, variability = self.config.jitter_draws, self.cost.table.variability
        noisy = jitter(lat, variability, draws, (self.config.seed, meta.step)) if draws and variability else None
        timed = []
        for split in families or self.families:
            dag = self._dag(packing.num_micro_batches, split)
            span, fits = self._evaluate(dag, lat, noisy, identity[None])
            if not fits[0] and self.config.offload and span[0] < min([offload_within] + [t[1] for t in timed if not t[0]]):
                dag, span, fits = self._offloaded(dag, lat, noisy, identity)
            timed.append((not fits[0], float(span[0]), dag))
        unfit, span, dag = min(timed, key=lambda t: t[:2])
        cheap = makespan_lower_bound(lat, self.cost.placement(), split_backward=True in self.families) if bound_above < np.inf else -np.inf
        bound = cheap if cheap >= bound_above else self._lower_bound(lat, enough=bound_above)
        c = Candidate(mbs, packing, lat, dag, span, bound, not unfit, noisy)
        c.best_s, c.order, c.slots = (c.base_s if c.fits else np.inf), identity, dag.float_slot.copy()
        return c

    def _top(self, ranked: list[Candidate], k: int) -> list[Candidate]:
        """The first ``k`` of ``ranked``; with offload, the first ``k`` of those that fit without
        copies and the first ``k`` of those that offload, so the second do not crowd out the first."""
        if not self.config.offload:
            return ranked[:k]
        return [c for c in ranked if not c.dag.has_copies][:k] + [c for c in ranked if c.dag.has_copies][:k]

    def _offloaded(self, dag: CompiledSchedule, lat: Latencies, noisy: JitteredLatencies | None, order: np.ndarray):
        """``dag``'s table with offloads until it fits (``offload_to_fit``), compiled, with its
        makespan and fit for ``order``; ``dag`` itself, unfit, when it cannot be made to fit."""
        table = offload_to_fit(dag.table, lat, order, self.room)
        if table is not None:
            dag = compile_schedule(table, validate=False)
        span, fits = self._evaluate(dag, lat, noisy, order[None])
        return dag, span, fits

    def _whole_rounds(self, meta: BatchMeta, cands: list[Candidate]) -> list[Candidate]:
        """Interleaved layouts: packings into a whole number of rounds of the ranks between the
        micro-batch counts of size 1 and of the larger sizes, each at the smallest size that packs it."""
        if self.chunks_per_rank == 1:
            return []
        P, most = self.num_ranks, cands[0].packing.num_micro_batches
        fewest: dict[int, int] = {}
        for c in cands:
            count = (c.packing.num_micro_batches // P + 1) * P
            if c.mbs > 1 and count < most:
                fewest.setdefault(count, c.mbs)
        return [self._candidate(meta, mbs, PackerKind.BALANCED, count) for count, mbs in sorted(fewest.items())]

    def _between_counts(self, meta: BatchMeta, cands: list[Candidate]) -> Candidate | None:
        """Interleaved layouts: the batch packed at size 2 into every count above size 2's own and
        below size 1's (at most ``P`` more; ``cands`` starts with those two sizes' packings; counts
        packed already are skipped), each timed in its packing order on the zero-bubble unit-time
        table and kept in ``cands``; the fastest of them (None if none)."""
        if self.chunks_per_rank == 1 or True not in self.families or self.max_mbs < 2:
            return None
        have = {c.packing.num_micro_batches for c in cands}
        floor = min(c.lower_bound_s for c in cands)
        two, most = cands[1].packing.num_micro_batches, cands[0].packing.num_micro_batches
        screened = [self._candidate(meta, 2, PackerKind.BALANCED, count, families=(True,), bound_above=floor)
                    for count in range(two + 1, min(most, two + self.num_ranks + 1)) if count not in have]
        cands += screened
        return min(screened, key=self._score, default=None)

    def _lower_bound(self, lat: Latencies, *, enough: float = np.inf) -> float:
        """A bound on every table the planner may choose for these latencies (a split table's bound
        holds for whole backwards too); with ``enough``, any bound that reaches it."""
        return placement_lower_bound(self._dag(lat.fwd.shape[0], True in self.families).table, lat, enough=enough)

    def _fits(self, peaks: np.ndarray) -> np.ndarray:
        return ((peaks + self.states[None, :]) <= self.budget).all(axis=1)

    def _evaluate(self, dag: CompiledSchedule, lat: Latencies, noisy: JitteredLatencies | None, orders: np.ndarray,
                  slots: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Makespan of candidate orders / placements (expected over ``noisy``'s draws when given) and
        whether each fits in memory (deterministic peak)."""
        res = evaluate(dag, lat, orders, slots, memory=True)
        span = res.makespan if noisy is None else expected_makespan(dag, noisy, orders, slots)
        return span, self._fits(res.peak_bytes)

    def _improve(self, c: Candidate) -> None:
        """Search orders and encoder placements for one packing (in place): orders are ranked on the
        candidate's schedule family, and the best few are also timed on the other families."""
        orders = candidate_orders(c.lat, self.config.max_clusters)
        span, fits = self._evaluate(c.dag, c.lat, c.noisy, orders)
        span = np.where(fits, span, np.inf)
        keep = np.argsort(span, kind="stable")[: self.config.top_orders]
        ranked_on = c.dag
        for split in self.families:
            dag = self._dag(c.packing.num_micro_batches, split)
            cands, slots, spans = orders[keep], np.tile(dag.float_slot, (len(keep), 1)), span[keep]
            if dag is not ranked_on:
                other, fits = self._evaluate(dag, c.lat, c.noisy, cands)
                spans = np.where(fits, other, np.inf)
            if self.precompute:
                moved_orders = np.repeat(cands, len(PRECOMPUTE_OVERFLOWS), axis=0)
                overflows = np.tile(PRECOMPUTE_OVERFLOWS, len(keep))
                moved = move_encoders_into_gaps(dag, c.lat, moved_orders, overflows)
                moved_span, fits = self._evaluate(dag, c.lat, c.noisy, moved_orders, moved)
                cands = np.vstack([cands, moved_orders])
                slots = np.vstack([slots, moved])
                spans = np.concatenate([spans, np.where(fits, moved_span, np.inf)])
            k = int(np.argmin(spans))
            if spans[k] < c.best_s:
                c.best_s, c.order, c.slots, c.dag = float(spans[k]), cands[k], slots[k], dag

    def _time_weights(self, c: Candidate, best: Candidate) -> None:
        """Try the zero-bubble table of ``c``'s order with its ``W`` placed by this batch's latencies
        (``list_scheduled``'s ``times``; the cached tables place them by unit times, which
        misses the bubbles of uneven micro-batches), with and without encoder pre-computation.
        Done for the ``TIME_WEIGHTED`` best packings only: each compiles a table of its own. With
        no more micro-batches than ranks, also with the ``W`` of the last ranks left to their end
        (``list_scheduled``'s ``lazy_weights_from``, from each of ``LAZY_WEIGHTS_FROM`` x ranks).
        ``c`` only matters if it beats ``best`` (the plan so far, possibly ``c``): without
        pre-computation, a table whose own run cannot is not built (``list_scheduled``'s ``within``).
        On V-shaped layouts torch's own tables of the order are tried too (``torch_v_tables``: ZB-V,
        DualPipeV), so a plan is never slower than what TorchTitan would run on the same packing."""
        order, within = c.order, self._score(best) / self._factor(c.mbs)
        lat, m, V, P = c.lat, len(order), self.chunks_per_rank, self.num_ranks
        times = split_times(lat, order, encoder=self.encoder, encoder_trained=self.cost.encoder_trainable)
        lazy = sorted({int(f * P) for f in LAZY_WEIGHTS_FROM} - {0, P}) if m <= P else []
        trained, style = self.cost.encoder_trainable, self.cost.layout.style
        tables = itertools.chain(
            (list_scheduled(P, V, range(m), split_backward=True, encoder=self.encoder, encoder_trained=trained, times=times,
                            p2p=lat.p2p[order], lazy_weights_from=lazy_from, within=np.inf if self.precompute else min(within, c.best_s),
                            style=style) for lazy_from in (None, *lazy)),
            torch_v_tables(P, range(m), encoder=self.encoder, encoder_trained=trained) if style is ChunkStyle.V else ())
        for table in tables:
            if table is None:
                continue
            dag = compile_schedule(table, validate=False)
            slots = dag.float_slot[None]
            if self.config.offload:
                span, fits = self._evaluate(dag, lat, c.noisy, order[None])
                if not fits[0] and span[0] < c.best_s:
                    dag = self._offloaded(dag, lat, c.noisy, order)[0]
                    slots = dag.float_slot[None]
            if self.precompute:
                slots = np.vstack([slots, move_encoders_into_gaps(dag, lat, np.tile(order, (len(PRECOMPUTE_OVERFLOWS), 1)),
                                                                  PRECOMPUTE_OVERFLOWS)])
            spans, fits = self._evaluate(dag, lat, c.noisy, np.tile(order, (len(slots), 1)), slots)
            spans = np.where(fits, spans, np.inf)
            k = int(np.argmin(spans))
            if spans[k] < c.best_s:
                c.best_s, c.order, c.slots, c.dag = float(spans[k]), order, slots[k], dag

    def plan(self, meta: BatchMeta, *, deadline: float | None = None) -> IterationPlan:
        """The plan for one batch; past ``deadline`` (``time.perf_counter()`` seconds) the fallback."""
        with self._lock:
            return self._plan(meta, deadline)

    def _plan(self, meta: BatchMeta, deadline: float | None) -> IterationPlan:
        t0 = time.perf_counter()
        mode = self.config.mode
        if mode is Mode.ORIGINAL:
            cands = [self._candidate(meta, self.fixed_mbs, PackerKind.ORIGINAL)]
            best = cands[0]
        else:
            sizes = range(1, self.max_mbs + 1) if mode is Mode.PIPETUNE else [self.fixed_mbs]
            cands = []
            for mbs in sizes:
                if past(deadline):
                    return self._fallback(meta, t0)
                within = {"offload_within": min((c.best_s for c in cands), default=np.inf)} if self.config.offload else {}
                cands.append(self._candidate(meta, mbs, PackerKind.BALANCED, **within))  # (the separated planner never offloads)
            if mode is Mode.PIPETUNE:
                fewest = cands[0].packing.num_micro_batches
                for count in self.finer_counts:
                    if fewest < count <= len(meta.table.lengths):
                        cands.append(self._candidate(meta, 1, PackerKind.BALANCED, count))
            best = min(cands, key=self._score)
            if mode in (Mode.REORDER, Mode.PIPETUNE):
                searched = {id(best): best}  # the packings searched, each once
                for c in self._top(sorted(cands, key=lambda c: c.base_s * self._factor(c.mbs)), self.config.top_sizes):
                    if not self._may_beat(c, best):
                        continue
                    if past(deadline):
                        return self._fallback(meta, t0)
                    self._improve(c)
                    searched[id(c)] = c
                    if self._score(c) < self._score(best):
                        best = c
                if mode is Mode.PIPETUNE and not past(deadline):
                    rounds = self._whole_rounds(meta, cands)
                    cands += rounds
                    for c in [*rounds, self._between_counts(meta, cands)]:
                        if c is None:
                            continue
                        if True in self.families and self._may_beat(c, best):
                            self._time_weights(c, best)
                        if self._score(c) < self._score(best):
                            best = c
                if True in self.families:
                    for c in self._top(sorted(searched.values(), key=self._score), TIME_WEIGHTED):
                        if past(deadline) or (c is not best and not self._may_beat(c, best)):
                            continue
                        self._time_weights(c, best)
                        if self._score(c) < self._score(best):
                            best = c
            if mode is Mode.PIPETUNE and not np.isfinite(best.best_s):
                raise ValueError(
                    f"step {meta.step}: no micro-batch size in 1..{self.max_mbs} fits this batch in "
                    f"{self.budget / 2**30:.1f} GiB per GPU (trained-encoder activations of its images); "
                    "lower --max-seq-len, recompute the encoder or add memory"
                )
        self.last_mbs = best.mbs
        bound = min(c.lower_bound_s for c in cands) if mode is Mode.PIPETUNE else best.lower_bound_s
        return self._to_plan(meta, best, time.perf_counter() - t0, lower_bound_s=bound)

    def fallback(self, meta: BatchMeta, why: str) -> IterationPlan:
        """The plan a step runs when its search cannot be had (``why``, logged): the balanced
        packing at the last good micro-batch size, flagged ``fallback``."""
        with self._lock:
            return self._fallback(meta, time.perf_counter(), why)

    def _fallback(self, meta: BatchMeta, t0: float, why: str = "planning exceeded its time budget") -> IterationPlan:
        c = self._candidate(meta, self.last_mbs, PackerKind.BALANCED)
        log.warning("step %d: %s; using the balanced plan at mbs=%d", meta.step, why, c.mbs)
        return self._to_plan(meta, c, time.perf_counter() - t0, lower_bound_s=c.lower_bound_s, fallback=True)

    def _to_plan(self, meta: BatchMeta, c: Candidate, search_s: float, *, lower_bound_s: float, fallback: bool = False) -> IterationPlan:
        order = [int(x) for x in c.order]
        pos = c.dag.rank_position()
        moved = {order[k]: int(pos[s]) for k, s in enumerate(c.slots) if s != c.dag.float_slot[k]}
        peak = evaluate(c.dag, c.lat, c.order[None], c.slots[None], memory=True).peak_bytes[0]
        ids = meta.table.ids
        table = in_order(c.dag.table, order)
        if moved:
            table = place_encoders(table, moved, validate=False)  # the plan is validated before it runs
        return plan_from_table(
            table,
            step=meta.step,
            mode=self.config.mode,
            mbs=c.mbs,
            max_seq_len=self.config.max_seq_len,
            micro_batches=[ids[g] for g in c.packing.groups()],
            order=order,
            predicted_s=c.best_s if np.isfinite(c.best_s) else c.base_s,
            lower_bound_s=lower_bound_s,
            peak_bytes=tuple(float(x) for x in peak + self.states),
            estimate=self.cost.table.estimate,
            search_s=search_s,
            fallback=fallback,
        )
