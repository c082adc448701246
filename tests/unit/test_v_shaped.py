"""V-shaped placements (TorchTitan's ``ZBVZeroBubble`` and ``DualPipeV``): torch's orders, the
planner's tables over them, their timing, memory and bounds."""

from __future__ import annotations

import numpy as np
import pytest

from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.cost.memory import model_state_bytes, stage_peak_bytes, worst_case_activation_bytes
from pipetune.config import load_hardware, load_model_config
from pipetune.schedule.schedules import Schedule, activation_caps, dual_pipe_v, list_scheduled, torch_v_tables, zbv_zero_bubble
from pipetune.schedule.table import ChunkStyle, Placement, ScheduleError
from pipetune.schedule.v_shaped import dual_pipe_v_rank_ops, zbv_rank_ops
from pipetune.simulate.dag import compile_schedule
from pipetune.simulate.lower_bound import makespan_lower_bound, placement_lower_bound
from pipetune.simulate.simulator import Latencies, evaluate, simulate, split_times
from test_lowering_fifo import check as assert_runs_in_order
from test_schedule_families import slot_table

V = ChunkStyle.V
CASES = [(P, m, split) for P in (2, 3, 4, 5, 8) for m in range(1, 3 * P + 2) for split in (False, True)]


def _torch_order(schedule_class, P: int, rank: int, m: int) -> list[tuple[int, str, int]]:
    """torch's own ``_calculate_single_rank_operations`` (no stages needed), overlapped and full
    backwards written out as F, I, W (what torch runs without an overlap callback)."""
    from torch.distributed.pipelining.schedules import _ComputationType as T

    s = schedule_class.__new__(schedule_class)
    s.pp_group_size, s.num_stages, s._num_stages, s._n_microbatches = P, 2 * P, 2 * P, m
    out = []
    for a in s._calculate_single_rank_operations(rank):
        for sub in (a.sub_actions if a is not None and a.computation_type == T.OVERLAP_F_B else (a,)):
            if sub is None:
                continue
            if sub.computation_type == T.FULL_BACKWARD:
                out += [(sub.stage_index, "I", sub.microbatch_index), (sub.stage_index, "W", sub.microbatch_index)]
            else:
                out.append((sub.stage_index, {T.FORWARD: "F", T.BACKWARD_INPUT: "I", T.BACKWARD_WEIGHT: "W"}[sub.computation_type],
                            sub.microbatch_index))
    return out


def test_the_v_orders_are_torch_s():
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

    for P in range(1, 6):
        for m in range(1, 4 * P + 2):
            for r in range(P):
                assert [(a.chunk, a.op.value, a.unit) for a in zbv_rank_ops(P, r, m)] == _torch_order(ScheduleZBVZeroBubble, P, r, m)
                if m >= 2 * P:
                    assert [(a.chunk, a.op.value, a.unit) for a in dual_pipe_v_rank_ops(P, r, m)] == \
                        _torch_order(ScheduleDualPipeV, P, r, m)
    with pytest.raises(ScheduleError, match="DualPipeV needs at least as many micro-batches as chunks"):
        dual_pipe_v(4, range(7))


def test_v_placement_and_layout():
    p = Placement.v_shaped(3, encoder=True)
    assert p.backbone == (0, 1, 2, 2, 1, 0) and p.encoder == (0,) and p.style is V and p.chunks_per_rank == 2
    assert Placement.interleaved(3, 2).style is ChunkStyle.LOOP and Placement.v_shaped(1).style is ChunkStyle.LOOP
    assert StageLayout.even(12, 6, chunks_per_rank=2, style=V).placement(encoder=True, encoder_trained=False) == p
    with pytest.raises(ValueError, match="two backbone chunks per rank"):
        StageLayout.even(12, 9, chunks_per_rank=3, style=V)
    assert Schedule.ONE_F_ONE_B.build(6, range(5), chunks_per_rank=2, style=V).placement == Placement.v_shaped(3)


def test_v_tables_run_for_any_micro_batch_count_on_an_in_order_transport_within_zb_v_s_memory():
    """The planner's V tables (``list_scheduled``) and torch's ZB-V table: valid, every rank within
    ``2P`` chunk activations (its ``max_in_flight``, checked by ``validate``; the slot run's peaks
    too; DualPipeV's ``2P + 1``), and all three runnable on a transport that ignores tags."""
    rng = np.random.default_rng(0)
    for P, m, split in CASES:
        trained = bool(rng.random() < 0.5)
        table = list_scheduled(P, 2, rng.permutation(m), split_backward=split, encoder=True, encoder_trained=trained, style=V).validate()
        assert table.placement == Placement.v_shaped(P, encoder=True, encoder_trained=trained)
        assert table.max_in_flight == activation_caps(P, 2, V) == (2 * P,) * P
        assert (slot_table(table)[2] <= 2 * P).all()
        stock = [zbv_zero_bubble(P, rng.permutation(m), encoder=True)] + ([dual_pipe_v(P, range(m))] if m >= 2 * P else [])
        assert (slot_table(stock[0])[2] <= 2 * P).all()
        if len(stock) > 1:
            assert (slot_table(stock[1])[2] == 2 * P + 1).all()  # DualPipeV holds one chunk activation more
        if m <= P + 3 and P <= 4:
            for t in (table, *stock):
                assert_runs_in_order(t)


def test_the_v_run_and_the_simulator_time_a_table_alike_with_no_message_between_the_chunks_of_one_rank():
    """``within`` comes back for the simulated makespan and not below it: the list scheduler's run
    and the simulator agree, so neither charges the hand-over from chunk ``P - 1`` to ``P`` (and
    from the last chunk back to the first rank's) differently from the other."""
    rng = np.random.default_rng(5)
    for P, m in [(2, 3), (2, 6), (4, 5), (4, 9), (8, 12)]:
        for trained in (False, True):
            S = 2 * P
            fwd = rng.uniform(0.2, 2.0, (m, S))
            bwd = fwd * rng.uniform(1.0, 3.0, (m, S))
            lat = Latencies(fwd, bwd, encoder=rng.uniform(0.0, 1.5, m), p2p=rng.uniform(0.1, 0.5, m),
                            bwd_input=bwd * rng.uniform(0.3, 0.7, (m, S)), encoder_bwd=rng.uniform(0.5, 2.0, m) if trained else None)
            order = rng.permutation(m)
            build = lambda within: list_scheduled(P, 2, range(m), split_backward=True, encoder=True, encoder_trained=trained,  # noqa: E731
                                                  times=split_times(lat, order, encoder=True, encoder_trained=trained),
                                                  p2p=lat.p2p[order], within=within, style=V)
            table = build(np.inf)
            span = float(evaluate(compile_schedule(table), lat, order[None]).makespan[0])
            assert build(span * (1 + 1e-9)) == table
            assert build(span * (1 - 1e-9)) is None


def test_slot_times_and_memory_agree_with_the_simulator_and_the_bounds_hold():
    rng = np.random.default_rng(1)
    for P, m, split in CASES[::3]:
        table = list_scheduled(P, 2, rng.permutation(m), split_backward=split, style=V)
        length, bubble, peaks = slot_table(table)
        S = 2 * P
        sim = simulate(table, Latencies(np.ones((m, S)), np.full((m, S), 2.0), activation_bytes=np.ones((m, S)), bwd_input=np.ones((m, S))))
        assert sim.makespan == pytest.approx(length) and sim.bubble_ratio == pytest.approx(bubble)
        np.testing.assert_array_equal(sim.peak_bytes, peaks)
        fwd = rng.uniform(0.2, 2.0, (m, S))
        lat = Latencies(fwd, 2 * fwd, rng.uniform(0, 1, m), rng.uniform(0, 0.05, m), bwd_input=fwd)
        table = list_scheduled(P, 2, rng.permutation(m), split_backward=split, encoder=True, style=V)
        span = simulate(table, lat).makespan
        assert makespan_lower_bound(lat, table.placement, split_backward=True) <= span + 1e-9
        assert placement_lower_bound(list_scheduled(P, 2, range(m), split_backward=True, encoder=True, style=V), lat) <= span + 1e-9


def test_the_memory_model_counts_two_p_chunk_activations_on_every_v_rank():
    model = load_model_config("13b")
    table = analytical_table(model, load_hardware("a100"), tp=4)
    held = {}
    for style in ChunkStyle:
        cost = CostModel(table, StageLayout.even(model.backbone.n_layers, 8, chunks_per_rank=2, style=style))
        worst = np.zeros(4)
        np.maximum.at(worst, np.array(cost.placement().backbone), worst_case_activation_bytes(cost, 4096))
        held[style] = (stage_peak_bytes(cost, 1, 4096) - model_state_bytes(cost)) / worst
    np.testing.assert_allclose(held[V], 8)  # 2P chunks' activations on each rank
    np.testing.assert_allclose(held[ChunkStyle.LOOP], activation_caps(4, 2))  # Megatron's caps fall along the ranks


def test_the_planner_plans_v_shaped_layouts_as_it_simulates_them():
    """Over a V layout the planner's plans (whole or split backwards, per iteration) are V-shaped,
    valid, simulate to their prediction, stay within their lower bound and memory, lower to
    in-order messages, serialise with their placement, and are no slower than torch's ZB-V and
    DualPipeV tables of the same micro-batches in the same order."""
    from image_sizing import square_images
    from pipetune.data import batch_meta, make_mix
    from pipetune.plan import IterationPlan
    from pipetune.plan.layout.planner_config import PlannerConfig
    from recorded_stream import RecordedStream

    model = load_model_config("13b")
    hw = load_hardware("a100")
    cost = CostModel(analytical_table(model, hw, tp=4), StageLayout.even(40, 8, chunks_per_rank=2, style=V))
    planner = PlannerConfig(max_seq_len=8192, memory_bytes=hw.memory_bytes, split_backward="auto").build(model, cost)
    data = make_mix("datamix3", 20_000, 0)
    stream = RecordedStream(len(data), 128)
    for step in range(2):
        meta = batch_meta(data, stream, step, images=square_images(576), max_seq_len=8192)
        plan = planner.plan(meta).validate()
        table = plan.table()
        assert table.placement == Placement.v_shaped(4, encoder=True)
        sim = simulate(table, plan.latencies(cost, meta))
        assert sim.makespan == pytest.approx(plan.predicted_s)
        assert plan.lower_bound_s <= plan.predicted_s + 1e-9 and max(plan.peak_bytes) <= hw.memory_bytes
        assert_runs_in_order(table)
        assert IterationPlan.from_json(plan.to_json()).placement.style is V
        stock = [simulate(t, plan.latencies(cost, meta)).makespan for t in torch_v_tables(4, plan.order, encoder=True)]
        assert plan.predicted_s <= min(stock) + 1e-9  # never slower than torch's own V tables on its packing and order


def test_plan_cli_plans_v_shaped_layouts_and_names_a_bad_chunk_count(capsys):
    import json

    from pipetune.cli.main import main

    args = ["plan", "--model", "13b", "--tp", "4", "--pp", "2", "--hardware", "a100", "--gbs", "16", "--max-seq-len", "4096",
            "--mix", "datamix2", "--samples", "500", "--iters", "1", "--chunk-style", "v", "--split-backward", "on"]
    assert main(args + ["--chunks-per-rank", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["chunk_style"] == "v" and len(out["config"]["layers_per_stage"]) == 4
    assert out["pipetune"]["mean_iter_s"] <= out["best-static"]["mean_iter_s"] + 1e-9
    assert main(args + ["--chunks-per-rank", "3"]) != 0
    assert "--chunk-style v holds two backbone chunks per rank: add --chunks-per-rank 2 (got 3)" in capsys.readouterr().err
