"""Data-parallel balance: split each global batch over ``D`` pipeline replicas so the slowest one,
which gates the step, is as fast as possible, at a cost that does not grow with ``D`` times a plan.

TorchTitan's data loader deals samples round-robin, blind to their cost, so one replica can draw
the interleaved documents with many images while another draws text. ``split_batch(...,
balanced=True)`` makes the global decision only; every replica then plans its own share
(``pipetune.plan.data_parallel.replicas.SharePlanner``, on the replica's own ranks in a job):

1. ``ShareCost``: the busy seconds each sample adds to each rank of a pipeline when packed, from
   the latency table (attention per document; token-linear parts and the encoder at the per-token
   and per-image rates of a full micro-batch, so small samples are not charged a whole kernel
   launch), rounded to integer nanoseconds. A share's estimate is its busiest rank's load: the
   work no schedule of that share can avoid on that rank (the pipeline's fill is about the same
   for every share of a balanced split, so it does not decide between them).
2. LPT in blocks: samples in decreasing order of total work, ``D`` at a time, the block's
   heaviest to the replica with the least busiest-rank load, the next to the next. Every replica
   keeps the sample count round-robin gives it (``n // D``, one more for ``n % D`` of them), so
   per-replica batch shapes and loss normalisation stay the loader's.
3. Refinement, ``rounds`` at most: the replica with the largest estimate swaps the one pair of
   samples with the replica with the smallest that lowers the larger of the two estimates most
   (every pair at once, vectorised over the ``C x C`` heaviest / lightest candidates); it stops
   when no pair helps.
4. Round-robin is kept when its largest estimate is no larger.

Cost: the work table is one vectorised pass over the batch; LPT is ``n / D`` vectorised rounds of
``O(D log D)``; a round of refinement is ``O(C^2 R + D)``. Nothing is planned (0.1 s for 65,536
samples over 1,024 replicas on one core, ``benchmarks/dp_balance.py``). Determinism: integer
loads, stable sorts, ties to the lowest replica, and no time budget, so every rank that computes
the split from the same batch and table gets the same one (a job's leads check that their shares
partition the batch: ``pipetune.data.batch.id_checksum``). Every sample lands in exactly one
replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipetune.config.model import ModelConfig
from pipetune.cost.cost_model import CostModel, MicroBatchShapes
from pipetune.data.batch import BatchMeta
from pipetune.data.images import ImageSizing
from pipetune.plan.plan import IterationPlan

PlanOf = Callable[[BatchMeta], IterationPlan]
TOKEN_LINEAR = ("rest", "embedding", "head", "linear_attention")
CANDIDATES = 256  # per side of a refinement swap


class ShareCost:
    """Per-sample, per-rank busy seconds of a pipeline with ``cost``'s table and layout (module
    doc, 1); ``packed_tokens``: the tokens of a full micro-batch, where the rates are read."""

    def __init__(self, cost: CostModel, *, packed_tokens: int):
        if packed_tokens < 1:
            raise ValueError(f"packed_tokens must be >= 1, got {packed_tokens}")
        self.cost = cost
        placement = cost.placement()
        self.ranks = placement.num_ranks
        self.backbone_rank = np.asarray(placement.backbone)
        self.encoder_rank = np.asarray(placement.encoder)
        parts, _ = cost.components(self._shapes(np.array([packed_tokens]), np.zeros(1, np.int64), None))
        self.per_token = sum(cost.table.scale(n) * (p["fwd"][0] + p["bwd"][0]) for n, p in parts.items() if n in TOKEN_LINEAR) / packed_tokens
        enc = cost.table.model.encoder
        self.per_image = np.zeros(len(cost.encoder_share))
        if enc is not None:
            k = max(1, packed_tokens // max(1, cost.table.model.tokens_per_image))
            f, _ = cost.encoder_curve(np.array([k]), "fwd")
            per = f[0]
            if cost.encoder_trainable:
                b, _ = cost.encoder_curve(np.array([k]), "bwd")
                per += b[0] + (f[0] if cost.recompute_encoder else 0.0)
            self.per_image = cost.table.scale("encoder") * per / k * cost.encoder_share

    @staticmethod
    def _shapes(lengths: np.ndarray, images: np.ndarray, image_tokens: np.ndarray | None) -> MicroBatchShapes:
        n = len(lengths)
        return MicroBatchShapes(doc_lengths=lengths, doc_mb=np.arange(n), tokens=lengths, images=images, image_tokens=image_tokens)

    def work(self, meta: BatchMeta) -> np.ndarray:
        """``(samples, ranks)`` integer nanoseconds each sample adds to each rank."""
        t, cost = meta.table, self.cost
        lengths = t.lengths
        shapes = self._shapes(lengths, t.num_images, t.sample_image_tokens)
        parts, _ = cost.components(shapes)
        stage = lengths[:, None] * self.per_token[None, :]
        for name, p in parts.items():
            if name not in TOKEN_LINEAR:
                stage = stage + cost.table.scale(name) * (p["fwd"] + p["bwd"])
        out = np.zeros((len(t), self.ranks))
        np.add.at(out.T, self.backbone_rank, stage.T)
        if len(self.encoder_rank):
            units = cost.image_units(shapes).astype(np.float64)
            enc = units[:, None] * self.per_image[None, :]
            np.add.at(out.T, self.encoder_rank, enc.T)
        return np.rint(out * 1e9).astype(np.int64)


@dataclass(frozen=True)
class Split:
    """Row indices into the batch's table (ascending), one array per replica, and each replica's
    estimate (busiest-rank load, seconds; ``nan`` for a round-robin split made without a cost)."""

    replicas: tuple[np.ndarray, ...]
    estimate_s: np.ndarray


@dataclass(frozen=True)
class DPSplit:
    """A split and every replica's plan: ``plans[r]`` plans exactly replica ``r``'s samples."""

    split: Split
    plans: tuple[IterationPlan, ...]

    @property
    def replicas(self) -> tuple[np.ndarray, ...]:
        return self.split.replicas

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


def replica_meta(meta: BatchMeta, idx: np.ndarray) -> BatchMeta:
    """The share of ``meta`` made of table rows ``idx``, in the batch's row order."""
    return meta.take(idx)


def even_split(n: int, dp: int) -> list[np.ndarray]:
    """Round-robin, as the data loader deals samples."""
    return [np.arange(r, n, dp, dtype=np.int64) for r in range(dp)]


def lpt_split(work: np.ndarray, dp: int) -> list[np.ndarray]:
    """Longest-processing-time first with round-robin's sample counts (module doc, 2), dealt in
    blocks: ``work`` is ``(n,)`` weights or ``(n, ranks)`` loads, balanced by the busiest rank's.
    Samples in decreasing order of total work, ``dp`` at a time: the block's heaviest goes to the
    least loaded replica, its next to the next (a stable sort, ties to the lowest replica), so
    every replica takes one sample a block; the ``n % dp`` lightest go one each to the least
    loaded. ``n // dp`` vectorised rounds instead of ``n`` heap operations."""
    work = np.asarray(work)
    if work.ndim == 1:
        work = work[:, None]
    n = len(work)
    heavy_first = np.argsort(-work.sum(axis=1), kind="stable")
    load = np.zeros((dp, work.shape[1]), dtype=work.dtype)
    owner = np.empty(n, dtype=np.int64)
    for start in range(0, n, dp):
        block = heavy_first[start : start + dp]
        least = np.argsort(load.max(axis=1), kind="stable")[: len(block)]
        owner[block] = least
        load[least] += work[block]
    return [np.flatnonzero(owner == r) for r in range(dp)]


def _best_swap(wa: np.ndarray, wb: np.ndarray, la: np.ndarray, lb: np.ndarray) -> tuple[int, int, int]:
    """The pair (``i`` of a, ``j`` of b) whose swap gives the smallest larger busiest-rank load of
    the two, and that load (candidates: a's heaviest, b's lightest)."""
    ca = np.argsort(-wa.sum(axis=1), kind="stable")[:CANDIDATES]
    cb = np.argsort(wb.sum(axis=1), kind="stable")[:CANDIDATES]
    delta = wb[cb][None, :, :] - wa[ca][:, None, :]  # (i, j, rank): a's change
    worst = np.maximum((la + delta).max(axis=2), (lb - delta).max(axis=2))
    k = int(np.argmin(worst))
    i, j = divmod(k, worst.shape[1])
    return int(ca[i]), int(cb[j]), int(worst.flat[k])


def _refine(parts: list[np.ndarray], work: np.ndarray, rounds: int) -> np.ndarray:
    """Swap pairs between the replica with the largest and the smallest estimate (module doc, 3),
    in place; returns every replica's load vector."""
    loads = np.stack([work[p].sum(axis=0) for p in parts])
    est = loads.max(axis=1)
    for _ in range(rounds):
        slow, fast = int(np.argmax(est)), int(np.argmin(est))
        if slow == fast:
            break
        a, b = parts[slow], parts[fast]
        i, j, worst = _best_swap(work[a], work[b], loads[slow], loads[fast])
        if worst >= est[slow]:
            break
        parts[slow] = np.sort(np.append(np.delete(a, i), b[j]))
        parts[fast] = np.sort(np.append(np.delete(b, j), a[i]))
        for r in (slow, fast):
            loads[r] = work[parts[r]].sum(axis=0)
            est[r] = loads[r].max()
    return loads


def split_batch(meta: BatchMeta, dp: int, share_cost: ShareCost | None = None, *, balanced: bool, rounds: int = 64) -> Split:
    """Split ``meta`` over ``dp`` replicas: round-robin (the loader's split, the fixed baseline's)
    or, with ``balanced``, the balanced split of the module doc, estimated by ``share_cost``."""
    n = len(meta.table)
    if dp < 1 or n < dp:
        raise ValueError(f"cannot split a batch of {n} samples over dp={dp} replicas: every replica needs at least one sample")
    rr = even_split(n, dp)
    if share_cost is None:
        if balanced:
            raise ValueError("the balanced split needs a ShareCost")
        return Split(tuple(rr), np.full(dp, np.nan))
    work = share_cost.work(meta)
    rr_load = np.zeros((dp, work.shape[1]), dtype=work.dtype)
    np.add.at(rr_load, np.arange(n) % dp, work)
    rr_est = rr_load.max(axis=1)
    if not balanced or dp == 1:
        return Split(tuple(rr), rr_est / 1e9)
    parts = lpt_split(work, dp)
    est = _refine(parts, work, rounds).max(axis=1)
    if rr_est.max() <= est.max():
        parts, est = rr, rr_est
    return Split(tuple(parts), est / 1e9)


def plan_split(meta: BatchMeta, split: Split, plan_of: PlanOf) -> DPSplit:
    """Every replica's share of ``split`` planned by ``plan_of`` (checked to plan exactly it)."""
    plans = []
    for idx in split.replicas:
        plan = plan_of(replica_meta(meta, idx))
        if plan.step != meta.step or sorted(plan.sample_ids()) != sorted(meta.table.ids[idx].tolist()):
            raise ValueError(f"plan_of returned a plan of step {plan.step} that does not plan the replica's "
                             f"{len(idx)} samples of step {meta.step}")
        plans.append(plan)
    return DPSplit(split, tuple(plans))


def share_cost_for(planner, max_seq_len: int) -> ShareCost:
    """The ``ShareCost`` of ``planner``'s profiled model, read at full micro-batches of ``max_seq_len``."""
    return ShareCost(planner.cost, packed_tokens=max_seq_len)


def compare_dp(model: ModelConfig, planner, data, *, dp: int, gbs: int, max_seq_len: int, iters: int, seed: int = 0,
               overlong="truncate", warmup: int = 0, share_cost: ShareCost | None = None) -> dict:
    """Per iteration of ``gbs`` samples, round-robin and the balanced split, every replica planned
    by ``planner``; the step takes its slowest replica's time. Planning on the critical path, as a
    job runs it: ``split_s`` (the split, every rank or one) plus the slowest replica's own plan
    (each replica plans on its own ranks, in parallel); ``plans_per_rank``: 1. The first
    ``warmup`` iterations warm the planner's caches and are not counted."""
    from pipetune.data.batch import batch_meta
    from pipetune.data.stream import BatchStream

    if gbs % dp:
        raise ValueError(f"global batch size {gbs} is not a multiple of dp={dp}")
    share_cost = share_cost or share_cost_for(planner, max_seq_len)
    stream = BatchStream(num_rows=len(data), gbs=gbs, seed=seed)
    rows = {"balanced": [], "round_robin": []}
    for step in range(warmup + iters):
        meta = batch_meta(data, stream, step, images=ImageSizing.for_model(model), max_seq_len=max_seq_len, overlong=overlong)
        for name in rows:
            t0 = time.perf_counter()
            split = split_batch(meta, dp, share_cost, balanced=name == "balanced")
            split_s = time.perf_counter() - t0
            plans, plan_s = [], []
            for idx in split.replicas:
                share = replica_meta(meta, idx)
                t0 = time.perf_counter()
                plans.append(planner.plan(share))
                plan_s.append(time.perf_counter() - t0)
            if step >= warmup:
                rows[name].append((DPSplit(split, tuple(plans)), split_s, np.array(plan_s)))
    out = {}
    for name in ("round_robin", "balanced"):
        splits = [s for s, _, _ in rows[name]]
        split_s = np.array([t for _, t, _ in rows[name]])
        plan_max = np.array([p.max() for _, _, p in rows[name]])
        critical = split_s + plan_max
        est = np.concatenate([s.split.estimate_s for s in splits])
        planned = np.concatenate([s.iter_s for s in splits])
        out[name] = {
            "mean_iter_s": float(np.mean([s.step_s for s in splits])),
            "spread_max_over_mean": float(np.mean([s.spread for s in splits])),
            "spread_max_minus_min_s": float(np.mean([np.ptp(s.iter_s) for s in splits])),
            "split_s_p50": float(np.percentile(split_s, 50)),
            "replica_plan_s_p50": float(np.percentile(np.concatenate([p for _, _, p in rows[name]]), 50)),
            "replica_plan_s_max_p90": float(np.percentile(plan_max, 90)),
            "planning_s_p50": float(np.percentile(critical, 50)),
            "planning_s_p90": float(np.percentile(critical, 90)),
            "planning_s": critical.tolist(),
            "estimate_vs_planned_corr": float(np.corrcoef(est, planned)[0, 1]) if len(est) > 2 and np.ptp(est) > 0 else float("nan"),
        }
    out["cut_vs_round_robin"] = 1 - out["balanced"]["mean_iter_s"] / out["round_robin"]["mean_iter_s"]
    return out
