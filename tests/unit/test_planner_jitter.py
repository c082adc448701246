"""The planner scoring candidates by expected time under per-action jitter (issue 14)."""

import json
from dataclasses import replace

import numpy as np
import pytest

from pipetune.config import load_hardware, load_model_config
from pipetune.config.model import BackboneConfig, ModelConfig
from pipetune.cost import CostModel, LatencyTable, StageLayout, analytical_table
from pipetune.cost.latency_table import Curve
from pipetune.cost.variability import Spread, Variability
from pipetune.data import BatchStream, batch_meta, make_mix
from pipetune.data.batch import BatchMeta
from pipetune.data.samples import OverlongReport, SampleTable
from pipetune.plan.layout.planner_config import PlannerConfig
from pipetune.simulate import Latencies, simulate
from pipetune.simulate.jitter import expected_time
from image_sizing import square_images

A100 = load_hardware("a100")


def test_jitter_draws_must_be_zero_or_at_least_two():
    with pytest.raises(ValueError, match="jitter_draws must be 0"):
        PlannerConfig(max_seq_len=512, memory_bytes=1e9, jitter_draws=1)


@pytest.fixture(scope="module")
def setup13b():
    model = load_model_config("13b")
    table = analytical_table(model, A100, tp=4)
    data = make_mix("datamix3", 20_000, 0)
    stream = BatchStream(num_rows=len(data), gbs=64, seed=0)
    metas = [batch_meta(data, stream, s, images=square_images(576), max_seq_len=8192) for s in range(3)]
    return model, table, metas


def plans(setup, variability, draws, **kw):
    model, table, metas = setup
    cost = CostModel(replace(table, variability=variability), StageLayout.even(40, 4))
    p = PlannerConfig(max_seq_len=8192, memory_bytes=A100.memory_bytes, jitter_draws=draws, **kw).build(model, cost)
    return [json.loads(p.plan(m).to_json()) | {"search_s": 0} for m in metas]


def test_without_spread_the_jitter_search_makes_the_deterministic_plans(setup13b):
    deterministic = plans(setup13b, None, 0)
    assert plans(setup13b, None, 8) == deterministic  # no variability model: no jitter
    assert plans(setup13b, Variability(), 8) == deterministic  # a model without spread: the same numbers


def test_jittered_plans_predict_their_expected_time_and_fit_in_memory(setup13b):
    model, table, metas = setup13b
    var = Variability(stage=Spread(log_var=0.01, log_var_s=1e-3, min_s=1e-2), encoder=Spread(log_var=0.02))
    cost = CostModel(replace(table, variability=var), StageLayout.even(40, 4))
    p = PlannerConfig(max_seq_len=8192, memory_bytes=A100.memory_bytes, jitter_draws=8, seed=2).build(model, cost)
    for meta in metas:
        plan = p.plan(meta)
        lat = Latencies.from_costs(cost.stage_costs(plan.shapes(meta)))
        assert plan.predicted_s == pytest.approx(expected_time(plan.table(), lat, var, 8, (2, meta.step)), rel=1e-12)
        assert plan.predicted_s > simulate(plan.table(), lat).makespan >= plan.lower_bound_s
        assert max(plan.peak_bytes) <= A100.memory_bytes * 0.9
    assert plans(setup13b, var, 8, seed=2) == plans(setup13b, var, 8, seed=2)  # deterministic


FLAT = ModelConfig(name="flat", backbone=BackboneConfig(n_layers=2, dim=64, ffn_dim=128, n_heads=2, n_kv_heads=2, vocab_size=100))


def flat_cost(variability):
    """Text-only, one layer per stage, time linear in tokens (1 s fwd + 2 s bwd per 1,024 tokens)
    plus 0.25 s / 0.5 s per forward / backward call, free messages, exact binary fractions."""
    def curve(x, fwd, bwd):
        return Curve(x, np.array([1024.0, 2048.0]), np.array(fwd, float), np.array(bwd, float))

    zero = ([0, 0], [0, 0])
    table = LatencyTable(
        model=FLAT, curves={"attention": curve("seq_len", *zero), "rest": curve("packed_len", [1, 2], [2, 4]),
                            "embedding": curve("packed_len", *zero), "head": curve("packed_len", *zero)},
        memory=dict.fromkeys(("layer_bytes_per_token", "embedding_bytes_per_token", "head_bytes_per_token",
                              "image_feature_bytes", "projector_bytes_per_image"), 0.0),
        p2p={"latency_s": 0.0, "bytes_per_s": float("inf")}, device="test", dtype="float32",
        overhead={"fwd_s": 0.25, "bwd_s": 0.5}, variability=variability)
    return CostModel(table, StageLayout.even(2, 2))


def test_jitter_breaks_a_tie_towards_fewer_synchronisation_points():
    """Eight samples of 1,024 tokens on 2 stages: 8 micro-batches of 3.75 s per stage or 4 of
    6.75 s both take (m + 1) x t = 33.75 s in 1F1B. Deterministically the tie keeps the first size
    searched (mbs 1, 8 micro-batches); with jitter whose relative spread grows for short actions,
    the 4-micro-batch plan has fewer near-critical paths and is expected to be faster."""
    n = 8
    samples = SampleTable.build(ids=np.arange(n), source=np.zeros(n, int), source_names=("text",),
                                text_tokens=np.full(n, 1024), num_images=np.zeros(n, int))
    meta = BatchMeta(step=0, rows=np.arange(n), table=samples, overlong=OverlongReport(policy="truncate"))
    spread = Variability(stage=Spread(log_var_s=0.05, min_s=1.0))

    def plan(variability, draws, seed=0):
        cfg = PlannerConfig(max_seq_len=1024, memory_bytes=1e12, max_mbs=2, jitter_draws=draws, seed=seed)
        return cfg.build(FLAT, flat_cost(variability)).plan(meta)

    for p in (plan(None, 0), plan(spread, 0), plan(None, 16)):
        assert (p.mbs, p.num_micro_batches, p.predicted_s) == (1, 8, 33.75)
    for seed in range(5):
        p = plan(spread, 16, seed)
        assert (p.mbs, p.num_micro_batches) == (2, 4) and p.predicted_s > 33.75
