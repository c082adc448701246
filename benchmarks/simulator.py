"""Simulator throughput: candidate plans (micro-batch order + encoder placement) timed per second.

For each (micro-batches, stages) it compiles a 1F1B schedule with encoders once, then times
``--candidates`` random candidates (a random order each, half of the encoders moved to random
earlier slots) with the vectorised ``evaluate`` (makespan only, and with peak memory), best of
``--repeats``. Goal (issue 4): >= 20,000 candidates/s for 32 micro-batches x 4 stages, one core.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pipetune.schedule import one_f_one_b
from pipetune.simulate import Latencies, compile_schedule, evaluate, simulate


def candidates(dag, m: int, C: int, rng) -> tuple[np.ndarray, np.ndarray]:
    orders = np.argsort(rng.random((C, m)), axis=1)
    pos = dag.rank_position()
    fwd_pos = pos[dag.float_slot]
    move = rng.random((C, m)) < 0.5
    target = (rng.random((C, m)) * (fwd_pos + 1)).astype(np.int64)
    slots = np.where(move, dag.rank_nodes[0][target], dag.float_slot)
    return orders, slots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--candidates", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'micro-batches':>13} {'stages':>6} {'candidates/s':>13} {'+ memory':>10} {'detailed simulate':>18}")
    for S in (4, 8):
        for m in (8, 32, 128):
            lat = Latencies(rng.random((m, S)) + 1, rng.random((m, S)) + 2, rng.random(m), np.full(m, 0.01),
                            rng.random((m, S)), rng.random(m))
            table = one_f_one_b(S, range(m), encoder=True)
            dag = compile_schedule(table)
            orders, slots = candidates(dag, m, args.candidates, rng)
            rates = []
            for memory in (False, True):
                best = np.inf
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    evaluate(dag, lat, orders, slots, memory=memory)
                    best = min(best, time.perf_counter() - t0)
                rates.append(args.candidates / best)
            t0 = time.perf_counter()
            simulate(table, lat)
            detail_ms = (time.perf_counter() - t0) * 1e3
            print(f"{m:13d} {S:6d} {rates[0]:13,.0f} {rates[1]:10,.0f} {detail_ms:15.1f} ms")


if __name__ == "__main__":
    main()
