"""Contention: work slows down while another rank is busy on the same machine.

Ranks that share cores, memory bandwidth or a host (CPU ranks on one machine; GPU ranks whose
kernel launches and copies compete for host CPUs) run an action slower while another rank
computes than while it has the machine to itself. The latency table's curves are per action,
so they cannot see this: a calibration on plans of many overlapping micro-batches folds the
slow-down into every action and then predicts a plan with little overlap (one large
micro-batch) too slow, and the other way round. Measured on the 2-core test machine with one
CPU-bound process beside 2 gloo ranks, such a table predicted a 20-30 % cut of pipetune's
many-micro-batch plans against ``original``'s single micro-batch where 10-15 % was measured.

The model has one number, ``contention`` (kappa, ``LatencyTable.contention``): every second during
which an action runs while at least one other rank is busy costs ``1 + kappa`` seconds. To first
order a schedule's makespan grows by ``kappa`` times its *concurrent time* (the time during which
two or more ranks are busy), which ``concurrent_time`` finds for a block of candidates in one
vectorised sweep; the simulator adds it to every makespan. Calibration
(``pipetune.calibrate.action_fit``) fits kappa from measured timelines: an action that overlapped
other ranks' work (``overlap_with_others``) for a fraction ``phi`` of its uncontended time took
``1 + kappa phi`` times that time. Where every action overlaps alike kappa trades against the
scales, so the trainer measures it on pairs: a calibration step's plan run pipelined and serially
(``pipetune.schedule.schedules.serial``), taking the kappa that prices the ratio of their iteration
times (``pipetune.calibrate.online.twin_contention``).
Limits: first order (the schedule's order of work is that of the uncontended simulation; a
stretch that would reorder waits is not followed) and one number for every kind of work and any
number of busy ranks.
"""

from __future__ import annotations

import numpy as np


def overlaps(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For intervals ``[K, C]`` (no two of one rank overlapping: a rank runs one action at a
    time): seconds of each interval during which another rank's interval runs, ``[K, C]``, and
    the concurrent time (at least two running) per column, ``[C]``."""
    K, C = start.shape
    if K == 0:
        return np.zeros((0, C)), np.zeros(C)
    times = np.concatenate([start, end])
    order = np.argsort(times, axis=0, kind="stable")
    at = np.take_along_axis(times, order, axis=0)
    busy = np.cumsum(np.where(order < K, 1, -1), axis=0)
    both = np.where(busy[:-1] >= 2, np.diff(at, axis=0), 0.0)
    cum = np.concatenate([np.zeros((1, C)), np.cumsum(both, axis=0)])
    where = np.empty_like(order)
    np.put_along_axis(where, order, np.arange(2 * K)[:, None].repeat(C, axis=1), axis=0)
    return np.take_along_axis(cum, where[K:], axis=0) - np.take_along_axis(cum, where[:K], axis=0), cum[-1]


def concurrent_time(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Seconds during which at least two of the intervals ``[K, C]`` run, per column ``[C]``."""
    return overlaps(start, end)[1]


def overlap_with_others(start, end) -> np.ndarray:
    """``overlaps``' per-interval seconds for one timeline (1-D starts and ends)."""
    return overlaps(np.asarray(start, np.float64)[:, None], np.asarray(end, np.float64)[:, None])[0][:, 0]
