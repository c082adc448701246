"""Activation offload (OptPipe's): the IR's copy pair, the simulator's copy lane and timed memory,
the planner's choice where memory binds."""

from __future__ import annotations

import numpy as np
import pytest

from pipetune.schedule.offload import with_offload
from pipetune.schedule.schedules import list_scheduled, one_f_one_b
from pipetune.schedule.table import Action, Op, ScheduleError, ScheduleTable
from pipetune.simulate.dag import compile_schedule
from pipetune.simulate.simulator import Latencies, _gather, _peak_memory, _peak_memory_timed, _run, simulate
from test_lowering_fifo import check as assert_runs_in_order

O, R = Op.OFFLOAD, Op.RELOAD


def _lat(rng, m: int, S: int, *, copy: float | None = 0.3) -> Latencies:
    return Latencies(rng.uniform(0.8, 1.2, (m, S)), rng.uniform(1.6, 2.4, (m, S)), rng.uniform(0.1, 0.3, m), np.full(m, 0.05),
                     activation_bytes=rng.uniform(0.5, 1.5, (m, S)), bwd_input=rng.uniform(0.6, 1.0, (m, S)),
                     image_feature_bytes=rng.uniform(0, 0.2, m), weight_grad_bytes=rng.uniform(0, 0.5, (m, S)),
                     copy=None if copy is None else np.full((m, S), copy))


def _random_offloaded(rng, P: int, V: int, m: int, split: bool, trained: bool) -> ScheduleTable:
    table = list_scheduled(P, V, rng.permutation(m), split_backward=split, encoder=True, encoder_trained=trained)
    pairs = {(int(c), int(u)): int(rng.integers(0, 4)) for c, u in zip(rng.integers(0, P * V, m), rng.integers(0, m, m))}
    return with_offload(table, pairs).validate()


def test_the_copy_pair_is_one_action_each_with_its_dependencies_and_torch_never_sees_it():
    table = with_offload(one_f_one_b(2, range(4), encoder=True), [(0, 1)], lead=1).validate()
    rank0 = [str(a) for a in table.ranks[0]]
    assert rank0[rank0.index("0F1") + 1] == "0O1" and rank0.index("0R1") < rank0.index("0B1")
    assert Action.parse("0O1") == Action(0, O, 1) and table.offloaded == {(0, 1)}
    assert table.producers(Action(0, Op.BACKWARD, 1))[-1] == Action(0, R, 1)
    assert Action(0, O, 1) in table.consumers(Action(0, Op.FORWARD, 1))
    assert "O" not in table.to_csv() and "R" not in table.to_csv()
    no_reload = tuple(tuple(a for a in acts if a.op is not R) for acts in table.ranks)
    with pytest.raises(ScheduleError, match="0B1.*needs 0R1"):
        ScheduleTable(table.placement, 4, no_reload, table.sub_mb_parent).validate()
    reload_first = list(table.ranks[0])
    reload_first.remove(Action(0, R, 1))
    reload_first.insert(0, Action(0, R, 1))
    with pytest.raises(ScheduleError, match="needs 0O1"):
        ScheduleTable(table.placement, 4, (tuple(reload_first), table.ranks[1]), table.sub_mb_parent).validate()
    with pytest.raises(ScheduleError, match="offloaded already"):
        with_offload(table, [(0, 1)])


def test_offloaded_tables_run_on_an_in_order_transport():
    rng = np.random.default_rng(0)
    for P, V, m, split in [(2, 1, 4, False), (2, 2, 5, True), (3, 2, 7, False), (4, 1, 6, True), (4, 2, 6, True)]:
        assert_runs_in_order(_random_offloaded(rng, P, V, m, split, trained=bool(m % 2)))


def test_memory_counted_by_time_is_the_list_order_count_on_tables_without_copies():
    """The copy-aware memory count (buffers taken when their node starts, given back when it ends)
    against the list-order count the simulator keeps for tables without copies."""
    rng = np.random.default_rng(1)
    for P, V, m, split in [(2, 1, 4, False), (4, 2, 9, True), (3, 2, 5, True), (4, 1, 8, False), (3, 3, 7, False)]:
        for trained in (False, True):
            table = list_scheduled(P, V, rng.permutation(m), split_backward=split, encoder=True, encoder_trained=trained)
            lat = _lat(rng, m, P * V)
            lat = Latencies(lat.fwd, lat.bwd, lat.encoder, lat.p2p, lat.activation_bytes, lat.image_feature_bytes, bwd_input=lat.bwd_input,
                            weight_grad_bytes=lat.weight_grad_bytes, encoder_bwd=rng.uniform(0.2, 0.5, m) if trained else None,
                            encoder_activation_bytes=rng.uniform(0.1, 1.0, m))
            dag = compile_schedule(table)
            g = _gather(dag, lat, np.arange(m)[None])
            slots = dag.float_slot[None]
            np.testing.assert_allclose(_peak_memory(dag, g, slots), _peak_memory_timed(dag, g, slots, *_run(dag, g, slots)))


def test_copies_run_one_at_a_time_after_their_issue_point_and_only_add_time():
    """Every copy starts at or after the end of the compute action before it in its list and of its
    data input, copies of a rank never overlap, each gradient starts after its reload, and a table
    with copies never runs faster than the same table without them."""
    rng = np.random.default_rng(2)
    for P, V, m, split in [(2, 1, 6, False), (4, 1, 8, True), (2, 2, 6, True), (4, 2, 8, False)]:
        table = _random_offloaded(rng, P, V, m, split, trained=False)
        lat = _lat(rng, m, P * V, copy=float(rng.uniform(0.2, 1.5)))
        sim = simulate(table, lat)
        times = {t.action: (t.start, t.end) for t in sim.actions}
        plain = ScheduleTable(table.placement, m, tuple(tuple(a for a in acts if not a.op.is_copy) for acts in table.ranks),
                              table.sub_mb_parent, split_backward=split)
        assert sim.makespan >= simulate(plain, lat).makespan - 1e-9
        for acts in table.ranks:
            copies = [times[a] for a in acts if a.op.is_copy]
            assert all(b[0] >= a[1] - 1e-9 for a, b in zip(copies, copies[1:]))
            before = None
            for a in acts:
                if not a.op.is_copy:
                    before = a if a in times and not (a.is_encoder and a.op is Op.FORWARD) else before
                    continue
                data = Action(a.chunk, Op.FORWARD if a.op is O else O, a.unit)
                assert times[a][0] >= times[data][1] - 1e-9 and (before is None or times[a][0] >= times[before][1] - 1e-9)
                if a.op is R:
                    assert times[Action(a.chunk, table.grad_op(a.module), a.unit)][0] >= times[a][1] - 1e-9


def test_an_offloaded_activation_leaves_memory_from_its_offload_s_end_to_its_reload_s_start():
    """1F1B on 4 ranks, 4 micro-batches, unit times, copies of half a forward: rank 0 holds four
    micro-batches' activations after its warm-up; with chunk 0's first two offloaded and each
    reloaded right before its backward it holds three at most, in the same time, and with no host
    link the plan cannot finish."""
    m, S = 4, 4
    lat = Latencies(np.ones((m, S)), 2 * np.ones((m, S)), activation_bytes=np.ones((m, S)), copy=np.full((m, S), 0.5))
    table = one_f_one_b(S, range(m))
    off = with_offload(table, [(0, 0), (0, 1)], lead=0).validate()
    assert simulate(table, lat).peak_bytes[0] == 4 and simulate(off, lat).peak_bytes[0] == 3
    assert simulate(off, lat).makespan == pytest.approx(simulate(table, lat).makespan)
    assert not np.isfinite(simulate(off, Latencies(lat.fwd, lat.bwd, activation_bytes=lat.activation_bytes)).makespan)


def test_offload_to_fit_brings_every_rank_within_its_room_or_says_it_cannot():
    from pipetune.plan.search.offload_choice import offload_to_fit

    rng = np.random.default_rng(3)
    for P, m in [(4, 8), (8, 16)]:
        table = list_scheduled(P, 1, range(m), encoder=True)
        lat = _lat(rng, m, P, copy=0.3)
        lat = Latencies(lat.fwd, lat.bwd, lat.encoder, lat.p2p, np.ones((m, P)), copy=lat.copy)
        peak = simulate(table, lat).peak_bytes
        room = np.full(P, peak.max() - 1.5)
        moved = offload_to_fit(table, lat, np.arange(m), room)
        sim = simulate(moved.validate(), lat)
        assert (sim.peak_bytes <= room + 1e-9).all() and moved.offloaded
        assert sim.makespan <= simulate(table, lat).makespan * 1.02  # copies hidden in the compute around the peak
        assert offload_to_fit(table, lat, np.arange(m), np.full(P, 1.5)) is None  # one forward's activations plus another's
        no_link = Latencies(lat.fwd, lat.bwd, lat.encoder, lat.p2p, lat.activation_bytes)
        assert offload_to_fit(table, no_link, np.arange(m), room) is None


def test_the_planner_offloads_only_where_memory_binds_and_fits_every_plan():
    """13B, H100 estimate, PP 8, rows of 2,048 tokens: with 14 GiB 1F1B fits one row per
    micro-batch; with offload the plans use more rows, fit memory by an independent simulation,
    carry their copies through serialisation, and (on these batches, not a theorem) run faster. With
    80 GiB, nothing is offloaded."""
    from image_sizing import square_images
    from pipetune.config import load_hardware, load_model_config
    from pipetune.cost import CostModel, StageLayout, analytical_table
    from pipetune.cost.memory import model_state_bytes
    from pipetune.data import batch_meta, make_mix
    from pipetune.plan import IterationPlan
    from pipetune.plan.layout.planner_config import PlannerConfig
    from recorded_stream import RecordedStream

    model, hw = load_model_config("13b"), load_hardware("h100")
    cost = CostModel(analytical_table(model, hw, tp=4), StageLayout.even(40, 8))
    data = make_mix("datamix3", 20_000, 0)
    stream = RecordedStream(len(data), 128)
    metas = [batch_meta(data, stream, s, images=square_images(576), max_seq_len=2048) for s in range(2)]
    planners = {(off, gib): PlannerConfig(max_seq_len=2048, memory_bytes=gib * 2**30, offload=off).build(model, cost)
                for off in (False, True) for gib in (14, 80)}
    for meta in metas:
        plans = {k: p.plan(meta) for k, p in planners.items()}
        tight = plans[True, 14]
        table = tight.table()
        assert table.offloaded and tight.mbs > plans[False, 14].mbs == 1
        assert tight.predicted_s < plans[False, 14].predicted_s
        sim = simulate(table, tight.latencies(cost, meta))
        assert sim.makespan == pytest.approx(tight.predicted_s)
        assert (sim.peak_bytes + model_state_bytes(cost) <= planners[True, 14].budget + 1).all()
        assert IterationPlan.from_json(tight.to_json()).table().offloaded == table.offloaded
        assert not plans[True, 80].table().offloaded and plans[True, 80].predicted_s == pytest.approx(plans[False, 80].predicted_s)


def test_offload_needs_a_host_link_and_a_co_located_layout():
    from pipetune.config import load_hardware, load_model_config
    from pipetune.cost import CostModel, StageLayout, analytical_table
    from pipetune.plan.layout.planner_config import PlannerConfig
    from dataclasses import replace

    model = load_model_config("tiny")
    table = analytical_table(model, load_hardware("a100"), tp=1)
    cost = CostModel(replace(table, host=None), StageLayout.even(model.backbone.n_layers, 2))
    with pytest.raises(ValueError, match="offload needs the latency table's host link"):
        PlannerConfig(max_seq_len=1024, memory_bytes=80e9, offload=True).build(model, cost)
    separated = CostModel(table, StageLayout.even(model.backbone.n_layers, 2).separated(model.encoder.n_layers, 1, 2))
    with pytest.raises(ValueError, match="activation offload"):
        PlannerConfig(max_seq_len=1024, memory_bytes=80e9, offload=True).build(model, separated)


def test_a_latency_table_keeps_its_host_link_and_names_a_bad_one(tmp_path):
    import json

    from pipetune.config import load_hardware, load_model_config
    from pipetune.cost import analytical_table, load_latency_table
    from pipetune.cost.latency_table import LatencyTableError

    table = analytical_table(load_model_config("tiny"), load_hardware("h100"), tp=1)
    assert table.host == {"latency_s": 10e-6, "bytes_per_s": 50e9}
    path = table.save(tmp_path / "t.json")
    assert load_latency_table(path).host == table.host
    raw = json.loads(path.read_text())
    raw["host"]["bytes_per_s"] = 0
    path.write_text(json.dumps(raw))
    with pytest.raises(LatencyTableError, match="host.bytes_per_s must be a finite positive number"):
        load_latency_table(path)
    del raw["host"]
    path.write_text(json.dumps(raw))
    assert load_latency_table(path).host is None


def test_the_trainer_setting_reaches_the_planner_and_keeps_off_the_separated_layout():
    from pipetune.plan import Mode
    from pipetune.plan.layout.planner_config import SplitBackward
    from torchtitan_patches.settings import PipeTuneSettings

    config = PipeTuneSettings.Config(offload=True).planner_config(Mode.PIPETUNE, seq_len=512, seed=0, split_backward=SplitBackward.OFF)
    assert config.offload
    with pytest.raises(ValueError, match="separated does not run activation offload"):
        PipeTuneSettings.Config(layout="separated", offload=True)
