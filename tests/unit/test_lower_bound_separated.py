"""The lower bound for any placement (``placement_lower_bound``), DIP's separated layout above all:
never above a simulated makespan, with or without its memory term, and never below the
co-located bound on the co-located layout, so gaps mean the same on both layouts."""

import numpy as np
import pytest
from random_schedules import random_separated_table
from test_separated import H100, heavy, one_micro_batch_needs, random_case  # noqa: F401  (the fixture)

from pipetune.cost.cost_model import rank_work
from pipetune.plan.separated.interleave import Problem
from pipetune.schedule import Placement, Schedule, ScheduleTable
from pipetune.simulate import Latencies, simulate
from pipetune.simulate.lower_bound import heads_and_tails, makespan_lower_bound, memory_bound, placement_lower_bound, window_bound


def random_latencies(rng, table: ScheduleTable) -> Latencies:
    m, n, S, E = table.num_micro_batches, table.num_sub_micro_batches, table.num_stages, len(table.placement.encoder)
    trained = table.placement.encoder_trained
    return Latencies(rng.random((m, S)), rng.random((m, S)), rng.random((n, E)), 0.1 * rng.random(m), rng.random((m, S)), rng.random(n),
                     encoder_bwd=rng.random((n, E)) if trained else None, encoder_p2p=0.1 * rng.random(n), feature_p2p=0.1 * rng.random(n),
                     encoder_activation_bytes=rng.random((n, E)) if trained else None)


def test_the_bound_never_exceeds_the_simulated_makespan_of_separated_plans():
    """Random valid orders and greedy tables of random separated layouts (2-6 ranks, 1-3 encoder
    segments, trained or frozen encoders, micro-batches without images), random latencies and
    bytes: the bound, with a memory limit the table fits, is never above the simulator's
    makespan, and never below the old bound (busiest rank, slowest micro-batch's chain)."""
    rng = np.random.default_rng(21)
    for t in range(400):
        if t % 2:
            table = random_separated_table(rng)
            lat = random_latencies(rng, table)
        else:
            placement, parent, lat = random_case(rng)
            order = rng.permutation(lat.fwd.shape[0])
            problem, lead = Problem(placement, parent, lat), int(rng.integers(0, 4))
            table = problem.run(problem.point_keys(order, lead, -lead)).table
        res = simulate(table, lat)
        limit = res.peak_bytes * rng.uniform(1.0, 1.5)
        bound = placement_lower_bound(table, lat, limit)
        assert bound <= res.makespan * (1 + 1e-12)
        assert memory_bound(table.placement, table.sub_mb_parent, lat, res.peak_bytes) <= res.makespan * (1 + 1e-12)
        without_limit = placement_lower_bound(table, lat)
        assert without_limit >= rank_work(table.placement, lat).max() - 1e-12
        chain = (lat.fwd + lat.bwd).sum(axis=1)
        assert without_limit >= chain.max() - 1e-12


def test_on_the_colocated_layout_the_bound_is_at_least_the_colocated_one():
    rng = np.random.default_rng(4)
    for _ in range(100):
        S, m = int(rng.integers(1, 6)), int(rng.integers(1, 10))
        trained = bool(rng.random() < 0.5)
        table = Schedule.ONE_F_ONE_B.build(S, rng.permutation(m), encoder=True, encoder_trained=trained)
        lat = Latencies(rng.random((m, S)), rng.random((m, S)), rng.random(m), 0.1 * rng.random(m), encoder_bwd=rng.random((m, 1)) if trained else None)
        bound = placement_lower_bound(table, lat)
        assert makespan_lower_bound(lat) - 1e-12 <= bound <= simulate(table, lat).makespan * (1 + 1e-12)


def test_one_micro_batch_with_one_sub_micro_batch_is_a_chain_and_the_bound_is_exact():
    rng = np.random.default_rng(1)
    for trained in (False, True):
        placement = Placement.separated(3, 6, encoder_trained=trained)
        problem = Problem(placement, (0,), Latencies(np.ones((1, 3)), np.ones((1, 3)), np.ones((1, 6))))
        table = problem.run(problem.point_keys([0], 0, 0)).table
        lat = random_latencies(rng, table)
        assert placement_lower_bound(table, lat) == pytest.approx(simulate(table, lat).makespan)


def test_a_rank_that_may_hold_nothing_has_no_table():
    table = random_separated_table(np.random.default_rng(0))
    lat = random_latencies(np.random.default_rng(1), table)
    assert placement_lower_bound(table, lat, np.zeros(table.placement.num_ranks)) == np.inf
    assert placement_lower_bound(table, lat, None) < np.inf


def test_the_bound_never_exceeds_the_makespan_of_search_tables_under_tight_memory():
    """Greedy tables of random search points (orders, leads, lags) under limits from one
    micro-batch's need up, where memory decides the table: the bound with that limit, its window
    term included, is never above the simulated makespan."""
    rng = np.random.default_rng(38)
    hits = 0
    for _ in range(300):
        placement, parent, lat = random_case(rng)
        limit = one_micro_batch_needs(placement, parent, lat) * rng.uniform(1.0, 2.0)
        problem = Problem(placement, parent, lat)
        m = lat.fwd.shape[0]
        g = problem.run(problem.point_keys(rng.permutation(m), int(rng.integers(0, 4)), int(rng.integers(-3, m + 1))), limit)
        res = simulate(g.table, lat)
        bound = placement_lower_bound(g.table, lat, limit)
        assert bound <= res.makespan * (1 + 1e-12)
        hits += window_bound(placement, parent, lat, limit, heads_and_tails(placement, parent, lat)) > placement_lower_bound(g.table, lat)
    assert hits > 30  # the window term decides the bound in many of them


def test_a_flow_of_equal_sub_micro_batches_is_bounded_exactly():
    """One micro-batch whose images fill many equal sub-microbatches: its encoder forwards (and
    backwards) pass the ranks as a flow shop, and the bound counts the whole flow before the
    backbone's first forward (and after its last backward), not one sub-microbatch's chain."""
    for trained in (False, True):
        placement = Placement.separated(3, 3, encoder_trained=trained)
        n = 6
        ones = lambda *shape: np.ones(shape)  # noqa: E731
        lat = Latencies(ones(1, 3), 2 * ones(1, 3), 0.5 * ones(n, 3), np.zeros(1), ones(1, 3), ones(n),
                        encoder_bwd=ones(n, 3) if trained else None, encoder_p2p=np.zeros(n), feature_p2p=np.zeros(n),
                        encoder_activation_bytes=ones(n, 3) if trained else None)
        problem = Problem(placement, (0,) * n, lat)
        table = problem.run(problem.point_keys([0], 0, 0)).table
        span = simulate(table, lat).makespan
        assert span == pytest.approx((n + 2) * 0.5 + 9 + ((n + 2) * 1.0 if trained else 0.0))
        assert placement_lower_bound(table, lat) == pytest.approx(span)


def test_micro_batches_that_cannot_share_a_rank_s_memory_are_bounded_one_after_another():
    """Two micro-batches, each needing more than half of a rank's limit: whatever the order, the
    second one's forward starts after the first one's backward on that rank, and the bound (its
    window term) counts both round trips."""
    placement = Placement.separated(2, 2, encoder_trained=False)
    lat = Latencies(np.ones((2, 2)), np.ones((2, 2)), np.full((2, 2), 0.1), np.zeros(2), np.ones((2, 2)), np.full(2, 0.2),
                    encoder_p2p=np.zeros(2), feature_p2p=np.zeros(2))
    limit = np.full(2, 1.5)
    problem = Problem(placement, (0, 1), lat)
    spans = [problem.run(problem.point_keys(order, 0, 0), limit).makespan for order in ((0, 1), (1, 0))]
    proto = ScheduleTable(placement=placement, num_micro_batches=2, ranks=(), sub_mb_parent=(0, 1))
    bound = placement_lower_bound(proto, lat, limit)
    assert placement_lower_bound(proto, lat) < bound <= min(spans) * (1 + 1e-12)
    assert bound == pytest.approx(0.2 + 2 * 4.0)  # an encoder chain, then two windows of F, F, B, B on rank 0
    assert min(spans) == pytest.approx(bound + 0.2)  # the greedy admits the second micro-batch's encoder only then


def test_the_search_s_partial_bounds_stay_below_the_whole_bound(heavy):  # noqa: F811
    """``segment_search.bound`` with ``enough`` stops as soon as its bound reaches it (a
    configuration starts at its busiest rank's work, then ``placement_lower_bound``'s own
    shortcut): the value is never above the whole bound, and is either at least ``enough`` or the
    whole bound; asked again for more, it rises to what was asked. ``alone`` is the memory one
    micro-batch holds on each rank; under a limit below it on any rank, the bound is infinite
    and the greedy finds no table."""
    from dataclasses import replace

    from pipetune.plan.layout.planner_config import PlannerConfig
    from pipetune.plan.separated.segment_search import alone, bound

    model, cost, metas = heavy
    planner = PlannerConfig(max_seq_len=4096, memory_bytes=H100.memory_bytes).build(model, cost)
    limit = planner.budget - planner.states
    rng = np.random.default_rng(3)
    for c in planner.configurations(metas[0], range(1, planner.max_mbs + 1), adaptive=True, bounded=False):
        proto = ScheduleTable(placement=c.placement, num_micro_batches=c.packing.num_micro_batches, ranks=(), sub_mb_parent=c.parent)
        whole = placement_lower_bound(proto, c.lat, limit)
        assert c.lower_bound_s == rank_work(c.placement, c.lat).max() <= whole
        for enough in whole * rng.uniform(0.9, 1.1, 4):
            partial = replace(c)
            got = bound(partial, limit, enough=enough)
            assert got <= whole and (got >= enough or got == whole)
            assert bound(partial, limit) == whole
        assert bound(replace(c), 0.99 * alone(c.placement, c.parent, c.lat)) == np.inf
    for _ in range(100):
        placement, parent, lat = random_case(rng)
        need = alone(placement, parent, lat)
        assert need == pytest.approx(one_micro_batch_needs(placement, parent, lat), rel=1e-12)
        tight = need.copy()
        tight[np.argmax(need)] *= 0.99
        problem = Problem(placement, parent, lat)
        assert problem.run(problem.point_keys(np.arange(lat.fwd.shape[0]), 0, 0), tight) is None
