"""Data-parallel split: exact coverage with the loader's sample counts, plans that come out of the
split (never made twice), determinism, and never slower than round-robin."""

from dataclasses import replace

import numpy as np
import pytest

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.data import make_mix
from pipetune.data.batch import batch_meta
from pipetune.data.stream import BatchStream
from pipetune.plan.dp_balance import compare_dp, even_split, lpt_split, split_and_plan
from pipetune.plan.mode import Mode
from pipetune.plan.planner_config import PlannerConfig
from pipetune.data.images import ImageSizing

MODEL = load_model_config("7b")
COST = CostModel(analytical_table(MODEL, load_hardware("a100"), tp=4), StageLayout.even(32, 4))
DATA = make_mix("datamix2", 2000, 0)


def planner(mode=Mode.BALANCED):
    return PlannerConfig(mode=mode, max_seq_len=4096, memory_bytes=80 * 2**30).build(MODEL, COST)


def meta_of(gbs, step=0, overlong="truncate"):
    return batch_meta(DATA, BatchStream(num_rows=len(DATA), gbs=gbs), step, images=ImageSizing.for_model(MODEL),
                      max_seq_len=4096, overlong=overlong)


class Counting:
    """``plan_of`` that records every plan it makes, keyed by the replica's sample ids."""

    def __init__(self, planner):
        self.planner, self.made = planner, []

    def __call__(self, meta):
        plan = self.planner.plan(meta)
        self.made.append((tuple(sorted(meta.table.ids.tolist())), plan))
        return plan


def test_lpt_split_is_a_partition_with_round_robins_counts():
    w = np.random.default_rng(0).pareto(1.5, 103)
    parts = lpt_split(w, 4)
    assert sorted(np.concatenate(parts).tolist()) == list(range(103))
    assert sorted(map(len, parts)) == sorted(map(len, even_split(103, 4)))


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("gbs,dp,step", [(64, 4, 0), (64, 8, 1), (96, 3, 2), (50, 4, 3), (32, 1, 0)])
def test_every_sample_in_exactly_one_replica_and_plans_match_their_replica(gbs, dp, step, balanced):
    meta = meta_of(gbs, step)
    split = split_and_plan(meta, dp, MODEL, planner().plan, balanced=balanced)
    assert len(split.replicas) == len(split.plans) == dp
    assert np.array_equal(np.sort(np.concatenate(split.replicas)), np.arange(len(meta.table)))
    assert sorted(map(len, split.replicas)) == sorted(map(len, even_split(len(meta.table), dp)))
    for idx, plan in zip(split.replicas, split.plans):
        assert np.array_equal(idx, np.sort(idx))
        assert plan.step == meta.step
        plan.validate(meta.table.ids[idx])
    assert np.array_equal(split.iter_s, [p.predicted_s for p in split.plans])


def test_final_plans_are_among_those_made_and_none_is_made_twice():
    meta = meta_of(128, 1)
    plan_of = Counting(planner(Mode.PIPETUNE))
    split = split_and_plan(meta, 4, MODEL, plan_of, balanced=True)
    keys = [k for k, _ in plan_of.made]
    assert len(keys) == len(set(keys)) == split.plans_made
    assert split.plans_made > 4 + 1, "the refinement should have planned candidate swaps in this batch"
    made = dict(plan_of.made)
    for idx, plan in zip(split.replicas, split.plans):
        assert made[tuple(sorted(meta.table.ids[idx].tolist()))] is plan


def test_round_robin_plans_each_replica_once():
    plan_of = Counting(planner())
    split = split_and_plan(meta_of(64), 4, MODEL, plan_of, balanced=False)
    assert split.plans_made == len(plan_of.made) == 4
    assert [p for _, p in plan_of.made] == list(split.plans)


@pytest.mark.parametrize("step", [0, 1])
def test_same_inputs_give_the_same_split(step):
    meta = meta_of(128, step)
    a, b = (split_and_plan(meta, 4, MODEL, planner(Mode.PIPETUNE).plan, balanced=True) for _ in range(2))
    assert all(np.array_equal(x, y) for x, y in zip(a.replicas, b.replicas))
    assert [replace(p, search_s=0.0) for p in a.plans] == [replace(p, search_s=0.0) for p in b.plans]  # all but wall time


@pytest.mark.parametrize("gbs,dp", [(64, 4), (128, 8), (96, 2)])
def test_balanced_is_never_slower_than_round_robin(gbs, dp):
    p = planner()
    for step in range(3):
        meta = meta_of(gbs, step)
        rr = split_and_plan(meta, dp, MODEL, p.plan, balanced=False)
        bal = split_and_plan(meta, dp, MODEL, p.plan, balanced=True)
        assert bal.step_s <= rr.step_s


def test_fewer_samples_than_replicas_is_an_error_naming_both():
    with pytest.raises(ValueError, match="batch of 4 samples over dp=8"):
        split_and_plan(meta_of(4), 8, MODEL, planner().plan, balanced=True)


def test_global_batch_not_a_multiple_of_dp_is_an_error_naming_both():
    with pytest.raises(ValueError, match="global batch size 50 is not a multiple of dp=4"):
        compare_dp(MODEL, planner(), DATA, dp=4, gbs=50, max_seq_len=4096, iters=1)


def test_a_plan_of_other_samples_is_refused():
    meta = meta_of(32)
    p = planner()
    with pytest.raises(ValueError, match="does not plan the replica"):
        split_and_plan(meta, 2, MODEL, lambda m: p.plan(meta), balanced=False)


def test_compare_dp_reports_the_cut_and_the_planning_time():
    out = compare_dp(MODEL, planner(), DATA, dp=4, gbs=64, max_seq_len=4096, iters=2, warmup=1)
    assert out["balanced"]["mean_iter_s"] <= out["round_robin"]["mean_iter_s"]
    assert out["round_robin"]["plans_per_step"] == 4
    assert len(out["balanced"]["planning_s"]) == 2 and out["balanced"]["planning_s_p50"] > 0


def test_round_robin_is_kept_when_the_balanced_split_is_slower():
    meta = meta_of(64)
    rr = {tuple(meta.table.ids[idx].tolist()) for idx in even_split(len(meta.table), 4)}
    p = planner()

    def plan_of(m):  # round-robin's replicas planned twice as fast as any other
        plan = p.plan(m)
        return replace(plan, predicted_s=plan.predicted_s / 2) if tuple(m.table.ids.tolist()) in rr else plan

    split = split_and_plan(meta, 4, MODEL, plan_of, balanced=True)
    assert all(np.array_equal(a, b) for a, b in zip(split.replicas, even_split(len(meta.table), 4)))
