"""The simulator times a compiled schedule one wave of nodes at a time (``CompiledSchedule.waves``)
and keeps per-shape facts between compilations (``dag._shape``); both must give exactly what the
plain definition gives: each node, in topological order, starts at the latest of its rank's
previous end plus its floating work and every producer's end plus its message."""

from dataclasses import fields

import numpy as np
import pytest

from random_schedules import random_order, random_separated_table
from pipetune.schedule import Placement, ScheduleTable
from pipetune.simulate import Latencies, compile_schedule
from pipetune.simulate.dag import _action_facts, _shape
from pipetune.simulate.simulator import _gather, _per_node, _run


def node_by_node(dag, g, slots):
    N, C = g.dur.shape
    pre = _per_node(slots, g.float_dur, N)
    start, end = np.empty((N, C)), np.empty((N, C))
    for n, deps in enumerate(dag.edges):
        t = (end[dag.rank_prev[n]] if dag.rank_prev[n] >= 0 else np.zeros(C)) + pre[n]
        for d, e in deps:
            t = np.maximum(t, end[d] + (g.comm[e] if e >= 0 else 0.0))
        start[n], end[n] = t, t + g.dur[n]
    return start, end, pre


def random_table(rng, kind):
    if kind == "separated":
        return random_separated_table(rng)
    P, V, m = int(rng.integers(1, 5)), int(rng.integers(1, 4)), int(rng.integers(1, 9))
    encoder = kind == "co-located encoder"
    placement = Placement.interleaved(P, V, encoder=encoder, encoder_trained=encoder and bool(rng.random() < 0.5))
    proto = ScheduleTable(placement, m, ((),) * P, tuple(range(m)) if encoder else (), split_backward=bool(rng.random() < 0.5))
    return random_order(rng, proto)


def random_latencies(rng, table):
    m, S = table.num_micro_batches, table.num_stages
    n, E = max(table.num_sub_micro_batches, 1) if table.encoder else m, max(len(table.placement.encoder), 1)
    bwd = rng.uniform(0.5, 2, (m, S))
    return Latencies(rng.uniform(0.2, 1, (m, S)), bwd, rng.uniform(0, 1, (n, E)), rng.uniform(0, 0.2, m),
                     encoder_bwd=rng.uniform(0, 1, (n, E)), encoder_p2p=rng.uniform(0, 0.2, n), feature_p2p=rng.uniform(0, 0.2, n),
                     bwd_input=bwd * rng.uniform(0.2, 0.8, (m, S)))


@pytest.mark.parametrize("kind", ["backbone", "co-located encoder", "separated"])
def test_waves_time_every_node_exactly_as_node_by_node(kind):
    """Many candidates (one vectorised pass per wave) and one (plain floats), on random tables."""
    rng = np.random.default_rng(11)
    for _ in range(60):
        table = random_table(rng, kind)
        dag = compile_schedule(table)
        lat = random_latencies(rng, table)
        C = 5
        orders = np.tile(np.arange(table.num_micro_batches), (C, 1))
        if dag.one_to_one:
            orders = np.array([rng.permutation(table.num_micro_batches) for _ in range(C)])
        slots = np.tile(dag.float_slot, (C, 1))
        if len(dag.floating):  # floating work moved to random earlier nodes of its rank, up to its first consumer
            pos = dag.rank_position()
            for c in range(C):
                for f, first in enumerate(dag.float_first_use):
                    rank = dag.rank_nodes[dag.rank[first]]
                    slots[c, f] = rank[int(rng.integers(0, pos[first] + 1))]
        g = _gather(dag, lat, orders)
        for ours, ref in zip(_run(dag, g, slots), node_by_node(dag, g, slots)):
            assert np.array_equal(ours, ref)
        one = _gather(dag, lat, orders[:1])  # one candidate: _run's node-by-node pass over plain floats
        for ours, ref in zip(_run(dag, one, slots[:1]), node_by_node(dag, one, slots[:1])):
            assert np.array_equal(ours, ref)


def test_compiling_from_the_shape_caches_equals_compiling_cold():
    """The per-shape caches hold only what does not depend on the rank lists (and, with one
    sub-microbatch per micro-batch, not on the micro-batch count): a table compiled after other
    orders and other counts of its layout compiles exactly as it does with empty caches."""
    rng = np.random.default_rng(5)
    for placement, subs, shared in ((Placement.interleaved(3, 2, encoder=True), lambda m: tuple(range(m)), True),
                                    (Placement.separated(2, 4, encoder_trained=True),
                                     lambda m: tuple(sorted(rng.integers(0, m, m + 2).tolist())), False)):
        split = not placement.encoder_trained
        protos = [ScheduleTable(placement, m, ((),) * placement.num_ranks, subs(m), split_backward=split) for m in (6, 8)]
        a, b, other = random_order(rng, protos[0]), random_order(rng, protos[0]), random_order(rng, protos[1])
        assert a.ranks != b.ranks
        _shape.cache_clear()
        _action_facts.cache_clear()
        cold = compile_schedule(a)
        _shape.cache_clear()
        _action_facts.cache_clear()
        compile_schedule(other)
        compile_schedule(b)
        warm = compile_schedule(a)
        assert _shape.cache_info().hits == 1 and _action_facts.cache_info().hits == shared  # facts shared across counts
        for f in fields(cold):
            x, y = getattr(cold, f.name), getattr(warm, f.name)
            assert (np.array_equal(x, y) if isinstance(x, np.ndarray) else
                    all(map(np.array_equal, x, y)) if f.name in ("rank_nodes", "copy_nodes") else x == y), f.name
