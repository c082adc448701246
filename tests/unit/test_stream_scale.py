"""BatchStream without an O(N) permutation: huge data sets, random access far out, the
permutation's domain edges, and a crude check that the keyed permutation looks shuffled."""

import tracemalloc

import numpy as np
import pytest

from pipetune.data import BatchStream


def drawn_orders(num_rows: int, seed: int, epochs: int) -> list[np.ndarray]:
    """Each epoch's order before head swaps: with ``gbs == N`` no batch straddles, so there are none."""
    whole = BatchStream(num_rows=num_rows, gbs=num_rows, seed=seed)
    return [whole.rows(e) for e in range(epochs)]


def reference_stream(num_rows: int, gbs: int, seed: int, epochs: int) -> np.ndarray:
    """The module doc's rule on materialised orders: swap each head position holding a row of the
    previous epoch's straddling tail with the earliest later position holding another row."""
    orders = []
    for e, out in enumerate(drawn_orders(num_rows, seed, epochs)):
        r = ((e * num_rows) % gbs) if e else 0
        if r:
            clash = np.isin(out, orders[-1][num_rows - r :])
            bad = np.flatnonzero(clash[: gbs - r])
            free = gbs - r + np.flatnonzero(~clash[gbs - r :])[: len(bad)]
            out[bad], out[free] = out[free], out[bad].copy()
        orders.append(out)
    return np.concatenate(orders)


def straddling_step(num_rows: int, gbs: int, epoch: int) -> int:
    """The step holding the first position of epoch ``epoch``."""
    return epoch * num_rows // gbs


@pytest.mark.parametrize("num_rows", [10**12, 10**12 + 1])  # 256 divides 10**12: +1 makes epoch ends straddle
def test_a_trillion_rows_random_access(num_rows):
    gbs = 256
    edge_1001 = straddling_step(num_rows, gbs, 1001)
    steps = [0, 10**9, straddling_step(num_rows, gbs, 1), edge_1001, 5003 * num_rows // gbs + 17]
    visited = BatchStream(num_rows=num_rows, gbs=gbs, seed=1)
    for s in steps[::-1]:
        visited.rows(s)
    for s in steps:
        got = BatchStream(num_rows=num_rows, gbs=gbs, seed=1).rows(s)
        assert len(np.unique(got)) == gbs and got.min() >= 0 and got.max() < num_rows
        assert np.array_equal(got, visited.rows(s))
        shares = [BatchStream(num_rows=num_rows, gbs=gbs, seed=1, dp_rank=r, dp_size=4).rows(s) for r in range(4)]
        assert np.array_equal(np.sort(np.concatenate(shares)), np.sort(got))
    assert not np.array_equal(BatchStream(num_rows=num_rows, gbs=gbs, seed=2).rows(10**9), visited.rows(10**9))
    epochs = {p // num_rows for p in visited.positions(edge_1001).tolist()}
    assert epochs == ({1000, 1001} if num_rows % gbs else {1001})


def test_memory_does_not_grow_with_rows():
    """An int64 permutation of 10M rows is 80 MB; a step must allocate O(gbs)."""
    stream = BatchStream(num_rows=10**7 + 3, gbs=512, seed=0)
    tracemalloc.start()
    try:
        for s in (0, straddling_step(stream.num_rows, 512, 1), straddling_step(stream.num_rows, 512, 77), 10**8):
            stream.rows(s)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize(
    "num_rows,gbs",
    [
        (1, 1),  # a one-point domain: no Feistel bits at all
        (2, 1), (2, 2), (3, 1), (3, 2), (3, 3),  # one-bit and zero-bit halves
        (4, 4), (4, 3), (8, 8), (8, 3), (32, 32), (64, 64), (64, 63), (64, 1),  # exactly the domain: no walking
        (5, 5), (5, 4), (5, 1), (33, 33), (65, 65), (65, 64), (65, 1),  # just past it: most draws walk
        (129, 128), (150, 128), (150, 127), (257, 256),  # swaps reach the tail: walks back over epochs
        (5000, 128), (5000, 4999),
    ],
)
def test_small_and_edge_sizes_follow_the_rule_exactly(num_rows, gbs):
    epochs = 9
    steps = (epochs - 1) * num_rows // gbs
    stream = BatchStream(num_rows=num_rows, gbs=gbs, seed=11)
    batches = [stream.rows(s) for s in range(steps)]
    for s, b in enumerate(batches):
        assert len(np.unique(b)) == gbs, f"step {s} repeats a sample"
    flat = np.concatenate(batches)
    for e in range(len(flat) // num_rows):
        assert np.array_equal(np.sort(flat[e * num_rows : (e + 1) * num_rows]), np.arange(num_rows)), f"epoch {e}"
    assert np.array_equal(flat, reference_stream(num_rows, gbs, 11, epochs)[: len(flat)])
    for s in range(steps - 1, -1, -max(1, steps // 7)):  # fresh streams, backwards: random access
        assert np.array_equal(BatchStream(num_rows=num_rows, gbs=gbs, seed=11).rows(s), batches[s])
    orders = drawn_orders(num_rows, 11, epochs)
    if num_rows >= 4:
        assert len({tuple(o) for o in orders}) > 1, "every epoch drew the same order"
    if num_rows >= 64:
        assert len({tuple(o) for o in orders}) == epochs


@pytest.mark.parametrize("num_rows,gbs", [(150, 128), (129, 128), (11, 7), (1000, 128)])
def test_far_steps_walk_back_to_the_same_batches(num_rows, gbs):
    start, count = 10**6, 300
    sequential = BatchStream(num_rows=num_rows, gbs=gbs, seed=4)
    batches = [sequential.rows(s) for s in range(start, start + count)]
    assert all(len(np.unique(b)) == gbs for b in batches)
    for s in np.random.default_rng(0).integers(start, start + count, size=20).tolist():
        assert np.array_equal(BatchStream(num_rows=num_rows, gbs=gbs, seed=4).rows(s), batches[s - start])
    flat = np.concatenate(batches)
    skip = -start * gbs % num_rows  # positions before the window's first whole epoch
    for e in range((len(flat) - skip) // num_rows):
        chunk = flat[skip + e * num_rows : skip + (e + 1) * num_rows]
        assert np.array_equal(np.sort(chunk), np.arange(num_rows))


@pytest.mark.parametrize("num_rows,gbs", [(150, 128), (11, 7), (5, 5)])
def test_no_shuffle_is_row_order_every_epoch(num_rows, gbs):
    stream = BatchStream(num_rows=num_rows, gbs=gbs, seed=3, shuffle=False)
    flat = np.concatenate([stream.rows(s) for s in range(6 * num_rows // gbs)])
    assert np.array_equal(flat, np.resize(np.arange(num_rows), len(flat)))


def test_the_permutation_looks_shuffled():
    seeds = range(200)
    where_row0 = [int(np.flatnonzero(BatchStream(num_rows=64, gbs=64, seed=s).rows(0) == 0)[0]) for s in seeds]
    assert len(set(where_row0)) >= 48 and np.bincount(where_row0).max() <= 20  # uniform: ~61 and ~8
    for n, count in ((3, 6), (4, 24)):  # tiny domains reach every permutation
        assert len({tuple(BatchStream(num_rows=n, gbs=n, seed=s).rows(0)) for s in range(300)}) == count
    for n in (1000, 1025):  # walking (1025) or not (1000)
        orders = [BatchStream(num_rows=n, gbs=n, seed=s).rows(e) for s in range(25) for e in range(2)]
        adjacent = sum(int((np.abs(np.diff(o)) == 1).sum()) for o in orders)  # ~ 2 per order by chance
        fixed = sum(int((o == np.arange(n)).sum()) for o in orders)  # ~ 1 per order by chance
        assert adjacent <= 250 and fixed <= 150
        same_place = sum(int((orders[i] == orders[i + 1]).sum()) for i in range(0, len(orders), 2))  # epoch 0 vs 1
        assert same_place <= 80
