"""Data-parallel split: exact coverage with the loader's sample counts, determinism across
processes, a cheap estimate that ranks shares as the planner does, a split better than
round-robin, and the coverage checksum the replicas' leads compare."""

import pickle

import numpy as np
import pytest

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.data import make_mix
from pipetune.data.batch import batch_meta
from pipetune.data.images import ImageSizing
from pipetune.data.stream import BatchStream
from pipetune.plan.data_parallel.dp_balance import ShareCost, compare_dp, even_split, lpt_split, plan_split, replica_meta, split_batch
from pipetune.plan.mode import Mode
from pipetune.plan.layout.planner_config import PlannerConfig
from pipetune.data.batch import BatchReader, id_checksum
from pipetune.plan.data_parallel.replicas import ReplicaShare, SharePlanner

MODEL = load_model_config("7b")
COST = CostModel(analytical_table(MODEL, load_hardware("a100"), tp=4), StageLayout.even(32, 4))
SHARE_COST = ShareCost(COST, packed_tokens=4096)
DATA = make_mix("datamix2", 2000, 0)


def planner(mode=Mode.BALANCED):
    return PlannerConfig(mode=mode, max_seq_len=4096, memory_bytes=80 * 2**30).build(MODEL, COST)


def meta_of(gbs, step=0, overlong="truncate"):
    return batch_meta(DATA, BatchStream(num_rows=len(DATA), gbs=gbs), step, images=ImageSizing.for_model(MODEL),
                      max_seq_len=4096, overlong=overlong)


@pytest.mark.parametrize("ranks", [1, 3])
def test_lpt_split_is_a_partition_with_round_robins_counts(ranks):
    w = np.random.default_rng(0).pareto(1.5, (103, ranks))
    parts = lpt_split(w if ranks > 1 else w[:, 0], 4)
    assert sorted(np.concatenate(parts).tolist()) == list(range(103))
    assert sorted(map(len, parts)) == sorted(map(len, even_split(103, 4)))


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("gbs,dp,step", [(64, 4, 0), (64, 8, 1), (96, 3, 2), (50, 4, 3), (32, 1, 0)])
def test_every_sample_in_exactly_one_replica_with_round_robins_counts(gbs, dp, step, balanced):
    meta = meta_of(gbs, step)
    split = split_batch(meta, dp, SHARE_COST, balanced=balanced)
    assert len(split.replicas) == len(split.estimate_s) == dp
    assert np.array_equal(np.sort(np.concatenate(split.replicas)), np.arange(len(meta.table)))
    assert sorted(map(len, split.replicas)) == sorted(map(len, even_split(len(meta.table), dp)))
    assert all(np.array_equal(idx, np.sort(idx)) for idx in split.replicas)


@pytest.mark.parametrize("step", [0, 1])
def test_every_process_computes_the_same_split(step):
    """A lead computes the split from its own copy of the cost (here one that went through pickle,
    as to the planner process); each replica's share of it is the same."""
    meta = meta_of(256, step)
    other = pickle.loads(pickle.dumps(SHARE_COST))
    a, b = split_batch(meta, 8, SHARE_COST, balanced=True), split_batch(meta, 8, other, balanced=True)
    assert all(np.array_equal(x, y) for x, y in zip(a.replicas, b.replicas))
    shares = [ReplicaShare(8, r, other).of(meta).table.ids for r in range(8)]
    assert all(np.array_equal(s, meta.table.ids[idx]) for s, idx in zip(shares, a.replicas))


def test_the_estimate_ranks_shares_as_the_planner_does_and_never_exceeds_its_plan():
    """Round-robin shares differ a lot in cost: the estimate (busiest rank's packed work) orders
    them as the planner's plans do, and no plan beats it (it is work the rank cannot skip)."""
    p = planner()
    est, planned = [], []
    for step in range(3):
        meta = meta_of(256, step)
        split = split_batch(meta, 8, SHARE_COST, balanced=False)
        est += split.estimate_s.tolist()
        planned += [p.plan(replica_meta(meta, idx)).predicted_s for idx in split.replicas]
    assert np.corrcoef(est, planned)[0, 1] > 0.95
    assert all(e <= t for e, t in zip(est, planned))


@pytest.mark.parametrize("gbs,dp", [(64, 4), (128, 8), (96, 2)])
def test_the_balanced_split_plans_faster_than_round_robin(gbs, dp):
    p = planner()
    cuts = []
    for step in range(3):
        meta = meta_of(gbs, step)
        rr, bal = (plan_split(meta, split_batch(meta, dp, SHARE_COST, balanced=b), p.plan) for b in (False, True))
        assert bal.split.estimate_s.max() <= rr.split.estimate_s.max()
        cuts.append(1 - bal.step_s / rr.step_s)
    assert np.mean(cuts) > 0.05 and min(cuts) > -0.02


def test_round_robin_is_kept_when_balancing_cannot_lower_the_busiest_replica():
    meta = meta_of(64)
    t = meta.table
    same = meta.__class__(meta.step, meta.rows, t.take(np.zeros(len(t), dtype=np.int64)), meta.overlong)  # 64 copies of one sample
    split = split_batch(same, 4, SHARE_COST, balanced=True)
    assert all(np.array_equal(a, b) for a, b in zip(split.replicas, even_split(64, 4)))


def test_the_separated_layout_loads_every_rank_with_image_work():
    enc = MODEL.encoder.n_layers
    cost = CostModel(COST.table, StageLayout.even(32, 4).separated(enc, 4, 8))
    meta = meta_of(64)
    work = ShareCost(cost, packed_tokens=4096).work(meta)
    colocated = SHARE_COST.work(meta)
    with_images = meta.table.num_images > 0
    assert (work[with_images] > 0).all() and work.shape == colocated.shape
    text = ~with_images
    assert np.array_equal(work[text], colocated[text])  # text-only samples: the same backbone layout, the same work


def test_share_planner_plans_only_its_replicas_share_and_the_shares_partition_the_batch():
    meta = meta_of(64, 2)
    p = planner(Mode.PIPETUNE)
    made = [SharePlanner(p, ReplicaShare(4, r, SHARE_COST)).plan(meta) for r in range(4)]
    ids = [sorted(x.plan.sample_ids()) for x in made]
    assert [x.plans.first for x in made] == [0, 1, 2, 3]
    assert all(sorted(x.share.table.ids.tolist()) == i and x.share.whole == meta.totals for x, i in zip(made, ids))
    assert sorted(sum(ids, [])) == sorted(meta.table.ids.tolist())
    fallback = SharePlanner(p, ReplicaShare(4, 1, SHARE_COST)).fallback(meta, "the planner process died")
    assert fallback.plan.fallback and sorted(fallback.plan.sample_ids()) == ids[1]


@pytest.mark.parametrize("overlong", ["truncate", "reject"])
def test_a_share_read_from_its_rows_alone_is_the_global_batch_cut_to_them(overlong):
    """What a rank of a replica reads (its share's rows, the whole batch's totals) gives the same
    samples, tokens and images as the global batch's metadata cut to the share."""
    reader = BatchReader(DATA, BatchStream(num_rows=len(DATA), gbs=256), ImageSizing.for_model(MODEL), 1024, overlong)
    meta = reader(3)
    assert meta.overlong.rejected_ids or meta.overlong.truncated_ids  # the policy has work to do at 1024 tokens
    for idx in split_batch(meta, 4, SHARE_COST, balanced=True).replicas:
        cut = meta.take(idx)
        read = reader.rows(3, cut.rows, cut.whole)
        assert np.array_equal(read.rows, cut.rows) and read.whole == cut.whole == meta.totals
        for field in ("ids", "text_tokens", "num_images", "image_tokens", "image_offsets", "image_ptr", "image_sizes"):
            assert np.array_equal(getattr(read.table, field), getattr(cut.table, field)), field


def test_id_checksum_sums_to_the_batch_only_over_a_partition():
    ids = np.random.default_rng(1).choice(10**9, 4096, replace=False)
    want = id_checksum(ids)
    parts = np.array_split(ids, 7)
    count, total = map(sum, zip(*(id_checksum(p) for p in parts)))
    assert (count, total % 2**40) == want
    dup = parts[:6] + [np.append(parts[6][1:], parts[0][0])]  # one sample lost, another twice: same count
    count, total = map(sum, zip(*(id_checksum(p) for p in dup)))
    assert count == want[0] and total % 2**40 != want[1]


def test_fewer_samples_than_replicas_is_an_error_naming_both():
    with pytest.raises(ValueError, match="batch of 4 samples over dp=8"):
        split_batch(meta_of(4), 8, SHARE_COST, balanced=True)


def test_global_batch_not_a_multiple_of_dp_is_an_error_naming_both():
    with pytest.raises(ValueError, match="global batch size 50 is not a multiple of dp=4"):
        compare_dp(MODEL, planner(), DATA, dp=4, gbs=50, max_seq_len=4096, iters=1)


def test_a_plan_of_other_samples_is_refused():
    meta = meta_of(32)
    p = planner()
    with pytest.raises(ValueError, match="does not plan the replica"):
        plan_split(meta, split_batch(meta, 2, None, balanced=False), lambda m: p.plan(meta))


def test_compare_dp_reports_the_cut_and_the_critical_path():
    out = compare_dp(MODEL, planner(), DATA, dp=4, gbs=64, max_seq_len=4096, iters=2, warmup=1)
    assert out["balanced"]["mean_iter_s"] <= out["round_robin"]["mean_iter_s"]
    for name in ("balanced", "round_robin"):
        d = out[name]
        assert len(d["planning_s"]) == 2 and d["planning_s_p50"] >= d["split_s_p50"] > 0
