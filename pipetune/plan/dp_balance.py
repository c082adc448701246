"""Data-parallel balance: split each global batch over ``D`` pipeline replicas so the slowest one,
which gates the step, is as fast as possible.

TorchTitan's data loader deals samples round-robin (``BatchStream`` with ``dp_size``), blind to
their cost, so one replica can draw the interleaved documents with many images while another draws
text. Here:

1. FLOPs-aware LPT: samples in decreasing order of training FLOPs (backbone forward + backward,
   plus the ViT's per image) go to the least loaded replica that still has room; every replica
   keeps ``gbs / D`` samples, so the per-replica batch shape and loss normalisation stay those of
   the round-robin split;
2. refinement by simulation: each replica is planned (the caller's planner), and samples are
   swapped between the slowest and the fastest replica while that lowers the slower of the two
   (candidate swaps: the pairs whose FLOPs difference is closest to half the pair's gap).

Every sample lands in exactly one replica (``DPSplit.replicas`` is a partition of the batch).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pipetune.config.model import ModelConfig
from pipetune.data.batch import BatchMeta
from pipetune.packing.flops import FlopsModel


@dataclass(frozen=True)
class DPSplit:
    """Row indices into the batch's table, one array per replica, and each replica's planned time."""

    replicas: tuple[np.ndarray, ...]
    iter_s: np.ndarray

    @property
    def spread(self) -> float:
        """Slowest replica over the mean: 1.0 is perfect balance."""
        return float(self.iter_s.max() / self.iter_s.mean())


def sample_flops(model: ModelConfig, meta: BatchMeta) -> np.ndarray:
    f = FlopsModel(model)
    return f.sequence_flops(meta.table.lengths) + f.encoder_flops(meta.table.num_images)


def replica_meta(meta: BatchMeta, idx: np.ndarray) -> BatchMeta:
    """The part of ``meta`` made of table rows ``idx``."""
    idx = np.sort(np.asarray(idx, dtype=np.int64))
    return replace(meta, rows=meta.rows[idx], table=meta.table.take(idx))


def even_split(n: int, dp: int) -> list[np.ndarray]:
    """Round-robin, as the data loader deals samples."""
    return [np.arange(r, n, dp, dtype=np.int64) for r in range(dp)]


def lpt_split(weights: np.ndarray, dp: int) -> list[np.ndarray]:
    """Longest-processing-time first with equal sample counts (module doc, 1)."""
    n = len(weights)
    cap = -(-n // dp)
    load = np.zeros(dp)
    count = np.zeros(dp, dtype=np.int64)
    owner = np.empty(n, dtype=np.int64)
    for i in np.argsort(-weights, kind="stable"):
        r = int(np.argmin(np.where(count < cap, load, np.inf)))
        owner[i] = r
        load[r] += weights[i]
        count[r] += 1
    return [np.flatnonzero(owner == r) for r in range(dp)]


def balance(meta: BatchMeta, dp: int, model: ModelConfig, time_of, *, rounds: int = 16, tries: int = 4) -> tuple[DPSplit, DPSplit]:
    """(round-robin split, balanced split) of one batch; ``time_of(BatchMeta) -> seconds`` plans a replica."""
    n = len(meta.table)
    if dp < 1 or n < dp:
        raise ValueError(f"cannot split a batch of {n} samples over dp={dp} replicas")

    def timed(parts):
        return DPSplit(tuple(parts), np.array([time_of(replica_meta(meta, p)) for p in parts]))

    even = timed(even_split(n, dp))
    w = sample_flops(model, meta)
    best = min(even, timed(lpt_split(w, dp)), key=lambda s: s.iter_s.max())
    parts, times = list(best.replicas), best.iter_s.copy()
    for _ in range(rounds):
        slow, fast = int(np.argmax(times)), int(np.argmin(times))
        if slow == fast:
            break
        a, b = parts[slow], parts[fast]
        diff = w[a][:, None] - w[b][None, :]
        target = (w[a].sum() - w[b].sum()) / 2
        flat = np.argsort(np.abs(diff - target), axis=None)[:tries]
        improved = False
        for k in flat:
            i, j = np.unravel_index(k, diff.shape)
            na, nb = a.copy(), b.copy()
            na[i], nb[j] = b[j], a[i]
            ta, tb = time_of(replica_meta(meta, na)), time_of(replica_meta(meta, nb))
            if max(ta, tb) < times[slow]:
                parts[slow], parts[fast] = na, nb
                times[slow], times[fast] = ta, tb
                improved = True
                break
        if not improved:
            break
    return even, DPSplit(tuple(np.sort(p) for p in parts), times)


def compare_dp(model: ModelConfig, planner, data, *, dp: int, gbs: int, max_seq_len: int, iters: int, seed: int = 0, overlong="truncate") -> dict:
    """Per iteration of ``gbs`` samples: each replica planned by ``planner`` under the round-robin and
    the balanced split; the step takes its slowest replica's time."""
    from pipetune.data.batch import batch_meta
    from pipetune.data.stream import BatchStream

    stream = BatchStream(num_rows=len(data), gbs=gbs, seed=seed)
    rows = []
    for step in range(iters):
        meta = batch_meta(data, stream, step, tokens_per_image=model.tokens_per_image, max_seq_len=max_seq_len, overlong=overlong)
        rows.append(balance(meta, dp, model, lambda m: planner.plan(m).predicted_s))
    out = {}
    for k, name in enumerate(("round_robin", "balanced")):
        splits = [r[k] for r in rows]
        out[name] = {
            "mean_iter_s": float(np.mean([s.iter_s.max() for s in splits])),
            "spread_max_over_mean": float(np.mean([s.spread for s in splits])),
            "spread_max_minus_min_s": float(np.mean([np.ptp(s.iter_s) for s in splits])),
        }
    out["cut_vs_round_robin"] = 1 - out["balanced"]["mean_iter_s"] / out["round_robin"]["mean_iter_s"]
    return out
