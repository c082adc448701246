"""Interleaved (virtual-stage) and split-backward (zero-bubble) tables, checked against an
independent time-slot evaluation (the tabular-schedule paper's table level) and the closed forms.

``slot_table`` evaluates a table as the paper's time-slot tables do, without the simulator's DAG:
every action takes whole slots (F 1, B 2, I 1, W 1), a rank starts its next action in the first
slot where the rank is free and every producer has finished, messages cost nothing. From the
slots it reads the schedule length, the bubble ratio (idle slots over ranks x length) and every
micro-batch's activation lifetime per chunk (from its forward's start to the end of the action
that frees it), hence the most activations each rank holds at once.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pipetune.schedule.schedules import Schedule, UNIT_TIME, activation_caps, in_order, list_scheduled, one_f_one_b, onto_ranks
from pipetune.schedule.table import Action, Buffer, Module, Op, Placement, ScheduleError, ScheduleTable
from pipetune.simulate.dag import compile_schedule
from pipetune.simulate.simulator import Latencies, evaluate, simulate, split_times
from test_lowering_fifo import check as assert_runs_in_order


def slot_table(table: ScheduleTable) -> tuple[int, float, np.ndarray]:
    """Schedule length in slots, bubble ratio, and each rank's peak count of live activations."""
    end: dict[Action, int] = {}
    free = [0] * table.num_ranks
    pos = [0] * table.num_ranks
    while any(p < len(r) for p, r in zip(pos, table.ranks)):
        moved = False
        for r, acts in enumerate(table.ranks):
            if pos[r] < len(acts) and all(q in end for q in table.producers(acts[pos[r]])):
                a = acts[pos[r]]
                start = max([free[r]] + [end[q] for q in table.producers(a)])
                end[a] = free[r] = start + UNIT_TIME[a.op]
                pos[r] += 1
                moved = True
        assert moved, "table deadlocks"
    length = max(end.values())
    busy = sum(UNIT_TIME[a.op] for acts in table.ranks for a in acts)
    release = table.release_op(Module.BACKBONE)
    peaks = np.zeros(table.num_ranks, int)
    for r, acts in enumerate(table.ranks):
        events = sorted((end[a] - UNIT_TIME[a.op], +1) if a.op is Op.FORWARD else (end[a], -1)
                        for a in acts if a.op in (Op.FORWARD, release) and not a.is_encoder)
        peaks[r] = np.cumsum([d for _, d in sorted(events, key=lambda e: (e[0], e[1]))]).max()
    return length, 1 - busy / (table.num_ranks * length), peaks


def uniform(table: ScheduleTable) -> Latencies:
    """Unit latencies that match the slot widths (F 1, B 2 split as I 1 + W 1), one activation byte per chunk."""
    m, S = table.num_micro_batches, table.num_stages
    return Latencies(np.ones((m, S)), np.full((m, S), 2.0), activation_bytes=np.ones((m, S)), bwd_input=np.ones((m, S)))


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_one_chunk_per_rank_without_split_is_torch_s_1f1b(P):
    for m in range(1, 3 * P + 2):
        assert list_scheduled(P, 1, range(m)).ranks == one_f_one_b(P, range(m)).ranks


CASES = [(P, V, m, split) for P in (2, 3, 4, 5, 8) for V in (1, 2, 3, 4) for m in range(1, 3 * P + 2) for split in (False, True)]


def test_every_family_runs_for_any_micro_batch_count_on_an_in_order_transport():
    rng = np.random.default_rng(0)
    for P, V, m, split in CASES:
        table = list_scheduled(P, V, rng.permutation(m), split_backward=split).validate()
        assert table.placement == Placement.interleaved(P, V) and table.split_backward == split
        if m <= P + 2 and P <= 4:
            assert_runs_in_order(table)


def test_weights_placed_by_a_batch_s_latencies_move_only_w_and_stay_runnable():
    """``times``/``p2p``: the run that places ``W`` takes real times. Each rank's forwards and
    input gradients keep their order (the sequence is Megatron's either way); only ``W`` moves."""
    rng = np.random.default_rng(4)
    moved = 0
    for P, V, m, _ in CASES[::4]:
        S = P * V
        fwd = rng.uniform(0.2, 2.0, (m, S))
        bwd_input, weight, p2p = fwd * rng.uniform(0.5, 1.5, (m, S)), fwd * rng.uniform(0.5, 1.5, (m, S)), rng.uniform(0, 0.3, m)
        order = rng.permutation(m)

        times = {Op.FORWARD: fwd[order], Op.BACKWARD_INPUT: bwd_input[order], Op.BACKWARD_WEIGHT: weight[order]}
        timed = list_scheduled(P, V, range(m), split_backward=True, times=times, p2p=p2p[order]).validate()
        unit = list_scheduled(P, V, range(m), split_backward=True)
        without_w = lambda t: [[a for a in r if a.op is not Op.BACKWARD_WEIGHT] for r in t.ranks]  # noqa: E731
        assert without_w(timed) == without_w(unit)
        moved += timed.ranks != unit.ranks
        if m <= P + 2 and P <= 4:
            assert_runs_in_order(timed)
    assert moved > 0


def test_a_w_never_runs_ahead_of_an_input_gradient_that_was_ready_even_after_zero_time_actions():
    """A rank fills a bubble with a ``W`` only when its next input gradient is not ready yet. Chunk
    0's input gradient takes no time when nothing before it is trained (a frozen encoder); the run
    must not hold its rank after it (its clock would lag, and ``W`` go where no bubble is). Checked
    on the table replayed with the same times: every action as soon as its rank and inputs allow."""
    rng = np.random.default_rng(11)
    for P, V, m in [(4, 2, 10), (4, 2, 7), (8, 2, 16), (3, 3, 8)]:
        S = P * V
        times = {op: rng.uniform(0.5, 1.5, (m, S)) for op in (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)}
        times[Op.BACKWARD_INPUT][:, 0] = 0.0
        p2p = rng.uniform(0.01, 0.1, m)
        table = list_scheduled(P, V, range(m), split_backward=True, times=times, p2p=p2p).validate()
        start, ready, end, free = {}, {}, {}, [0.0] * P
        left = [list(acts) for acts in table.ranks]
        while any(left):
            for r, acts in enumerate(left):
                while acts and all(q in end for q in table.producers(acts[0])):
                    a = acts.pop(0)
                    ready[a] = max([0.0] + [end[q] + (p2p[a.unit] if q.chunk % P != r else 0.0) for q in table.producers(a)])
                    start[a] = max(free[r], ready[a])
                    end[a] = free[r] = start[a] + times[a.op][a.unit, a.chunk]
        for acts in table.ranks:
            for w, nxt in zip(acts, acts[1:]):
                if w.op is Op.BACKWARD_WEIGHT and nxt.op is Op.BACKWARD_INPUT:
                    assert ready[nxt] > start[w], (P, V, m, w, nxt)


def test_lazy_ranks_leave_their_bubbles_empty_and_run_w_last_unless_their_activations_are_capped():
    """``lazy_weights_from``: every rank keeps its forwards and input gradients in Megatron's order;
    ranks from ``k`` on run no ``W`` before their last ``F`` and ``I`` while uncapped, and under
    1F1B's caps (which force ``W`` out early: one micro-batch on the last rank) the tables still
    run within them."""
    uncapped = 0
    for P, V, m, _ in CASES[::6]:
        plain = list_scheduled(P, V, range(m), split_backward=True)
        without_w = lambda t: [[a for a in r if a.op is not Op.BACKWARD_WEIGHT] for r in t.ranks]  # noqa: E731
        for k in sorted({0, P // 2, P - 1}):
            lazy = list_scheduled(P, V, range(m), split_backward=True, lazy_weights_from=k).validate()
            assert without_w(lazy) == without_w(plain)
            if slot_table(lazy)[2].max() < max(activation_caps(P, V)):  # never capped: W strictly last on lazy ranks
                uncapped += 1
                for r in range(k, P):
                    ops = [a.op for a in lazy.ranks[r]]
                    assert Op.BACKWARD_WEIGHT not in ops[:len(ops) - ops.count(Op.BACKWARD_WEIGHT)], (P, V, m, k, r)
            if m <= P + 2 and P <= 4:
                assert_runs_in_order(lazy)
        capped = list_scheduled(P, V, range(m), split_backward=True, caps=activation_caps(P, V), lazy_weights_from=0).validate()
        assert (slot_table(capped)[2] <= np.array(activation_caps(P, V))).all()
    assert uncapped > 20


def test_a_table_over_positions_relabelled_by_an_order_is_the_table_of_that_order():
    rng = np.random.default_rng(5)
    for P, V, m, split in CASES[::5]:
        order = rng.permutation(m)
        assert in_order(list_scheduled(P, V, range(m), split_backward=split, encoder=True), order) == \
            list_scheduled(P, V, order, split_backward=split, encoder=True)
        if V == 1 and not split:
            assert in_order(one_f_one_b(P, range(m), encoder=True), order) == one_f_one_b(P, order, encoder=True)


@pytest.mark.parametrize("P,m", [(4, 8), (4, 16), (8, 16), (8, 32)])
def test_bubble_ratios_match_the_closed_forms_when_rounds_are_whole(P, m):
    """1F1B: (P-1)/(m+P-1); interleaved with V chunks: the fill and drain shrink V-fold;
    ZB-H1 (F = I = W): (P-1)(F + I - W) idle per rank, and interleaved ZB V-fold less."""
    for V, split, idle_per_rank in [(1, False, 3 * (P - 1)), (2, False, 3 * (P - 1) / 2), (4, False, 3 * (P - 1) / 4),
                                    (1, True, P - 1), (2, True, (P - 1) / 2)]:
        table = list_scheduled(P, V, range(m), split_backward=split)
        length, bubble, _ = slot_table(table)
        work = 3 * m * V  # slots per rank
        # slots are whole for V = 1; with V chunks a chunk's action is 1/V of a stage's, so compare in stage units
        assert length / V == pytest.approx(work / V + idle_per_rank), (V, split)
        assert bubble == pytest.approx(idle_per_rank / (work / V + idle_per_rank))


def test_the_simulator_and_memory_model_agree_with_the_slot_table():
    rng = np.random.default_rng(1)
    for P, V, m, split in CASES[::3]:
        table = list_scheduled(P, V, rng.permutation(m), split_backward=split)
        length, bubble, peaks = slot_table(table)
        sim = simulate(table, uniform(table))
        assert sim.makespan == pytest.approx(length)
        assert sim.bubble_ratio == pytest.approx(bubble)
        np.testing.assert_array_equal(sim.peak_bytes, peaks)


def test_activation_peaks_stay_within_each_family_s_limit():
    for P, V, m, split in CASES:
        table = list_scheduled(P, V, range(m), split_backward=split)
        _, _, peaks = slot_table(table)
        caps = np.array(activation_caps(P, V))
        limit = np.full(P, caps.max()) if split else caps
        assert (peaks <= limit).all(), (P, V, m, split)
        if not split and m >= P * V:
            assert (peaks == np.minimum(caps, m * V)).any()


def test_split_backward_frees_activations_at_w_and_defers_w_without_breaking_dependencies():
    table = list_scheduled(4, 1, range(8), split_backward=True)
    for kind, s, j, alloc, free in table.buffers():
        if kind is Buffer.ACTIVATION:
            assert free == Action(s, Op.BACKWARD_WEIGHT, j)
    assert table.consumers(Action(2, Op.BACKWARD_INPUT, 5)) == (Action(1, Op.BACKWARD_INPUT, 5), Action(2, Op.BACKWARD_WEIGHT, 5))
    assert table.producers(Action(2, Op.BACKWARD_WEIGHT, 5)) == (Action(2, Op.BACKWARD_INPUT, 5),)
    last = table.ranks[3]
    assert [str(a) for a in last[:3]] == ["3F0", "3I0", "3F1"]  # the last rank defers W to a bubble
    bad = list(table.ranks)
    bad[3] = tuple(a for a in last if a != Action(3, Op.BACKWARD_WEIGHT, 7)) + (Action(3, Op.BACKWARD, 7),)
    with pytest.raises(ScheduleError, match="I and W, not B"):
        ScheduleTable(table.placement, 8, tuple(bad), split_backward=True).validate()


def test_encoder_actions_sit_beside_chunk_zero_and_a_trained_encoder_follows_its_input_gradient():
    table = list_scheduled(2, 2, range(4), split_backward=True, encoder=True, encoder_trained=True)
    r0 = [str(a) for a in table.ranks[0]]
    for j in range(4):
        assert r0[r0.index(f"0F{j}") - 1] == f"E0F{j}"
        assert r0[r0.index(f"0I{j}") + 1] == f"E0B{j}"
    assert_runs_in_order(table)


def test_split_and_interleaved_tables_round_trip_through_torch_s_csv_form():
    table = list_scheduled(3, 2, range(5), split_backward=True)
    back = ScheduleTable.from_csv(table.to_csv(), num_stages=6, num_micro_batches=5)
    assert back.ranks == table.ranks and back.split_backward and back.placement == table.placement


def test_schedule_build_refuses_what_it_cannot_make():
    with pytest.raises(ScheduleError, match="come with 1F1B"):
        Schedule.GPIPE.build(4, range(4), chunks_per_rank=2)
    with pytest.raises(ScheduleError, match="do not split"):
        Schedule.ONE_F_ONE_B.build(5, range(4), chunks_per_rank=2)
    assert Schedule.ONE_F_ONE_B.build(4, range(6), chunks_per_rank=2).placement == Placement.interleaved(2, 2)


def test_zero_bubble_with_uneven_latencies_is_never_slower_than_1f1b_on_random_costs():
    """The same forward/backward sequence with W deferred into bubbles (I = half of B here). A
    regression check on these draws, not a theorem: W's places come from unit times."""
    rng = np.random.default_rng(2)
    for P, m in itertools.product((2, 4, 8), (4, 9, 16)):
        fwd = rng.uniform(0.5, 1.5, (m, P))
        lat = Latencies(fwd, 2 * fwd)
        plain = simulate(list_scheduled(P, 1, range(m)), lat).makespan
        zb = simulate(list_scheduled(P, 1, range(m), split_backward=True), lat).makespan
        assert zb <= plain + 1e-9


def test_the_lower_bounds_hold_for_every_family_and_the_placement_bound_is_the_tighter():
    from pipetune.simulate.lower_bound import makespan_lower_bound, placement_lower_bound

    rng = np.random.default_rng(3)
    tighter = 0
    for P, V, m, split in CASES[::2]:
        S = P * V
        fwd = rng.uniform(0.2, 2.0, (m, S)) / V
        bwd = fwd * rng.uniform(1.5, 2.5, (m, S))
        trained = m % 2 == 0
        enc = rng.uniform(0, 1, m)
        lat = Latencies(fwd, bwd, enc, rng.uniform(0, 0.05, m), bwd_input=bwd * rng.uniform(0.3, 0.7, (m, S)),
                        encoder_bwd=2 * enc if trained else None)
        table = list_scheduled(P, V, rng.permutation(m), split_backward=split, encoder=True, encoder_trained=trained)
        span = simulate(table, lat).makespan
        relaxed = makespan_lower_bound(lat, table.placement, split_backward=True)
        assert relaxed <= span + 1e-9
        split_table = list_scheduled(P, V, range(m), split_backward=True, encoder=True, encoder_trained=trained)
        assert relaxed - 1e-9 <= placement_lower_bound(split_table, lat) <= span + 1e-9  # valid for whole backwards too
        assert placement_lower_bound(split_table, lat) <= placement_lower_bound(table, lat) + 1e-9
        tighter += placement_lower_bound(split_table, lat) > relaxed + 1e-9
        if not split:
            whole = makespan_lower_bound(lat, table.placement)
            assert relaxed <= whole + 1e-9 <= span + 2e-9
    assert tighter > 0  # 59 of the 284 cases
    lat = Latencies(rng.uniform(0.5, 1, (6, 3)), rng.uniform(1, 2, (6, 3)), rng.uniform(0, 1, 6), rng.uniform(0, 0.1, 6))
    assert makespan_lower_bound(lat) == makespan_lower_bound(lat, Placement.colocated(3))


def test_a_bound_asked_only_to_reach_a_level_is_still_a_bound_and_reaches_it_when_the_exact_one_does():
    from pipetune.simulate.lower_bound import placement_lower_bound

    rng = np.random.default_rng(4)
    for P, V, m, split in CASES[::7]:
        S = P * V
        fwd = rng.uniform(0.2, 2.0, (m, S)) / V
        lat = Latencies(fwd, 2 * fwd, rng.uniform(0, 1, m), rng.uniform(0, 0.05, m))
        table = list_scheduled(P, V, range(m), split_backward=split, encoder=True)
        exact = placement_lower_bound(table, lat)
        for level in (0.5 * exact, 0.99 * exact, exact, 1.01 * exact):
            quick = placement_lower_bound(table, lat, enough=level)
            assert min(level, exact) <= quick <= exact


@pytest.mark.parametrize("seed", range(12))
def test_onto_ranks_moves_any_table_and_keeps_each_ranks_order(seed):
    """``onto_ranks`` moves interleaved, zero-bubble and separated tables (GPU check: a whole plan
    in one process) onto fewer ranks: every action once, each old rank's list a subsequence of its
    new rank's, every chunk on its new rank, and the result runs on an in-order transport."""
    from random_schedules import random_separated_table

    rng = np.random.default_rng(seed)
    if seed % 3 == 2:
        table = random_separated_table(rng)
    else:
        P, V = int(rng.integers(2, 5)), int(rng.integers(1, 4))
        order = rng.permutation(int(rng.integers(1, 9))).tolist()
        table = list_scheduled(P, V, order, split_backward=bool(seed % 3), encoder=True, encoder_trained=bool(rng.random() < 0.5))
    P = table.num_ranks
    rank_of = tuple(0 for _ in range(P)) if seed % 2 else tuple(r // 2 for r in range(P))
    moved = onto_ranks(table, rank_of)
    assert sorted(map(str, (a for r in moved.ranks for a in r))) == sorted(map(str, (a for r in table.ranks for a in r)))
    for r, acts in enumerate(table.ranks):
        it = iter(moved.ranks[rank_of[r]])
        assert all(a in it for a in acts), f"rank {r}'s order is not kept"
    for a in (a for r in table.ranks for a in r):
        assert moved.placement.rank_of(a) == rank_of[table.placement.rank_of(a)]
    assert_runs_in_order(moved)


def test_onto_ranks_refuses_a_map_of_the_wrong_length():
    with pytest.raises(ScheduleError, match="2 new ranks given for a table of 3 ranks"):
        onto_ranks(one_f_one_b(3, range(4)), (0, 0))


def test_a_run_that_reaches_within_is_a_table_the_simulator_times_at_within_or_more():
    """``within``: ``list_scheduled`` gives up once its run reaches it. With a batch's times its run
    is the table's own timing, co-located encoder (frozen or trained) included: the table comes back
    for ``within`` just above the simulated makespan and not for ``within`` just below it, on random
    latencies, orders and layouts (fails if the run and the simulator time the table differently)."""
    rng = np.random.default_rng(5)
    for P, V, m in [(2, 2, 3), (4, 1, 6), (4, 2, 9), (8, 2, 8), (3, 3, 7)]:
        for trained in (False, True):
            S = P * V
            fwd = rng.uniform(0.2, 2.0, (m, S))
            bwd = fwd * rng.uniform(1.0, 3.0, (m, S))
            lat = Latencies(fwd, bwd, encoder=rng.uniform(0.0, 1.5, m), p2p=rng.uniform(0, 0.3, m), bwd_input=bwd * rng.uniform(0.3, 0.7, (m, S)),
                            encoder_bwd=rng.uniform(0.5, 2.0, m) if trained else None)
            order = rng.permutation(m)
            build = lambda within: list_scheduled(P, V, range(m), split_backward=True, encoder=True, encoder_trained=trained,  # noqa: E731
                                                  times=split_times(lat, order, encoder=True, encoder_trained=trained), p2p=lat.p2p[order],
                                                  within=within)
            table = build(np.inf)
            span = float(evaluate(compile_schedule(table), lat, order[None]).makespan[0])
            assert build(span * (1 + 1e-9)) == table
            assert build(span * (1 - 1e-9)) is None
