"""Data-parallel split: exact coverage, equal sample counts, and never slower than round-robin."""

import numpy as np

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.data import make_mix
from pipetune.data.batch import batch_meta
from pipetune.data.stream import BatchStream
from pipetune.plan.dp_balance import balance, lpt_split
from pipetune.plan.mode import Mode
from pipetune.plan.planner_config import PlannerConfig


def test_lpt_split_is_a_partition_with_equal_counts():
    w = np.random.default_rng(0).pareto(1.5, 103)
    parts = lpt_split(w, 4)
    assert sorted(np.concatenate(parts).tolist()) == list(range(103))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_balance_covers_every_sample_once_and_never_raises_the_slowest_replica():
    model = load_model_config("7b")
    cost = CostModel(analytical_table(model, load_hardware("a100"), tp=4), StageLayout.even(32, 4))
    planner = PlannerConfig(mode=Mode.BALANCED, max_seq_len=4096, memory_bytes=80 * 2**30).build(model, cost)
    data = make_mix("datamix2", 2000, 0)
    meta = batch_meta(data, BatchStream(num_rows=len(data), gbs=64), 0, tokens_per_image=model.tokens_per_image, max_seq_len=4096)
    even, bal = balance(meta, 4, model, lambda m: planner.plan(m).predicted_s, rounds=4)
    ids = np.concatenate([meta.table.ids[p] for p in bal.replicas])
    assert sorted(ids.tolist()) == sorted(meta.table.ids.tolist())
    assert bal.iter_s.max() <= even.iter_s.max()
