"""Data-parallel balance: split each global batch over ``D`` pipeline replicas so the slowest one,
which gates the step, is as fast as possible, and plan every replica.

TorchTitan's data loader deals samples round-robin (``BatchStream`` with ``dp_size``), blind to
their cost, so one replica can draw the interleaved documents with many images while another draws
text. ``split_and_plan(..., balanced=True)``:

1. FLOPs-aware LPT: samples in decreasing order of training FLOPs (backbone forward + backward,
   plus the ViT's per image) each go to the least loaded replica that still has room. Every
   replica keeps the sample count round-robin gives it (``n // D``, one more for ``n % D`` of
   them), so per-replica batch shapes and loss normalisation stay the loader's;
2. refinement by simulation: each replica is planned (the caller's ``plan_of``), and one sample of
   the slowest replica is swapped with one of the fastest while that lowers the slower of the two.
   The candidate swaps move the FLOPs that close half the pair's time gap at the batch's mean
   FLOPs per second (the first candidate nearly always succeeds). Each round lowers only the
   slowest replica, by a fraction of a percent once LPT has balanced FLOPs, for two plans, so the
   search stops after ``rounds`` rounds or once the slowest is within ``min_gain`` of the mean;
3. guard: round-robin replicas are planned heaviest first until one is at least as slow as the
   balanced split's slowest (usually the first); if none is, round-robin is returned. So the
   balanced split is never slower than round-robin, at about one extra plan.

Every replica is planned once however often the search meets it (a memo keyed by its rows), and
the returned ``DPSplit.plans`` are those plans: nothing is planned again. Every sample lands in
exactly one replica (``DPSplit.replicas`` partitions the batch's rows) and the split is
deterministic: stable sorts, ties broken by replica number, so the same batch, ``D`` and planner
give the same split and plans.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from pipetune.data.images import ImageSizing
from pipetune.config.model import ModelConfig
from pipetune.data.batch import BatchMeta
from pipetune.packing.flops import FlopsModel
from pipetune.plan.plan import IterationPlan

PlanOf = Callable[[BatchMeta], IterationPlan]


@dataclass(frozen=True)
class DPSplit:
    """Row indices into the batch's table (ascending), one array per replica; ``plans[r]`` is the
    plan of exactly replica ``r``'s samples; ``plans_made``: ``plan_of`` calls the split took."""

    replicas: tuple[np.ndarray, ...]
    plans: tuple[IterationPlan, ...]
    plans_made: int

    @property
    def iter_s(self) -> np.ndarray:
        """Each replica's planned time."""
        return np.array([p.predicted_s for p in self.plans])

    @property
    def step_s(self) -> float:
        """The step's time: its slowest replica's."""
        return float(self.iter_s.max())

    @property
    def spread(self) -> float:
        """Slowest replica over the mean: 1.0 is perfect balance."""
        t = self.iter_s
        return float(t.max() / t.mean())


def sample_flops(model: ModelConfig, meta: BatchMeta) -> np.ndarray:
    f = FlopsModel(model)
    tpi = model.tokens_per_image
    standard_images = meta.table.sample_image_tokens / tpi if tpi else meta.table.num_images  # images at their own size
    return f.sequence_flops(meta.table.lengths) + f.encoder_flops(standard_images)


def replica_meta(meta: BatchMeta, idx: np.ndarray) -> BatchMeta:
    """The part of ``meta`` made of table rows ``idx``, in the batch's row order."""
    idx = np.sort(np.asarray(idx, dtype=np.int64))
    return replace(meta, rows=meta.rows[idx], table=meta.table.take(idx))


def even_split(n: int, dp: int) -> list[np.ndarray]:
    """Round-robin, as the data loader deals samples."""
    return [np.arange(r, n, dp, dtype=np.int64) for r in range(dp)]


def lpt_split(weights: np.ndarray, dp: int) -> list[np.ndarray]:
    """Longest-processing-time first with round-robin's sample counts (module doc, 1): the
    ``dp * (n // dp)`` heaviest samples each to the least loaded replica not yet full (a heap, ties
    to the lowest replica), then the ``n % dp`` lightest one each to the least loaded replicas."""
    n = len(weights)
    full = n // dp
    heavy_first = np.argsort(-weights, kind="stable")
    w = weights.tolist()
    load, count = [0.0] * dp, [0] * dp
    owner = np.empty(n, dtype=np.int64)
    heap = [(0.0, r) for r in range(dp)]
    dealt = heavy_first[: full * dp].tolist()
    owners = []
    for i in dealt:
        _, r = heapq.heappop(heap)
        owners.append(r)
        load[r] += w[i]
        count[r] += 1
        if count[r] < full:
            heapq.heappush(heap, (load[r], r))
    owner[dealt] = owners
    owner[heavy_first[full * dp :]] = np.argsort(load, kind="stable")[: n % dp]
    return [np.flatnonzero(owner == r) for r in range(dp)]


class _Planned:
    """``plan_of`` behind a memo keyed by a replica's (ascending) rows, checking what comes back."""

    def __init__(self, meta: BatchMeta, plan_of: PlanOf):
        self.meta, self.plan_of = meta, plan_of
        self.memo: dict[bytes, IterationPlan] = {}

    def __call__(self, idx: np.ndarray) -> IterationPlan:
        key = idx.tobytes()
        if key not in self.memo:
            plan = self.plan_of(replica_meta(self.meta, idx))
            if plan.step != self.meta.step or sorted(plan.sample_ids()) != sorted(self.meta.table.ids[idx].tolist()):
                raise ValueError(f"plan_of returned a plan of step {plan.step} that does not plan the replica's "
                                 f"{len(idx)} samples of step {self.meta.step}")
            self.memo[key] = plan
        return self.memo[key]

    def split(self, parts: list[np.ndarray]) -> DPSplit:
        return DPSplit(tuple(parts), tuple(self(p) for p in parts), len(self.memo))


def _refine(parts: list[np.ndarray], times: np.ndarray, w: np.ndarray, planned: _Planned, *, rounds: int, tries: int,
            min_gain: float) -> None:
    """Swap samples between the slowest and the fastest replica (module doc, 2), in place."""
    flops_per_s = w.sum() / times.sum()
    for _ in range(rounds):
        slow, fast = int(np.argmax(times)), int(np.argmin(times))
        if times[slow] <= (1 + min_gain) * times.mean():
            return
        a, b = parts[slow], parts[fast]
        diff = w[a][:, None] - w[b][None, :]
        target = (times[slow] - times[fast]) / 2 * flops_per_s
        for k in np.argsort(np.abs(diff - target), axis=None, kind="stable")[:tries]:
            i, j = np.unravel_index(k, diff.shape)
            na, nb = np.sort(np.append(np.delete(a, i), b[j])), np.sort(np.append(np.delete(b, j), a[i]))
            ta, tb = planned(na).predicted_s, planned(nb).predicted_s
            if max(ta, tb) < times[slow]:
                parts[slow], parts[fast] = na, nb
                times[slow], times[fast] = ta, tb
                break
        else:
            return


def split_and_plan(meta: BatchMeta, dp: int, model: ModelConfig, plan_of: PlanOf, *, balanced: bool, rounds: int = 8,
                   tries: int = 4, min_gain: float = 0.001) -> DPSplit:
    """Split ``meta`` over ``dp`` replicas and plan each with ``plan_of`` (a replica's ``BatchMeta`` ->
    its plan, of step ``meta.step``): round-robin (the loader's split, the fixed baseline's) or, with
    ``balanced``, the balanced split (module doc). The plans come out of the split: the runtime runs
    ``plans[r]`` on replica ``r``."""
    n = len(meta.table)
    if dp < 1 or n < dp:
        raise ValueError(f"cannot split a batch of {n} samples over dp={dp} replicas: every replica needs at least one sample")
    planned = _Planned(meta, plan_of)
    rr = even_split(n, dp)
    if not balanced:
        return planned.split(rr)
    w = sample_flops(model, meta)
    parts = lpt_split(w, dp)
    times = np.array([planned(p).predicted_s for p in parts])
    if dp > 1:
        _refine(parts, times, w, planned, rounds=rounds, tries=tries, min_gain=min_gain)
    slowest = times.max()
    heavy_first = np.argsort(-np.array([w[p].sum() for p in rr]), kind="stable")
    if all(planned(rr[r]).predicted_s < slowest for r in heavy_first):
        parts = rr
    return planned.split(parts)


def compare_dp(model: ModelConfig, planner, data, *, dp: int, gbs: int, max_seq_len: int, iters: int, seed: int = 0,
               overlong="truncate", warmup: int = 0) -> dict:
    """Per iteration of ``gbs`` samples: each replica planned by ``planner`` under the round-robin and
    the balanced split; the step takes its slowest replica's time. ``planning_s``: wall-clock
    seconds of each ``split_and_plan`` (the split plus the plans the planner process makes per
    step). The first ``warmup`` iterations warm the planner's caches and are not counted; the
    balanced split is timed first, so whatever the other split warms favours round-robin's time."""
    from pipetune.data.batch import batch_meta
    from pipetune.data.stream import BatchStream

    if gbs % dp:
        raise ValueError(f"global batch size {gbs} is not a multiple of dp={dp}")
    stream = BatchStream(num_rows=len(data), gbs=gbs, seed=seed)
    rows = {"balanced": [], "round_robin": []}
    for step in range(warmup + iters):
        meta = batch_meta(data, stream, step, images=ImageSizing.for_model(model), max_seq_len=max_seq_len, overlong=overlong)
        for name in rows:
            t0 = time.perf_counter()
            split = split_and_plan(meta, dp, model, planner.plan, balanced=name == "balanced")
            if step >= warmup:
                rows[name].append((split, time.perf_counter() - t0))
    out = {}
    for name in ("round_robin", "balanced"):
        splits, secs = [s for s, _ in rows[name]], [t for _, t in rows[name]]
        out[name] = {
            "mean_iter_s": float(np.mean([s.step_s for s in splits])),
            "spread_max_over_mean": float(np.mean([s.spread for s in splits])),
            "spread_max_minus_min_s": float(np.mean([np.ptp(s.iter_s) for s in splits])),
            "plans_per_step": float(np.mean([s.plans_made for s in splits])),
            "planning_s_p50": float(np.percentile(secs, 50)),
            "planning_s_p90": float(np.percentile(secs, 90)),
            "planning_s": secs,
        }
    out["cut_vs_round_robin"] = 1 - out["balanced"]["mean_iter_s"] / out["round_robin"]["mean_iter_s"]
    return out
