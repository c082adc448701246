"""Joint per-iteration search on the separated layout (DIP): micro-batch size, image
sub-microbatch size, micro-batch order and encoder lead, each candidate scored by the dual-queue
greedy (``pipetune.plan.interleave``) under each rank's memory limit.

A *configuration* is one micro-batch size and one image sub-microbatch size ``B``: its balanced
packing, its latencies, the greedy's ``Problem`` and the lower bound of any table over it
(``pipetune.simulate.lower_bound.placement_lower_bound``). A *point* in one configuration is a
micro-batch order and a lead (the encoder runs that many micro-batches ahead of the backbone,
``segment_priorities``): DIP's segment priorities with the segments of one micro-batch and
modality sharing theirs (DIP Sec. 5.1).

Search, per batch:

1. every configuration's packing order at lead 0 (its ``balanced`` plan), one greedy run each;
2. a scan: in every configuration whose lower bound can still beat the best table so far, lowest
   bound first, the packing order and both latency-sorted orders at every lead (``LEADS``; the
   previous batch's lead first: a warm start);
3. hill climbing in the configurations whose best is fastest after the scan (the previous batch's
   choice among them): random moves (one micro-batch moved to another position, two swapped, or
   the lead changed by one), a move kept when its table is faster;
4. it stops when the moves are done, or when ``evaluations`` greedy runs are spent
   (deterministic), or past a wall-clock deadline (anytime: the best table so far).

Why hill climbing and not DIP's MCTS: at GBS 128 a configuration holds 2-20 micro-batches, and one
greedy run costs about 1-2 ms in Python, so a plan affords a few hundred runs; MCTS with random
rollouts needs far more to rank its subtrees, and its rollouts mostly score random orders. Moves
around the best order spend every run near good tables. ``benchmarks/separated.py`` compares the
result with the exhaustive optimum over orders and leads where that is small enough to enumerate.

Memory: every table the greedy returns fits each rank's limit (the greedy admits a micro-batch
only when its forward memory fits on every rank), and a configuration with no fitting table has
none.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from pipetune.cost.cost_model import CostModel, MicroBatchShapes
from pipetune.cost.stage_layout import StageLayout
from pipetune.packing.groups import Packing
from pipetune.plan.interleave import Interleaved, Problem, segment_priorities
from pipetune.schedule.table import ScheduleTable
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
    problem: Problem
    lower_bound_s: float
    base: Interleaved | None  # packing order, lead 0
    best: Interleaved | None = None
    order: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    lead: int = 0

    @property
    def best_s(self) -> float:
        return self.best.makespan if self.best is not None else np.inf

    @property
    def base_s(self) -> float:
        return self.base.makespan if self.base is not None else np.inf


def configuration(cost: CostModel, packing: Packing, shapes: MicroBatchShapes, mbs: int, limit: np.ndarray) -> Configuration:
    """``packing`` under ``cost``'s layout (its ``image_sub_batch``), scored in packing order at lead 0."""
    costs = cost.stage_costs(shapes)
    lat = Latencies.from_costs(costs)
    parent = tuple(costs.sub_batches.parent.tolist())
    problem = Problem(cost.placement(), parent, lat, name=f"separated B={cost.layout.image_sub_batch}")
    proto = ScheduleTable(placement=problem.placement, num_micro_batches=packing.num_micro_batches, ranks=(), sub_mb_parent=parent)
    identity = np.arange(packing.num_micro_batches)
    base = problem.run(*segment_priorities(identity, parent, 0), limit)
    c = Configuration(mbs, cost.layout.image_sub_batch, packing, lat, problem, placement_lower_bound(proto, lat, limit), base)
    c.best, c.order = base, identity
    return c


def sub_batch_sizes(layout: StageLayout, adaptive: bool) -> tuple[int, ...]:
    """The partitioner's ``B`` and, when ``adaptive``, half of it: smaller sub-microbatches pad less
    and pipeline finer, at some loss of encoder throughput (the partitioner's 95 % rule), which the
    greedy's makespan weighs per batch."""
    B = layout.image_sub_batch
    return (B, (B + 1) // 2) if adaptive and B > 1 else (B,)


class Budget:
    """Greedy runs left, and a wall-clock deadline (``time.perf_counter()`` seconds, or None)."""

    def __init__(self, evaluations: int, deadline: float | None):
        self.left = evaluations
        self.deadline = deadline

    def spend(self) -> bool:
        """Take one run; False when none is left or the deadline has passed."""
        if self.left <= 0 or (self.deadline is not None and time.perf_counter() > self.deadline):
            return False
        self.left -= 1
        return True


def scan(c: Configuration, limit: np.ndarray, budget: Budget, *, first_lead: int = 0) -> None:
    """Step 2 of the module doc on ``c``, in place."""
    m = c.packing.num_micro_batches
    parent = np.asarray(c.problem.sub_mb_parent, np.int64)
    work = (c.lat.fwd + c.lat.bwd).sum(axis=1) + np.bincount(parent, weights=c.lat.encoder.sum(axis=1), minlength=m)
    longest = np.lexsort((np.arange(m), -work))
    seen = {(tuple(c.order.tolist()), c.lead)}
    for order in (np.arange(m), longest, longest[::-1]):
        for lead in sorted(LEADS, key=lambda x: (x != first_lead, x)):
            if (tuple(order.tolist()), lead) in seen:
                continue
            if not budget.spend():
                return
            seen.add((tuple(order.tolist()), lead))
            _try(c, order, lead, limit)


def climb(c: Configuration, limit: np.ndarray, budget: Budget, rng: np.random.Generator, moves: int) -> None:
    """Step 3 of the module doc on ``c``, in place: up to ``moves`` moves from its best point."""
    m = c.packing.num_micro_batches
    seen = {(tuple(c.order.tolist()), c.lead)}
    for _ in range(moves):
        order, lead = c.order.copy(), c.lead
        move = rng.integers(3) if m > 1 else 2
        if move == 0:
            i, j = rng.choice(m, 2, replace=False)
            order = np.insert(np.delete(order, i), j, order[i])
        elif move == 1:
            i, j = rng.choice(m, 2, replace=False)
            order[[i, j]] = order[[j, i]]
        else:
            lead = int(np.clip(lead + rng.choice((-1, 1)), LEADS[0], LEADS[-1]))
        key = (tuple(order.tolist()), lead)
        if key in seen:
            continue
        if not budget.spend():
            return
        seen.add(key)
        _try(c, order, lead, limit)


def _try(c: Configuration, order: np.ndarray, lead: int, limit: np.ndarray) -> None:
    """Run the greedy on one point; keep it in ``c`` when it is faster."""
    g = c.problem.run(*segment_priorities(order, c.problem.sub_mb_parent, lead), limit)
    if g is not None and g.makespan < c.best_s - 1e-12:
        c.best, c.order, c.lead = g, order, lead
