"""Expected makespan under per-action jitter (issue 14): the Monte-Carlo estimate on top of ``evaluate``."""

from dataclasses import replace

import numpy as np
import pytest

from pipetune.cost.variability import Spread, Variability
from pipetune.plan.search.precompute import move_encoders_into_gaps
from pipetune.schedule import one_f_one_b
from pipetune.simulate import Latencies, compile_schedule, evaluate
from pipetune.simulate.jitter import draw_makespans, expected_makespan, jitter

NOISY = Variability(stage=Spread(log_var=0.01, log_var_s=2e-4, min_s=1e-3), encoder=Spread(log_var=0.02),
                    p2p=Spread(log_var=0.05))


def random_lat(rng, m, S):
    fwd = rng.uniform(1e-3, 2e-2, (m, S))
    enc = np.where(rng.random(m) < 0.3, 0.0, rng.uniform(1e-3, 5e-3, m))
    return Latencies(fwd, 2 * fwd * rng.uniform(0.8, 1.2, (m, S)), enc, rng.uniform(1e-4, 1e-3, m), np.zeros((m, S)), np.zeros(m))


def candidates(rng, dag, lat, n):
    """``n`` random orders, each with the schedule's encoder placement and a gap-filling one."""
    m = lat.fwd.shape[0]
    orders = np.array([rng.permutation(m) for _ in range(n)])
    moved = move_encoders_into_gaps(dag, lat, orders, np.full(n, 0.5))
    return np.vstack([orders, orders]), np.vstack([np.tile(dag.float_slot, (n, 1)), moved])


@pytest.mark.parametrize("S,m", [(2, 5), (4, 9)])
def test_zero_spread_gives_exactly_the_deterministic_makespan(S, m):
    rng = np.random.default_rng(S * m)
    lat = random_lat(rng, m, S)
    dag = compile_schedule(one_f_one_b(S, range(m), encoder=True))
    orders, slots = candidates(rng, dag, lat, 6)
    jl = jitter(lat, Variability(), 8, 0)
    assert np.array_equal(expected_makespan(dag, jl, orders, slots), evaluate(dag, lat, orders, slots).makespan)


@pytest.mark.parametrize("S,m", [(2, 5), (4, 9), (4, 16)])
def test_expected_makespan_is_never_below_the_deterministic_one(S, m):
    """Jensen: the makespan is convex in the action times and every action's factors average one
    over the draws, so the estimate itself (not only its expectation) is >= the makespan of the
    mean times, which are the deterministic ones."""
    rng = np.random.default_rng(S + m)
    lat = random_lat(rng, m, S)
    dag = compile_schedule(one_f_one_b(S, range(m), encoder=True))
    jl = jitter(lat, NOISY, 8, 1)
    for field in ("fwd", "bwd", "encoder", "p2p"):  # the draws' mean durations are the deterministic ones
        mean = np.mean([getattr(d, field) for d in jl.draws], axis=0)
        np.testing.assert_allclose(mean, getattr(lat, field), rtol=1e-12)
    orders, slots = candidates(rng, dag, lat, 20)
    det = evaluate(dag, lat, orders, slots).makespan
    exp = expected_makespan(dag, jl, orders, slots)
    assert (exp >= det * (1 - 1e-12)).all()
    # equal where one path stays critical in every draw (the makespan is then a sum), above elsewhere
    assert (exp > det * (1 + 1e-6)).any()


def test_all_draws_in_one_call_equal_one_draw_at_a_time():
    rng = np.random.default_rng(3)
    S, m, K = 3, 7, 5
    lat = random_lat(rng, m, S)
    dag = compile_schedule(one_f_one_b(S, range(m), encoder=True))
    orders, slots = candidates(rng, dag, lat, 4)
    jl = jitter(lat, NOISY, K, 2)
    spans = draw_makespans(dag, jl, orders, slots)
    for k in range(K):
        assert np.array_equal(spans[k], evaluate(dag, jl.draws[k], orders, slots).makespan)
    assert len(np.unique(spans[:, 0])) == K  # the draws differ


def test_one_stage_expected_makespan_is_the_sum_of_expected_times():
    """One rank runs everything back to back, so the makespan is a sum and its mean over the draws
    is the sum of the mean (= deterministic) times: exact, not within Monte-Carlo error."""
    rng = np.random.default_rng(4)
    m = 12
    lat = random_lat(rng, m, 1)
    lat = replace(lat, p2p=np.zeros(m))
    dag = compile_schedule(one_f_one_b(1, range(m), encoder=True))
    orders = np.array([rng.permutation(m) for _ in range(5)])
    jl = jitter(lat, NOISY, 16, 5)
    total = lat.fwd.sum() + lat.bwd.sum() + lat.encoder.sum()
    np.testing.assert_allclose(expected_makespan(dag, jl, orders), total, rtol=1e-12)
    assert draw_makespans(dag, jl, orders).std(axis=0).min() > 0.01 * total


def test_draws_are_common_to_every_candidate_and_seeded():
    rng = np.random.default_rng(5)
    lat = random_lat(rng, 6, 2)
    a, b, c = jitter(lat, NOISY, 4, (0, 7)), jitter(lat, NOISY, 4, (0, 7)), jitter(lat, NOISY, 4, (0, 8))
    fwd = [np.stack([d.fwd for d in x.draws]) for x in (a, b, c)]
    assert np.array_equal(fwd[0], fwd[1]) and not np.array_equal(fwd[0], fwd[2])
    # one factor per (micro-batch, stage) for its forward and backward: their ratio is noise-free
    for d in a.draws:
        np.testing.assert_allclose(d.bwd / d.fwd, lat.bwd / lat.fwd, rtol=1e-12)
    with pytest.raises(ValueError, match="at least 2 draws"):
        jitter(lat, NOISY, 1, 0)
