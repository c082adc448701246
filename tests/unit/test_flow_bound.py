"""The bound from the flow out of chunk 0's rank (``flow_bound``, part of ``placement_lower_bound``):
never above the simulated makespan of any valid table of the co-located and interleaved families
(list-scheduled and random orders, whole and split backwards, no, frozen or trained encoder, heavy
encoders that throttle the flow), and it raises the bound where rank 0 feeds the pipeline more
slowly than a later rank consumes it; nothing on the separated layout."""

import itertools

import numpy as np
from random_schedules import random_order, random_separated_table
from test_lower_bound_separated import random_latencies

import pipetune.simulate.lower_bound as lower_bound
from pipetune.schedule.schedules import list_scheduled
from pipetune.simulate import Latencies, simulate
from pipetune.simulate.lower_bound import flow_bound, heads_and_tails, placement_lower_bound


def random_family_case(rng, P, V, m, split, encoder, trained):
    S = P * V
    fwd = rng.uniform(0.2, 2.0, (m, S)) / V
    bwd = fwd * rng.uniform(1.5, 2.5, (m, S))
    enc = rng.uniform(0, 3, m) if encoder else None  # up to several chunks' forwards: rank 0 may throttle the flow
    lat = Latencies(fwd, bwd, enc, rng.uniform(0, 0.05, m), bwd_input=bwd * rng.uniform(0.3, 0.7, (m, S)),
                    encoder_bwd=rng.uniform(1, 2) * enc if trained else None)
    table = list_scheduled(P, V, rng.permutation(m), split_backward=split, encoder=encoder, encoder_trained=trained)
    return table, lat


def test_the_flow_bound_never_exceeds_the_simulated_makespan():
    rng = np.random.default_rng(44)
    for P, V, m, split, (encoder, trained) in itertools.product((2, 3, 4, 8), (1, 2, 3), (1, 2, 5, 9, 16), (False, True),
                                                                 ((False, False), (True, False), (True, True))):
        table, lat = random_family_case(rng, P, V, m, split, encoder, trained)
        others = [table, random_order(rng, table.__class__(table.placement, m, ((),) * P, table.sub_mb_parent,
                                                           split_backward=split))]
        for t in others:
            span = simulate(t, lat).makespan
            parts = heads_and_tails(t.placement, t.sub_mb_parent, lat, split_backward=split)
            assert flow_bound(t.placement, t.sub_mb_parent, lat, parts) <= span + 1e-9
            assert placement_lower_bound(t, lat) <= span + 1e-9


def test_a_slow_feed_raises_the_bound_above_the_one_without_it(monkeypatch):
    """Equal micro-batches on an even split of 20 layers into 8 chunks (the middle chunks take the
    extra layers) with an encoder beside chunk 0 and a heavier head: rank 0 hands on a micro-batch
    per 0.4 s, the last rank's first chunk takes 0.3 s of each, so in the first round it waits
    between arrivals, which neither the per-rank nor the chain bounds see; the flow bound does,
    and the list scheduler's table stays above it."""
    P, V, m = 4, 2, 8
    fwd = np.tile([0.2, 0.3, 0.3, 0.3, 0.3, 0.2, 0.2, 0.2], (m, 1))
    fwd[:, -1] += 0.05
    lat = Latencies(fwd, 2 * fwd, np.full(m, 0.2), np.full(m, 0.001), bwd_input=fwd.copy())
    table = list_scheduled(P, V, range(m), split_backward=True, encoder=True)
    with_flow = placement_lower_bound(table, lat)
    monkeypatch.setattr(lower_bound, "flow_bound", lambda *args: 0.0)
    without = placement_lower_bound(table, lat)
    assert without + 0.1 < with_flow <= simulate(table, lat).makespan + 1e-9


def test_the_separated_layout_gets_no_flow_term():
    rng = np.random.default_rng(5)
    for _ in range(20):
        table = random_separated_table(rng)
        lat = random_latencies(rng, table)
        parts = heads_and_tails(table.placement, table.sub_mb_parent, lat, split_backward=table.split_backward)
        assert flow_bound(table.placement, table.sub_mb_parent, lat, parts) == 0.0
