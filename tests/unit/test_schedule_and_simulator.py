import json
from types import SimpleNamespace

import numpy as np
import pytest
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, _PipelineScheduleRuntime

from pipetune.schedule import Action, Op, Placement, ScheduleError, ScheduleTable, gpipe, one_f_one_b, place_encoders, serial
from pipetune.simulate import Latencies, compile_schedule, evaluate, simulate
from pipetune.simulate.lower_bound import makespan_lower_bound
from pipetune.simulate.trace import chrome_trace, write_trace


class RecordingStage:
    """Stands in for a PipelineStage: records compute calls, communicates nothing."""

    def __init__(self, stage_index, num_stages):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.has_backward = True
        self.log = []

    def get_fwd_recv_ops(self, i):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, i, *args, **kwargs):
        self.log.append(f"{self.stage_index}F{i}")

    def backward_one_chunk(self, i, **kwargs):
        self.log.append(f"{self.stage_index}B{i}")

    def clear_runtime_states(self):
        pass

    def perform_reduce_grad(self, *args):
        pass


def torch_runtime_order(cls, S, m):
    """The compute order torch's own schedule class executes on every rank."""
    out = []
    for s in range(S):
        stage = RecordingStage(s, S)
        sched = cls(stage, n_microbatches=m)
        sched._initialize_stage = lambda *a, **k: None
        sched._step_microbatches()
        out.append(stage.log)
    return out


@pytest.mark.parametrize("ours,theirs", [(one_f_one_b, Schedule1F1B), (gpipe, ScheduleGPipe)])
@pytest.mark.parametrize("S,m", [(2, 2), (2, 7), (4, 4), (4, 9), (3, 16)])
def test_action_order_matches_torch(ours, theirs, S, m):
    table = ours(S, range(m))
    assert [[str(a) for a in r] for r in table.ranks] == torch_runtime_order(theirs, S, m)


@pytest.mark.parametrize("gen", [one_f_one_b, gpipe])
@pytest.mark.parametrize("S,m", [(1, 5), (2, 1), (3, 2), (4, 4), (4, 13), (8, 32)])
def test_uniform_latencies_give_the_closed_form(gen, S, m):
    t_f, t_b = 1.5, 2.25
    res = simulate(gen(S, range(m)), Latencies.uniform(m, S, t_f, t_b))
    assert res.makespan == pytest.approx((m + S - 1) * (t_f + t_b))
    assert makespan_lower_bound(Latencies.uniform(m, S, t_f, t_b)) == pytest.approx(res.makespan)
    assert res.busy == pytest.approx(np.full(S, m * (t_f + t_b)))
    assert res.bubble_ratio == pytest.approx((S - 1) / (m + S - 1))


def test_message_latency_by_hand():
    """2 stages, 2 micro-batches, t_f = 1, t_b = 2, 0.5 per message:
    rank 0: F0 [0,1] F1 [1,2]            B0 [5,7]      B1 [8,10]
    rank 1:   F0 [1.5,2.5] B0 [2.5,4.5] F1 [4.5,5.5] B1 [5.5,7.5]"""
    res = simulate(one_f_one_b(2, range(2)), Latencies.uniform(2, 2, 1.0, 2.0, p2p=0.5))
    for k, v in {"1F0": (1.5, 2.5), "1F1": (4.5, 5.5), "0B0": (5, 7), "1B1": (5.5, 7.5), "0B1": (8, 10)}.items():
        assert res.time_of(k) == pytest.approx(v)
    assert res.makespan == pytest.approx(10.0)


def test_a_straggler_delays_exactly_what_depends_on_it():
    """2 stages, 3 micro-batches, t_f = 1, t_b = 2; 0F1 takes 3 instead of 1.

    Baseline timeline (1F1B): rank 0: F0 [0,1] F1 [1,2] B0 [4,6] F2 [6,7] B1 [7,9] B2 [10,12]
                              rank 1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7] F2 [7,8] B2 [8,10]
    With the straggler rank 0 runs F1 on [1,4]; 1F1 starts at 4 as before (rank 1 is busy with
    B0 until 4) and 0B0 waits for 1B0 until 4 anyway: only 0F1 itself moves.
    """
    base = Latencies.uniform(3, 2, 1.0, 2.0)
    slow = Latencies(base.fwd.copy(), base.bwd, base.encoder, base.p2p, base.activation_bytes, base.image_feature_bytes)
    slow.fwd[1, 0] = 3.0
    table = one_f_one_b(2, range(3))
    a, b = simulate(table, base), simulate(table, slow)
    expect = {"0F0": (0, 1), "0F1": (1, 2), "0B0": (4, 6), "0F2": (6, 7), "0B1": (7, 9), "0B2": (10, 12),
              "1F0": (1, 2), "1B0": (2, 4), "1F1": (4, 5), "1B1": (5, 7), "1F2": (7, 8), "1B2": (8, 10)}
    for k, v in expect.items():
        assert a.time_of(k) == pytest.approx(v)
        assert b.time_of(k) == pytest.approx((1, 4) if k == "0F1" else v)
    slow.fwd[1, 0] = 5.0  # now 1F1 (and what follows on rank 1) must wait for it
    c = simulate(table, slow)
    assert c.time_of("1F1") == pytest.approx((6, 7)) and c.time_of("1B1") == pytest.approx((7, 9))
    assert c.time_of("1B0") == pytest.approx((2, 4)) and c.time_of("0F0") == pytest.approx((0, 1))
    assert c.time_of("0B0") == pytest.approx((6, 8))  # rank 0 was busy with 0F1 until 6


def test_precomputed_encoders_move_into_gaps_without_overlap_and_after_their_data():
    S, m = 3, 6
    rng = np.random.default_rng(0)
    lat = Latencies(rng.random((m, S)) + 0.5, rng.random((m, S)) + 1.0, rng.random(m) * 0.8, np.full(m, 0.05),
                    np.ones((m, S)), np.full(m, 10.0))
    plain = one_f_one_b(S, range(m), encoder=True)
    moved = place_encoders(plain, {4: 3, 5: 3, 3: 1})
    for table in (plain, moved):
        res = simulate(table, lat)
        rank0 = sorted((t for t in res.actions if t.rank == 0), key=lambda t: t.start)
        for x, y in zip(rank0, rank0[1:]):
            assert x.end <= y.start + 1e-12  # one action at a time on rank 0
        enc = {t.action.unit: t for t in res.actions if t.action.is_encoder}
        fwd0 = {t.action.unit: t for t in res.actions if t.action.op is Op.FORWARD and t.action.chunk == 0 and not t.action.is_encoder}
        assert set(enc) == set(range(m))
        for mb, e in enc.items():
            assert e.start >= 0 and e.end <= fwd0[mb].start + 1e-12
            assert e.end - e.start == pytest.approx(lat.encoder[mb, 0])
    res = simulate(moved, lat)
    assert {t.action.unit for t in res.actions if t.precomputed} == {3, 4, 5}
    # held image features raise rank 0's peak; other ranks are unaffected
    assert res.peak_bytes[0] > simulate(plain, lat).peak_bytes[0]
    assert res.peak_bytes[1:] == pytest.approx(simulate(plain, lat).peak_bytes[1:])


@pytest.mark.parametrize("encoder", [False, True])
def test_a_serial_table_runs_the_pipelined_actions_one_rank_at_a_time(encoder):
    """The serial schedule: the actions of 1F1B on the same order, and under any latencies no two
    ranks busy at once, so its makespan is the sum of every action and message."""
    S, m = 3, 5
    rng = np.random.default_rng(1)
    order = rng.permutation(m)
    lat = Latencies(rng.random((m, S)) + 0.5, rng.random((m, S)) + 1.0, rng.random(m) * 0.8, np.full(m, 0.05),
                    np.ones((m, S)), np.full(m, 10.0), encoder_bwd=rng.random(m) * 1.5 if encoder else None)
    table = serial(S, order, encoder=encoder, encoder_trained=encoder)
    table.validate()
    assert sorted(map(str, (a for r in table.ranks for a in r))) == sorted(
        map(str, (a for r in one_f_one_b(S, order, encoder=encoder, encoder_trained=encoder).ranks for a in r)))
    res = simulate(table, lat)
    spans = sorted((t.start, t.end) for t in res.actions)
    assert all(x[1] <= y[0] + 1e-12 for x, y in zip(spans, spans[1:]))
    messages = m * 2 * (S - 1) * 0.05
    work = lat.fwd.sum() + lat.bwd.sum() + (lat.encoder.sum() + lat.encoder_bwd.sum() if encoder else 0.0)
    assert res.makespan == pytest.approx(work + messages)
    assert simulate(one_f_one_b(S, order, encoder=encoder, encoder_trained=encoder), lat).makespan < res.makespan


def test_peak_memory_follows_in_flight_counts():
    S, m = 4, 8
    lat = Latencies.uniform(m, S, 1.0, 2.0)
    lat = Latencies(lat.fwd, lat.bwd, lat.encoder, lat.p2p, np.full((m, S), 3.0), lat.image_feature_bytes)
    assert simulate(one_f_one_b(S, range(m)), lat).peak_bytes.tolist() == [3.0 * (S - s) for s in range(S)]
    assert simulate(gpipe(S, range(m)), lat).peak_bytes.tolist() == [3.0 * m] * S


def test_batch_evaluation_agrees_with_the_detailed_simulator():
    S, m = 4, 7
    rng = np.random.default_rng(3)
    lat = Latencies(rng.random((m, S)), rng.random((m, S)) * 2, rng.random(m), rng.random(m) * 0.1,
                    rng.random((m, S)), rng.random(m))
    slot_table = one_f_one_b(S, range(m), encoder=True)
    dag = compile_schedule(slot_table)
    pos = dag.rank_position()
    orders, slots, expected, peaks = [], [], [], []
    for _ in range(25):
        order = rng.permutation(m)
        slot = dag.float_slot.copy()
        before = {}
        for k in range(m):
            if rng.random() < 0.5:  # move slot k's encoder to a random earlier rank-0 node
                fwd_pos = pos[dag.float_slot[k]]
                target = int(rng.integers(0, fwd_pos + 1))
                slot[k] = dag.rank_nodes[0][target]
                before[int(order[k])] = target
        res = simulate(place_encoders(one_f_one_b(S, order, encoder=True), before), lat)
        orders.append(order)
        slots.append(slot)
        expected.append(res.makespan)
        peaks.append(res.peak_bytes)
    batch = evaluate(dag, lat, np.array(orders), np.array(slots), memory=True)
    assert batch.makespan == pytest.approx(np.array(expected))
    assert batch.peak_bytes == pytest.approx(np.array(peaks))


def test_lower_bound_holds_for_random_cases():
    rng = np.random.default_rng(4)
    for _ in range(100):
        m, S = int(rng.integers(1, 10)), int(rng.integers(1, 5))
        lat = Latencies(rng.random((m, S)), rng.random((m, S)), rng.random(m), rng.random(m) * 0.2, np.zeros((m, S)), np.zeros(m))
        lb = makespan_lower_bound(lat)
        for order in (rng.permutation(m) for _ in range(3)):
            assert simulate(one_f_one_b(S, order, encoder=True), lat).makespan >= lb - 1e-12
            assert simulate(gpipe(S, order, encoder=True), lat).makespan >= lb - 1e-12


def test_csv_round_trips_and_loads_in_torch(tmp_path):
    table = one_f_one_b(4, [2, 0, 3, 1, 4], encoder=True)
    text = table.to_csv()
    back = ScheduleTable.from_csv(text, num_stages=4, num_micro_batches=5)
    assert back.ranks == tuple(tuple(a for a in r if not a.is_encoder) for r in table.ranks)
    assert back.to_csv() == text
    path = tmp_path / "schedule.csv"
    path.write_text(text)
    stage = SimpleNamespace(num_stages=4, group_size=4, group_rank=0, stage_index=0, is_first=True, is_last=False)
    runtime = _PipelineScheduleRuntime([stage], n_microbatches=5)
    runtime._load_csv(str(path), format="compute_only")  # parses, validates and lowers to comms
    assert {r: [str(a) for a in acts] for r, acts in runtime.pipeline_order.items()} == {
        r: [str(a) for a in acts] for r, acts in enumerate(back.ranks)
    }
    assert "1RECV_F2" in [str(a) for a in runtime.pipeline_order_with_comms[1]]


def table_of(rows, S=2, m=2, encoder=False, trained=False, **kw):
    return ScheduleTable(placement=Placement.colocated(S, encoder=encoder, encoder_trained=trained), num_micro_batches=m,
                         ranks=tuple(tuple(Action.parse(a) for a in r) for r in rows), sub_mb_parent=tuple(range(m)) if encoder else (), **kw)


@pytest.mark.parametrize(
    "rows,kw,message",
    [
        ([["0F0", "0F0", "0B0"], ["1F0", "1B0"]], {"m": 1}, "0F0 appears twice"),
        ([["0F0", "0B0"], ["1F0"]], {"m": 1}, "action 1B0 is missing"),
        ([["0B0", "0F0"], ["1F0", "1B0"]], {"m": 1}, "needs 0F0, which this rank has not run before it"),
        ([["1F0", "0B0"], ["0F0", "1B0"]], {"m": 1}, "chunk 1 is placed on rank 1"),
        ([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1F1", "1B0", "1B1"]], {"max_in_flight": (2, 1)}, "rank 1 holds 2 micro-batches. activations"),
        ([["0F0", "E0F0", "0B0"], ["1F0", "1B0"]], {"m": 1, "encoder": True}, "0F0.*needs E0F0, which this rank has not run"),
        ([["E0F0", "0F0", "0B0", "E0B0"], ["1F0", "1B0"]], {"m": 1, "encoder": True}, "a frozen encoder has no backward actions"),
        ([["E0F0", "0F0", "E0B0", "0B0"], ["1F0", "1B0"]], {"m": 1, "encoder": True, "trained": True}, "E0B0.*needs 0B0"),
        ([["E0F0", "0F0", "0B0"], ["1F0", "1B0"]], {"m": 1, "encoder": True, "trained": True}, "action E0B0 is missing"),
        ([["0F5", "0B5"], ["1F5", "1B5"]], {"m": 1}, "out of range"),
        ([["E1F0", "0F0", "0B0"], ["1F0", "1B0"]], {"m": 1, "encoder": True}, "out of range"),
    ],
)
def test_invalid_tables_are_named(rows, kw, message):
    m = kw.pop("m", 2)
    with pytest.raises(ScheduleError, match=message):
        table_of(rows, m=m, **kw).validate()


@pytest.mark.parametrize("text", ["0E3", "E0X1", "F0", "e0F1", "1F", ""])
def test_action_text_is_parsed_by_one_grammar(text):
    with pytest.raises(ValueError, match="not an action"):
        Action.parse(text)
    assert str(Action.parse("E12B7")) == "E12B7" and Action.parse("E12B7").is_encoder and not Action.parse("12B7").is_encoder


def test_deadlock_is_detected():
    table = table_of([["0F0", "0F1", "0B1", "0B0"], ["1F0", "1B0", "1F1", "1B1"]]).validate()
    assert compile_schedule(table).num_nodes == 8
    bad = table_of([["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]]).validate()
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 at 0B0, rank 1 at 1F1"):
        compile_schedule(bad)


def test_bad_orders_and_encoder_placements():
    with pytest.raises(ScheduleError, match="not a permutation"):
        one_f_one_b(2, [0, 0, 1])
    with pytest.raises(ScheduleError, match="must run before its forward"):
        place_encoders(one_f_one_b(2, range(3), encoder=True), {0: 2})
    with pytest.raises(ScheduleError, match="no encoder actions"):
        place_encoders(one_f_one_b(2, range(3)), {})


def test_pictures(tmp_path):
    res = simulate(place_encoders(one_f_one_b(3, range(5), encoder=True), {4: 1}),
                   Latencies.uniform(5, 3, 1.0, 2.0, t_e=0.3))
    trace = chrome_trace(list(res.actions))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 5 * 3 * 2 + 5
    assert {e["cat"] for e in events} == {"forward", "backward", "encoder", "precomputed encoder"}
    write_trace(list(res.actions), tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    write_trace(list(res.actions), tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="must end in .json"):
        write_trace(list(res.actions), tmp_path / "t.txt")


def test_trace_cli(tmp_path):
    from pipetune.cli.main import main

    out = tmp_path / "g.png"
    assert main(["trace", "--mix", "datamix2", "--samples", "3000", "--model", "13b", "--tp", "4", "--pp", "4",
                 "--out", str(out), "--out", str(tmp_path / "g.json"), "--csv", str(tmp_path / "g.csv")]) == 0
    assert out.stat().st_size > 10_000 and (tmp_path / "g.csv").read_text().startswith("0F0,")


def separated_by_hand(trained: bool) -> tuple[ScheduleTable, Latencies]:
    """Two ranks, encoder chunks E0 (rank 0) and E1 (rank 1), one micro-batch whose images form
    two sub-microbatches; encoder chunk forward 1 s (backward 1.5 s), backbone stage forward 2 s,
    backward 3 s; messages: encoder 0.5 s, features 0.25 s, backbone 0.1 s."""
    enc_b = ["E0B0", "E0B1"] if trained else []
    rows = [["E0F0", "E0F1", "0F0", "0B0", *enc_b], ["E1F0", "E1F1", "1F0", "1B0", *[a.replace("E0", "E1") for a in enc_b]]]
    table = ScheduleTable(placement=Placement.separated(2, 2, encoder_trained=trained), num_micro_batches=1,
                          ranks=tuple(tuple(Action.parse(a) for a in r) for r in rows), sub_mb_parent=(0, 0)).validate()
    lat = Latencies(np.full((1, 2), 2.0), np.full((1, 2), 3.0), np.full((2, 2), 1.0), np.full(1, 0.1), np.array([[10.0, 20.0]]),
                    np.full(2, 100.0), encoder_bwd=np.full((2, 2), 1.5 if trained else 0.0), encoder_p2p=np.full(2, 0.5),
                    feature_p2p=np.full(2, 0.25), encoder_activation_bytes=np.full((2, 2), 1000.0 if trained else 0.0))
    return table, lat


def test_separated_chunks_and_sub_micro_batches_by_hand():
    """rank 0: E0F0 [0,1] E0F1 [1,2] 0F0 waits for both features: [3.75,5.75]   0B0 [10.95,13.95]
    rank 1: E1F0 [1.5,2.5] E1F1 [2.5,3.5]       1F0 [5.85,7.85] 1B0 [7.85,10.85]
    trained, then: rank 1 E1B0 [14.2,15.7] E1B1 [15.7,17.2]; rank 0 E0B0 [16.2,17.7] E0B1 [17.7,19.2]."""
    table, lat = separated_by_hand(False)
    res = simulate(table, lat)
    expect = {"E0F0": (0, 1), "E0F1": (1, 2), "E1F0": (1.5, 2.5), "E1F1": (2.5, 3.5), "0F0": (3.75, 5.75), "1F0": (5.85, 7.85),
              "1B0": (7.85, 10.85), "0B0": (10.95, 13.95)}
    for k, v in expect.items():
        assert res.time_of(k) == pytest.approx(v)
    assert res.makespan == pytest.approx(13.95)
    # frozen: nothing is kept for the encoder; both sub-microbatches' features are held from 0F0 to 0B0
    assert res.peak_bytes.tolist() == pytest.approx([10.0 + 2 * 100.0, 20.0])
    assert compile_schedule(table).floating == ()  # encoder forwards feed another rank: they do not float
    table, lat = separated_by_hand(True)
    res = simulate(table, lat)
    for k, v in {**expect, "E1B0": (14.2, 15.7), "E1B1": (15.7, 17.2), "E0B0": (16.2, 17.7), "E0B1": (17.7, 19.2)}.items():
        assert res.time_of(k) == pytest.approx(v)
    assert res.makespan == pytest.approx(19.2)
    assert res.peak_bytes.tolist() == pytest.approx([2 * 1000.0 + 10.0 + 2 * 100.0, 2 * 1000.0 + 20.0])
    assert res.busy.tolist() == pytest.approx([2 + 2 + 3 + 3, 2 + 2 + 3 + 3])


def test_placement_lower_bound_holds_for_random_separated_plans():
    from random_schedules import random_separated_table

    from pipetune.cost.cost_model import rank_work
    from pipetune.simulate.lower_bound import placement_lower_bound

    rng = np.random.default_rng(8)
    for _ in range(40):
        table = random_separated_table(rng)
        m, n, S, E = table.num_micro_batches, table.num_sub_micro_batches, table.num_stages, len(table.placement.encoder)
        lat = Latencies(rng.random((m, S)), rng.random((m, S)), rng.random((n, E)), rng.random(m) * 0.1, encoder_bwd=rng.random((n, E)),
                        encoder_p2p=rng.random(n) * 0.1, feature_p2p=rng.random(n) * 0.1)
        res = simulate(table, lat)
        assert placement_lower_bound(table, lat) <= res.makespan + 1e-12
        assert res.busy == pytest.approx(rank_work(table.placement, lat))  # a frozen encoder's backward costs are ignored
        dag = compile_schedule(table)
        if m > 1 and not dag.one_to_one:
            with pytest.raises(ValueError, match="permute sub-microbatches only"):
                evaluate(dag, lat, np.arange(m)[::-1][None])


def test_pictures_of_separated_plans_show_encoder_chunks_and_backwards(tmp_path):
    table, lat = separated_by_hand(True)
    actions = list(simulate(table, lat).actions)
    events = [e for e in chrome_trace(actions)["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(table.expected_actions())
    assert {e["cat"] for e in events} == {"forward", "backward", "encoder", "encoder backward"}
    assert {(e["args"]["module"], e["args"]["chunk"]) for e in events if e["cat"] == "encoder"} == {("encoder", 0), ("encoder", 1)}
    write_trace(actions, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
