"""The two packers of PipeTune's evaluation: ``balanced`` (Alg. 1) and the ``original`` baseline."""

from __future__ import annotations

import heapq
import math

import numpy as np

from pipetune.packing.groups import Packing


def _check_inputs(lengths: np.ndarray, capacity: int) -> None:
    if len(lengths) == 0:
        raise ValueError("cannot pack an empty batch")
    if capacity <= 0:
        raise ValueError(f"micro-batch capacity must be > 0 tokens, got {capacity}")
    if lengths.min() <= 0:
        raise ValueError(f"batch row {int(np.argmin(lengths))} has length {int(lengths.min())}; lengths must be > 0")
    if lengths.max() > capacity:
        i = int(np.argmax(lengths))
        raise ValueError(
            f"batch row {i} is {int(lengths[i])} tokens, more than a micro-batch holds ({capacity}); "
            "apply the overlong policy before packing"
        )


def pack_balanced(lengths, weights, capacity: int, num_micro_batches: int | None = None) -> Packing:
    """PipeTune Alg. 1: FLOPs-balanced greedy packing under a token capacity.

    Sequences go longest first; each joins the micro-batch with the lowest FLOPs after adding it
    among those with room for it (FLOPs are additive over documents, so that is the micro-batch
    with the lowest FLOPs now; ties go to the shortest one, the paper's fallback). A new
    micro-batch is opened only when none has room. It starts from the smallest count the capacity
    allows, ``ceil(total tokens / capacity)``, or from ``num_micro_batches`` if that is larger
    (with at least that many sequences, no micro-batch is then left empty).
    Without a binding capacity this is Graham's LPT rule: max load <= (4/3 - 1/(3m)) x optimum.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    weights = np.asarray(weights, dtype=np.float64)
    _check_inputs(lengths, capacity)
    order = np.argsort(-lengths, kind="stable")
    start = max(math.ceil(int(lengths.sum()) / capacity), num_micro_batches or 1)
    heap = [(0.0, 0, j) for j in range(start)]
    bins: list[list[int]] = [[] for _ in range(start)]
    shortest_left = int(lengths[order[-1]])
    lengths_l, weights_l = lengths.tolist(), weights.tolist()
    pop, push = heapq.heappop, heapq.heappush
    for i in order.tolist():
        length = lengths_l[i]
        no_room = []
        while heap:
            flops, used, j = pop(heap)
            if used + length <= capacity:
                break
            if used + shortest_left <= capacity:
                no_room.append((flops, used, j))
        else:
            flops, used, j = 0.0, 0, len(bins)
            bins.append([])
        bins[j].append(i)
        push(heap, (flops + weights_l[i], used + length, j))
        for entry in no_room:
            push(heap, entry)
    return Packing.from_groups([b for b in bins if b], capacity)


def pack_original(lengths, capacity: int, rng: np.random.Generator) -> Packing:
    """The baseline: samples in random order, each into the first micro-batch with room (first fit)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    _check_inputs(lengths, capacity)
    used: list[int] = []
    bins: list[list[int]] = []
    lengths_l = lengths.tolist()
    for i in rng.permutation(len(lengths)).tolist():
        length = lengths_l[i]
        for j, u in enumerate(used):
            if u + length <= capacity:
                used[j] += length
                bins[j].append(i)
                break
        else:
            used.append(length)
            bins.append([i])
    return Packing.from_groups(bins, capacity)
