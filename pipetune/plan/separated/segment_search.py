"""Joint per-iteration search on the separated layout (DIP): micro-batch size, image
sub-microbatch size, micro-batch order and the encoder's lead and lag, each candidate scored by the
dual-queue greedy (``pipetune.plan.separated.interleave``) under each rank's memory limit.

A *configuration* is one micro-batch size and one image sub-microbatch size ``B``: its balanced
packing, its latencies, the greedy's ``Problem`` and the lower bound of any table over it
(``pipetune.simulate.lower_bound.placement_lower_bound``). A *point* in one configuration is a
micro-batch order, a lead (encoder forwards run that many micro-batches ahead of the backbone) and
a lag (encoder backwards rank that many micro-batches behind it; ``Problem.point_keys``): DIP's
segment priorities (DIP Sec. 5.1), with a micro-batch's encoder forward and backward segments
placed apart.

Search, per batch:

1. configurations opened (``open_configuration``), each scored in packing order at lead and lag 0
   (its ``balanced`` plan), where their bound can beat the best table so far (the caller's order
   and cap: ``SeparatedPlanner``);
2. a scan: in every opened configuration whose lower bound can still beat the best table so far,
   fastest first, the packing order and both latency-sorted orders at every lead, each with the
   largest lag (encoder backwards fill the backbone's gaps) and with ``lag = -lead`` (one priority
   per micro-batch and modality, as DIP); the previous batch's lead and lag first (a warm start);
3. hill climbing in the configurations whose best is fastest after the scan (the previous batch's
   choice among them): random moves (one micro-batch moved to another position, two swapped, the
   lead or the lag changed by one), a move kept when its table is faster;
4. it stops when the moves are done, or when its greedy work is spent (``Budget``, counted in
   scheduled actions: deterministic), or past a wall-clock deadline (anytime: the best table so far).

A greedy run that cannot beat its configuration's best is cut short (``Problem.run_fitting``'s
``within``).

Why hill climbing and not DIP's MCTS: at GBS 128 a configuration holds 2-20 micro-batches, and one
greedy run costs about 1 ms in Python, so a plan affords a few hundred runs; MCTS with random
rollouts needs far more to rank its subtrees. Measured (``benchmarks/separated.py --audit``):
enumerating every order, lead and lag of every configuration of up to 5 micro-batches (and a 20x
longer climb in larger ones) finds no faster plan on the heavy-encoder presets, and at most 0.33 %
on 13B; random per-action priorities (20 s per configuration) and CP-SAT on the raw scheduling
problem (60 s) found nothing faster than this space's best either (docs/benchmarks.md). So what
remains of the gap to the lower bound is the bound's, or outside the greedy's tables.

Memory: every point is run by ``Problem.run_fitting``: the greedy without admission, kept when its
table's peak fits each rank's limit, else the greedy that admits a micro-batch only when its forward
memory fits on every rank (which also rejects orders whose real peak fits: on DIP's 5B + 8B without
recompute, 0.2-0.3 points of the gap to the bound). Every table fits each rank's limit, and a
configuration with no fitting table has none.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from pipetune.cost.cost_model import CostModel, MicroBatchShapes, rank_work
from pipetune.cost.stage_layout import StageLayout
from pipetune.packing.groups import Packing
from pipetune.plan.separated.interleave import Interleaved, Problem
from pipetune.schedule.table import Placement, ScheduleTable
from pipetune.simulate.lower_bound import placement_lower_bound
from pipetune.simulate.simulator import Latencies

LEADS = (0, 1, 2, 3)


@dataclass
class Configuration:
    """One micro-batch size and image sub-microbatch size for one batch, with its best point so far."""

    mbs: int
    image_sub_batch: int
    packing: Packing
    lat: Latencies
    placement: Placement
    parent: tuple[int, ...]  # each sub-microbatch's micro-batch
    # of any table over it: its busiest rank's work (``placement_lower_bound`` never falls below it)
    # until ``bound`` raises it; at microseconds, it spares most of a video batch's configurations
    # their whole bound (milliseconds each) where a search only needs the bound to reach a value
    lower_bound_s: float = 0.0
    exact: bool = False  # ``lower_bound_s`` is the whole ``placement_lower_bound``
    problem: Problem | None = None  # built by ``open_configuration``
    base: Interleaved | None = None  # packing order, lead 0, lag 0
    best: Interleaved | None = None
    order: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    lead: int = 0
    lag: int = 0

    @property
    def best_s(self) -> float:
        return self.best.makespan if self.best is not None else np.inf

    @property
    def base_s(self) -> float:
        return self.base.makespan if self.base is not None else np.inf

    @property
    def lags(self) -> tuple[int, int]:
        """The range of useful lags: ``lag >= m`` puts every encoder backward after all backbone work."""
        return -LEADS[-1], self.packing.num_micro_batches

    def point(self) -> tuple:
        return tuple(self.order.tolist()), self.lead, self.lag


def configuration(cost: CostModel, packing: Packing, shapes: MicroBatchShapes, mbs: int) -> Configuration:
    """``packing`` under ``cost``'s layout (its ``image_sub_batch``), not yet bounded (``bound``)
    nor scored (``open_configuration``): a search does either only where it needs to, since on a
    batch of thousands of images each costs tens of milliseconds."""
    costs = cost.stage_costs(shapes)
    parent = tuple(costs.sub_batches.parent.tolist())
    lat, placement = Latencies.from_costs(costs), cost.placement()
    return Configuration(mbs, cost.layout.image_sub_batch, packing, lat, placement, parent, float(rank_work(placement, lat).max()),
                         order=np.arange(packing.num_micro_batches))


def alone(placement: Placement, parent: tuple[int, ...], lat: Latencies) -> np.ndarray:
    """The most forward memory one micro-batch (with its images) holds on each rank: all of it is
    live before its first backward there (which waits for all its forwards), so a limit below it
    on any rank admits no table (``placement_lower_bound`` finds that last, after its time terms)."""
    m, R = lat.fwd.shape[0], placement.num_ranks
    need = np.zeros((m, R))
    np.add.at(need.T, np.asarray(placement.backbone), lat.activation_bytes.T)
    j = np.asarray(parent, np.int64)
    np.add.at(need[:, placement.backbone[0]], j, lat.image_feature_bytes)
    if placement.encoder_trained:
        for c, r in enumerate(placement.encoder):
            np.add.at(need[:, r], j, lat.encoder_activation_bytes[:, c])
    return need.max(axis=0)


def bound(c: Configuration, limit: np.ndarray, *, enough: float = np.inf) -> float:
    """Raise ``c.lower_bound_s`` to ``placement_lower_bound`` of its tables under ``limit``; with
    ``enough``, only as far as needed to reach it (still a bound). Returns the bound."""
    if c.exact or c.lower_bound_s >= enough:
        return c.lower_bound_s
    if (alone(c.placement, c.parent, c.lat) > limit).any():
        c.lower_bound_s, c.exact = np.inf, True
        return c.lower_bound_s
    proto = ScheduleTable(placement=c.placement, num_micro_batches=c.packing.num_micro_batches, ranks=(), sub_mb_parent=c.parent)
    b = placement_lower_bound(proto, c.lat, limit, enough=enough)
    c.exact = b < enough  # no term reached ``enough``: every term was computed
    c.lower_bound_s = max(c.lower_bound_s, b)
    return c.lower_bound_s


def open_configuration(c: Configuration, limit: np.ndarray) -> Configuration:
    """``c`` with its ``Problem``, scored in packing order at lead and lag 0 (its base), in place."""
    if c.problem is None:
        c.problem = Problem(c.placement, c.parent, c.lat, name=f"separated B={c.image_sub_batch}")
        c.base = c.best = c.problem.run_fitting(c.problem.point_keys(c.order, 0, 0), limit)
    return c


def sub_batch_sizes(layout: StageLayout, adaptive: bool) -> tuple[int, ...]:
    """The partitioner's ``B`` and, when ``adaptive``, half of it: smaller sub-microbatches pad less
    and pipeline finer, at some loss of encoder throughput (the partitioner's 95 % rule), which the
    greedy's makespan weighs per batch."""
    B = layout.image_sub_batch
    return (B, (B + 1) // 2) if adaptive and B > 1 else (B,)


class Budget:
    """Greedy work left, in scheduled actions (a run of a configuration is charged all its
    actions, so the search's cost does not grow with a batch's images), and a wall-clock deadline
    (``time.perf_counter()`` seconds, or None)."""

    def __init__(self, actions: int, deadline: float | None):
        self.left = actions
        self.deadline = deadline

    def spend(self, actions: int) -> bool:
        """Take one run of ``actions``; False when the work is spent or the deadline has passed."""
        if self.left <= 0 or (self.deadline is not None and time.perf_counter() > self.deadline):
            return False
        self.left -= actions
        return True


def scan(c: Configuration, limit: np.ndarray, budget: Budget, *, warm: tuple[int, int] | None = None) -> None:
    """Step 2 of the module doc on ``c``, in place (``warm``: the previous batch's lead and lag, tried first)."""
    m = c.packing.num_micro_batches
    parent = np.asarray(c.parent, np.int64)
    work = (c.lat.fwd + c.lat.bwd).sum(axis=1) + np.bincount(parent, weights=c.lat.encoder.sum(axis=1), minlength=m)
    longest = np.lexsort((np.arange(m), -work))
    lo, hi = c.lags
    shifts = [(lead, lag) for lag in (hi, None) for lead in LEADS]
    if warm is not None:
        shifts.insert(0, (warm[0], int(np.clip(warm[1], lo, hi))))
    seen = {c.point()}
    for order in (np.arange(m), longest, longest[::-1]):
        for lead, lag in shifts:
            if not _visit(c, (tuple(order.tolist()), lead, -lead if lag is None else lag), seen, budget, limit):
                return


def climb(c: Configuration, limit: np.ndarray, budget: Budget, rng: np.random.Generator, moves: int) -> None:
    """Step 3 of the module doc on ``c``, in place: up to ``moves`` moves from its best point."""
    m = c.packing.num_micro_batches
    lo, hi = c.lags
    seen = {c.point()}
    for _ in range(moves):
        order, lead, lag = list(c.order.tolist()), c.lead, c.lag
        move = rng.integers(4) if m > 1 else 2 + rng.integers(2)
        if move == 0:
            i, j = rng.choice(m, 2, replace=False)
            order.insert(j, order.pop(i))
        elif move == 1:
            i, j = rng.choice(m, 2, replace=False)
            order[i], order[j] = order[j], order[i]
        elif move == 2:
            lead = int(np.clip(lead + rng.choice((-1, 1)), LEADS[0], LEADS[-1]))
        else:
            lag = int(np.clip(lag + rng.choice((-1, 1)), lo, hi))
        if not _visit(c, (tuple(order), lead, lag), seen, budget, limit):
            return


def _visit(c: Configuration, point: tuple, seen: set, budget: Budget, limit: np.ndarray) -> bool:
    """Try ``point`` unless already seen; False once the budget is spent (the caller stops)."""
    if point in seen:
        return True
    if not budget.spend(c.problem.num_actions):
        return False
    seen.add(point)
    _try(c, *point, limit)
    return True


def _try(c: Configuration, order: tuple, lead: int, lag: int, limit: np.ndarray) -> None:
    """Run the greedy on one point; keep it in ``c`` when it is faster (a run that cannot be is cut short)."""
    g = c.problem.run_fitting(c.problem.point_keys(order, lead, lag), limit, within=c.best_s - 1e-12)
    if g is not None and g.makespan < c.best_s - 1e-12:
        c.best, c.order, c.lead, c.lag = g, np.asarray(order, np.int64), lead, lag


def exhaustive(c: Configuration, limit: np.ndarray) -> None:
    """Every point of ``c`` (all orders, leads and lags), in place: the optimum of the search space,
    to measure the search against (``benchmarks/separated.py --audit``; m! x 4 x (m + 4) runs)."""
    open_configuration(c, limit)
    lo, hi = c.lags
    for order in itertools.permutations(range(c.packing.num_micro_batches)):
        for lead in LEADS:
            for lag in range(lo, hi + 1):
                _try(c, order, lead, lag, limit)
