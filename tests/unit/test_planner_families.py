"""The planner over schedule families: zero-bubble twins of 1F1B tables and virtual stages."""

import numpy as np
import pytest

from recorded_stream import RecordedStream
from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.cost.memory import model_state_bytes
from pipetune.data import batch_meta, make_mix
from pipetune.plan import IterationPlan
from pipetune.plan.layout.planner_config import PlannerConfig
from pipetune.plan.layout.compare import compare_modes
from pipetune.schedule.lowering import lower_all
from pipetune.schedule.table import Op, Placement
from pipetune.simulate import simulate
from image_sizing import square_images

A100 = load_hardware("a100")


def costs(V: int = 1, pp: int = 4):
    model = load_model_config("13b")
    layout = StageLayout.even(40, pp * V, chunks_per_rank=V)
    return model, CostModel(analytical_table(model, A100, tp=4), layout)


def metas(n=3, mix="datamix3"):
    table = make_mix(mix, 20_000, 0)
    stream = RecordedStream(len(table), 128)  # the batches these properties were shown on
    return [batch_meta(table, stream, s, images=square_images(576), max_seq_len=8192) for s in range(n)]


@pytest.mark.parametrize("V", [1, 2])
def test_auto_is_never_slower_than_either_family_and_its_plan_is_what_it_simulates_to(V):
    model, cost = costs(V)
    make = lambda split: PlannerConfig(max_seq_len=8192, memory_bytes=A100.memory_bytes, split_backward=split).build(model, cost)  # noqa: E731
    planners = {s: make(s) for s in ("off", "on", "auto")}
    for meta in metas():
        plans = {s: p.plan(meta) for s, p in planners.items()}
        assert plans["auto"].predicted_s <= min(plans["off"].predicted_s, plans["on"].predicted_s) + 1e-9
        for s, plan in plans.items():
            table = plan.table()
            assert table.placement == (Placement.interleaved(4, V, encoder=True) if V > 1 else Placement.colocated(4, encoder=True))
            assert table.split_backward == (s == "on" or (s == "auto" and table.split_backward))
            assert (s != "off") or not any(a.op is Op.BACKWARD_INPUT for r in table.ranks for a in r)
            sim = simulate(table, plan.latencies(cost, meta))
            assert sim.makespan == pytest.approx(plan.predicted_s)
            assert plan.lower_bound_s <= plan.predicted_s + 1e-9
            np.testing.assert_allclose(np.array(plan.peak_bytes), sim.peak_bytes + model_state_bytes(cost))
            lower_all(table)
            assert IterationPlan.from_json(plan.to_json()).table().split_backward == table.split_backward


def test_a_split_family_that_does_not_fit_memory_is_not_chosen():
    """Zero-bubble tables hold the first rank's 1F1B activations on every rank: with memory between
    1F1B's peak and the zero-bubble table's, auto's plan (whole backwards, or a split table whose
    ``W`` the batch's own latencies placed earlier) still fits, by an independent simulation."""
    model, cost = costs()
    meta = metas(1)[0]
    whole = PlannerConfig(max_seq_len=8192, memory_bytes=A100.memory_bytes, split_backward="off").build(model, cost)
    split = PlannerConfig(max_seq_len=8192, memory_bytes=A100.memory_bytes, split_backward="on", mbs=whole.plan(meta).mbs,
                          mode="balanced").build(model, cost)
    peak_whole, peak_split = max(whole.plan(meta).peak_bytes), max(split.plan(meta).peak_bytes)
    assert peak_split > peak_whole
    memory = (peak_whole + peak_split) / 2 / (1 - 0.1)
    auto = PlannerConfig(max_seq_len=8192, memory_bytes=memory, split_backward="auto").build(model, cost)
    assert peak_split > auto.budget
    plan = auto.plan(meta)
    sim = simulate(plan.table(), plan.latencies(cost, meta))
    assert max(sim.peak_bytes + model_state_bytes(cost)) <= auto.budget


def test_the_best_fixed_configuration_may_split_too():
    model, cost = costs(pp=4)
    table = make_mix("datamix3", 4_000, 0)
    out = compare_modes(model, cost, table, gbs=64, max_seq_len=8192, memory_bytes=A100.memory_bytes, iters=2, split_backward="auto")
    assert "split backward on" in out["best-static"].choice
    assert out["pipetune"].iter_s.mean() <= out["best-static"].iter_s.mean() + 1e-9


def test_the_input_gradient_share_grows_with_attention_and_stays_within_the_backward():
    """A split backward's I takes attention's whole backward and half of each matmul's, so a stage
    of long documents (attention-heavy) gives I a larger share than one of short documents."""
    from pipetune.cost import MicroBatchShapes

    _, cost = costs()
    share = []
    for doc in (256, 8192):
        n = 8192 // doc
        shapes = MicroBatchShapes(np.full(n, doc), np.zeros(n, np.int64), np.array([8192]), np.array([0]))
        c = cost.stage_costs(shapes)
        assert ((0 <= c.bwd_input) & (c.bwd_input <= c.bwd)).all()
        share.append(c.bwd_input[0, 1] / c.bwd[0, 1])
    assert 0.5 < share[0] < share[1] < 1.0


def test_a_runner_up_packing_wins_once_its_weight_gradients_fill_its_own_bubbles():
    """DataMix1 at PP 8, V = 2 (batch 7: its samples fill 6 rows, fewer than the ranks): on
    unit-time zero-bubble tables 6 micro-batches look best, but placed by the batch's own latencies
    the 8-micro-batch packing is faster, so the planner time-weights the two best packings, not
    only the first; the plan it returns is the table it simulated."""
    model, cost = costs(V=2, pp=8)
    meta = metas(8, mix="datamix1")[7]
    config = dict(max_seq_len=8192, memory_bytes=A100.memory_bytes, split_backward="auto")
    unit_time = {count: PlannerConfig(mode="balanced", mbs=1, min_micro_batches=count, **config).build(model, cost).plan(meta)
                 for count in (1, 8)}
    assert len(unit_time[1].order) == 6 and unit_time[1].predicted_s < unit_time[8].predicted_s
    plan = PlannerConfig(**config).build(model, cost).plan(meta)
    assert len(plan.order) == 8 and plan.table().split_backward
    assert simulate(plan.table(), plan.latencies(cost, meta)).makespan == pytest.approx(plan.predicted_s)
    assert plan.predicted_s <= PlannerConfig(min_micro_batches=8, **config).build(model, cost).plan(meta).predicted_s + 1e-9


def test_leaving_the_last_ranks_weight_gradients_to_their_end_speeds_up_batches_of_few_micro_batches(monkeypatch):
    """DataMix1 at PP 8, V = 2 (no more micro-batches than ranks): the variants whose last ranks run
    their ``W`` after their input gradients make some plans faster and none slower, and each plan
    is the table it simulated (memory included)."""
    from pipetune.plan.search import planner as planner_module

    model, cost = costs(V=2, pp=8)
    config = PlannerConfig(max_seq_len=8192, memory_bytes=A100.memory_bytes, split_backward="auto")
    batches = metas(6, mix="datamix1")
    with_lazy = [config.build(model, cost).plan(meta) for meta in batches]
    monkeypatch.setattr(planner_module, "LAZY_WEIGHTS_FROM", ())
    without = [config.build(model, cost).plan(meta) for meta in batches]
    faster = [b.predicted_s < a.predicted_s - 1e-9 for a, b in zip(without, with_lazy)]
    assert all(b.predicted_s <= a.predicted_s + 1e-9 for a, b in zip(without, with_lazy)) and any(faster)
    for meta, plan in zip(batches, with_lazy):
        sim = simulate(plan.table(), plan.latencies(cost, meta))
        assert sim.makespan == pytest.approx(plan.predicted_s)
        assert max(sim.peak_bytes + model_state_bytes(cost)) <= config.memory_bytes * (1 - config.reserve)


def test_interleaved_plans_also_pack_into_whole_rounds_of_the_ranks(monkeypatch):
    """DataMix3 at PP 8, V = 2: size 2 packs batch 0 into fewer micro-batches than two rounds of the
    ranks and size 1 into more; the 16-micro-batch packing between them (two whole rounds) is
    faster than either, so the planner tries it. The plan without that step is never faster, each
    plan is the table it simulated (memory included), and the bound still lies below the plan
    (the counts between sizes 2 and 1 that are not whole rounds left out: the next test)."""
    from pipetune.plan.search.planner import Planner

    model, cost = costs(V=2, pp=8)
    config = PlannerConfig(max_seq_len=8192, memory_bytes=A100.memory_bytes, split_backward="auto")
    batches = metas(4)
    monkeypatch.setattr(Planner, "_between_counts", lambda self, meta, cands: None)
    plans = [config.build(model, cost).plan(meta) for meta in batches]
    monkeypatch.setattr(Planner, "_whole_rounds", lambda self, meta, cands: [])
    without = [config.build(model, cost).plan(meta) for meta in batches]
    sizes = {mbs: PlannerConfig(mode="balanced", mbs=mbs, max_seq_len=8192, memory_bytes=A100.memory_bytes).build(model, cost).plan(batches[0])
             for mbs in (1, 2)}
    assert len(sizes[2].order) < 16 < len(sizes[1].order)
    assert len(plans[0].order) == 16 and plans[0].predicted_s < without[0].predicted_s - 1e-9
    for meta, plan, plain in zip(batches, plans, without):
        assert plan.predicted_s <= plain.predicted_s + 1e-9 and plan.lower_bound_s <= plan.predicted_s
        assert sorted(i for mb in plan.micro_batches for i in mb) == sorted(meta.table.ids.tolist())
        sim = simulate(plan.table(), plan.latencies(cost, meta))
        assert sim.makespan == pytest.approx(plan.predicted_s)
        assert max(sim.peak_bytes + model_state_bytes(cost)) <= config.memory_bytes * (1 - config.reserve)


def test_interleaved_plans_also_spread_size_2_over_the_counts_below_size_1s(monkeypatch):
    """DataMix3 at PP 8, V = 2: size 2 packs each batch into 12-13 micro-batches, size 1 into 24-25,
    whole rounds into 16; 20-21 micro-batches of size 2, screened on unit times, are faster than all
    of them on every batch. The plans without that step are slower; every plan simulates to its
    prediction within memory, holds every sample once, and its bound counts the screened packings'."""
    from pipetune.plan.search.planner import Planner

    model, cost = costs(V=2, pp=8)
    config = PlannerConfig(max_seq_len=8192, memory_bytes=A100.memory_bytes, split_backward="auto")
    batches = metas(3)
    plans = [config.build(model, cost).plan(meta) for meta in batches]
    monkeypatch.setattr(Planner, "_between_counts", lambda self, meta, cands: None)
    without = [config.build(model, cost).plan(meta) for meta in batches]
    for meta, plan, plain in zip(batches, plans, without):
        counts = {mbs: len(PlannerConfig(mode="balanced", mbs=mbs, max_seq_len=8192, memory_bytes=A100.memory_bytes)
                           .build(model, cost).plan(meta).order) for mbs in (1, 2)}
        assert plan.mbs == 2 and counts[2] + 1 < len(plan.order) < counts[1] and len(plan.order) % 8
        assert plan.predicted_s < plain.predicted_s - 1e-9 and plan.lower_bound_s <= plain.lower_bound_s + 1e-12
        assert sorted(i for mb in plan.micro_batches for i in mb) == sorted(meta.table.ids.tolist())
        sim = simulate(plan.table(), plan.latencies(cost, meta))
        assert sim.makespan == pytest.approx(plan.predicted_s)
        assert max(sim.peak_bytes + model_state_bytes(cost)) <= config.memory_bytes * (1 - config.reserve)


def test_skipping_time_weighted_tables_that_cannot_beat_the_plan_so_far_changes_no_plan(monkeypatch):
    """The planner passes ``within`` (its best plan so far) to ``list_scheduled``: on DataMix1 at
    PP 8, V = 2 it skips some time-weighted tables, and the plans are the same as when every table
    is built and simulated."""
    from pipetune.plan.search import planner as planner_module
    from pipetune.schedule.schedules import list_scheduled

    model, cost = costs(V=2, pp=8)
    config = PlannerConfig(max_seq_len=8192, memory_bytes=A100.memory_bytes, split_backward="auto")
    batches = metas(4, mix="datamix1")
    skipped = []

    def counting(*args, **kwargs):
        table = list_scheduled(*args, **kwargs)
        skipped.append(table is None)
        return table

    monkeypatch.setattr(planner_module, "list_scheduled", counting)
    plans = [config.build(model, cost).plan(meta) for meta in batches]
    monkeypatch.setattr(planner_module, "list_scheduled", lambda *args, within=None, **kwargs: list_scheduled(*args, **kwargs))
    every = [config.build(model, cost).plan(meta) for meta in batches]
    assert any(skipped)
    for plan, full in zip(plans, every):
        assert (plan.mbs, plan.order, plan.predicted_s, plan.lower_bound_s) == (full.mbs, full.order, full.predicted_s, full.lower_bound_s)
        assert plan.table() == full.table()
