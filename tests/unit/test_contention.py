"""Contention: concurrent time, its price in the simulator, and its fit from measured timelines."""

from dataclasses import replace

import numpy as np
import pytest

from recorded_stream import RecordedStream
from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.calibrate.action_fit import OVERHEAD_GRID, Design, calibrate_design
from pipetune.cost.latency_table import LatencyTableError, table_from_dict
from pipetune.data import batch_meta, make_mix
from pipetune.plan.layout.planner_config import PlannerConfig
from pipetune.simulate import Latencies, TimedAction, compile_schedule, evaluate, simulate
from pipetune.simulate.contention import concurrent_time, overlap_with_others
from pipetune.calibrate.online import MeasuredStep, OnlineCalibrator, fit_steps, simulate_plan, with_overhead
from pipetune.calibrate.pairs import TUNED_TWINS_MIN, PairCalibrator, size_overhead, twin_contention
from image_sizing import square_images


def brute(start, end, rank, dt=1e-3):
    """Concurrent time and per-interval overlap with other ranks, on a fine grid."""
    t = np.arange(0, end.max() + dt, dt) + dt / 2
    on = (t[None] >= start[:, None]) & (t[None] < end[:, None])
    ranks_on = np.array([on[rank == r].any(axis=0) for r in np.unique(rank)])
    others = np.array([(ranks_on.sum(axis=0) - ranks_on[list(np.unique(rank)).index(r)]) > 0 for r in rank])
    return float((ranks_on.sum(axis=0) >= 2).sum() * dt), (on & others).sum(axis=1) * dt


@pytest.mark.parametrize("seed", range(5))
def test_concurrent_time_and_overlap_match_a_fine_grid(seed):
    rng = np.random.default_rng(seed)
    start, end, rank = [], [], []
    for r in range(3):  # each rank: back-to-back or gapped intervals that never overlap each other
        t = rng.uniform(0, 0.5)
        for _ in range(rng.integers(2, 7)):
            d = rng.uniform(0.05, 0.6)
            start.append(t), end.append(t + d), rank.append(r)
            t += d + rng.choice([0.0, rng.uniform(0, 0.4)])
    start, end, rank = map(np.array, (start, end, rank))
    total, overlap = brute(start, end, rank)
    assert concurrent_time(start[:, None], end[:, None])[0] == pytest.approx(total, abs=5e-3)
    np.testing.assert_allclose(overlap_with_others(start, end), overlap, atol=5e-3)


@pytest.fixture(scope="module")
def job():
    model = load_model_config("7b")
    cost = CostModel(analytical_table(model, load_hardware("a100"), tp=4), StageLayout.even(32, 2))
    data = make_mix("datamix2", 3000, 0)
    stream = RecordedStream(len(data), 32)  # the batches these properties were shown on
    metas = [batch_meta(data, stream, s, images=square_images(576), max_seq_len=4096) for s in range(10)]
    return model, cost, metas


def test_makespan_adds_kappa_times_concurrent_time_and_one_micro_batch_pays_nothing(job):
    model, cost, metas = job
    for mbs in (1, 4):
        plan = PlannerConfig(mode="balanced", mbs=mbs, max_seq_len=4096, memory_bytes=80e9).build(model, cost).plan(metas[0])
        lat = Latencies.from_costs(cost.stage_costs(plan.shapes(metas[0])))
        free = simulate(plan.table(), lat)
        busy = list(free.actions)
        shared = concurrent_time(np.array([[a.start] for a in busy]), np.array([[a.end] for a in busy]))[0]
        hot = simulate(plan.table(), replace(lat, contention=0.5))
        assert hot.makespan == pytest.approx(free.makespan + 0.5 * shared)
        assert hot.contention_s == pytest.approx(0.5 * shared)
        assert hot.busy.sum() - free.busy.sum() == pytest.approx(0.5 * overlap_with_others([a.start for a in busy], [a.end for a in busy]).sum())
        dag = compile_schedule(plan.table())
        assert evaluate(dag, replace(lat, contention=0.5), np.arange(plan.num_micro_batches)[None]).makespan[0] == pytest.approx(hot.makespan)
        if plan.num_micro_batches == 1:  # one micro-batch: the ranks never work at once
            assert shared == 0 and hot.makespan == free.makespan
        else:
            assert shared > 0.1 * free.makespan


def contended_timeline(cost: CostModel, plan, meta, kappa: float, rng, noise: float) -> tuple[list[TimedAction], float]:
    """What a machine with contention ``kappa`` records, by the model's own account: the simulated
    timeline with time stretched by ``1 + kappa`` wherever two ranks work at once (so each action
    gains kappa times its overlap with other ranks, and that overlap grows by ``1 + kappa``), then
    lognormal noise on each action's duration (a rank's later actions wait for its earlier ones)."""
    acts = list(simulate_plan(cost, plan, meta).actions)
    points = np.unique([t for a in acts for t in (a.start, a.end)])
    mid = (points[:-1] + points[1:]) / 2
    ranks = np.array([len({a.rank for a in acts if a.start <= m < a.end}) for m in mid])
    warped = dict(zip(points.tolist(), np.concatenate([[0.0], np.cumsum(np.diff(points) * (1 + kappa * (ranks >= 2)))]) + points[0]))
    out, free = [], {}
    for a in sorted(acts, key=lambda a: (a.rank, a.start)):  # a rank still runs one action at a time
        start = max(warped[a.start], free.get(a.rank, 0.0))
        free[a.rank] = start + (warped[a.end] - warped[a.start]) * (np.exp(noise * rng.standard_normal()) if noise else 1.0)
        out.append(TimedAction(a.rank, a.action, start, free[a.rank], a.precomputed))
    return out, max(free.values())


def steps_of(model, truth: CostModel, base: CostModel, metas, mbs_list, kappa, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for meta, mbs in zip(metas, mbs_list):
        plan = PlannerConfig(mode="balanced", mbs=mbs, max_seq_len=4096, memory_bytes=80e9).build(model, truth).plan(meta)
        timeline, span = contended_timeline(truth, plan, meta, kappa, rng, noise)
        out.append(MeasuredStep.from_timelines(base, [timeline], plan, meta, span))
    return out


@pytest.mark.parametrize("kappa", [0.0, 0.5])
def test_calibration_recovers_contention_and_predicts_the_other_family(job, kappa):
    """The machine: the table with rest-of-layer work 30 % slower, plus contention kappa. Fitted on
    plans of many small micro-batches only (mbs 1, about 7 per batch), the table predicts plans of
    one large micro-batch (mbs 12: the ranks never work at once) within 3 %; the same fit without
    overlaps (what calibration did before contention) folds the slow-down into the scales and
    over-predicts them."""
    model, base, metas = job
    truth = CostModel(replace(base.table, scales={"rest": 1.3}), base.layout)
    steps = steps_of(model, truth, base, metas[:8], [1] * 8, kappa, noise=0.03)
    cost, report = fit_steps(base, steps)
    assert report.contention == pytest.approx(kappa, abs=0.1)
    blind = fit_steps(base, [replace(s, design=replace(s.design, overlap=np.zeros(len(s.design.y)))) for s in steps])[0]
    for meta in metas[8:]:
        plan = PlannerConfig(mode="balanced", mbs=12, max_seq_len=4096, memory_bytes=80e9).build(model, truth).plan(meta)
        assert plan.num_micro_batches == 1
        true_s = contended_timeline(truth, plan, meta, kappa, None, 0.0)[1]
        assert simulate_plan(cost, plan, meta).makespan == pytest.approx(true_s, rel=0.03)
        if kappa:
            assert simulate_plan(blind, plan, meta).makespan > 1.1 * true_s


def test_the_online_calibration_holds_the_tables_kappa_unless_a_testbed_fits_it(job):
    """GPU ranks do not share compute, so the trainer's ``OnlineCalibrator`` keeps the profiled
    table's kappa (0) on any window; the CPU testbed's ``PairCalibrator`` fits it in the window
    until pairs measure it (here, with no pairs, from the actions' overlaps)."""
    model, base, metas = job
    truth = CostModel(replace(base.table, scales={"rest": 1.3}), base.layout)
    steps = steps_of(model, truth, base, metas[:6], [1] * 6, 0.5)
    core, testbed = OnlineCalibrator(base.table, base.layout, 6), PairCalibrator(base.table, base.layout, 6)
    for step in steps:
        held, fitted = core.update(step)[0], testbed.update(step)[0]
    assert held.table.contention == base.table.contention == 0
    assert fitted.table.contention == pytest.approx(0.5, abs=0.1)


def test_a_held_contention_is_kept_and_the_other_family_priced_by_it(job):
    """``fit_contention=False`` keeps the table's kappa and fits the rest around it: held at the
    machine's kappa, the fit on mbs-1 plans prices one-micro-batch plans right; held at 0, the
    slow-down goes into the scales and those plans come out too slow."""
    model, base, metas = job
    truth = CostModel(replace(base.table, scales={"rest": 1.3}), base.layout)
    steps = steps_of(model, truth, base, metas[:8], [1] * 8, 0.5, noise=0.03)
    fits = {k: fit_steps(CostModel(replace(base.table, contention=k), base.layout), steps, fit_contention=False) for k in (0.0, 0.5)}
    assert [(cost.table.contention, report.contention) for cost, report in fits.values()] == [(0.0, 0.0), (0.5, 0.5)]
    for meta in metas[8:]:
        plan = PlannerConfig(mode="balanced", mbs=12, max_seq_len=4096, memory_bytes=80e9).build(model, truth).plan(meta)
        true_s = contended_timeline(truth, plan, meta, 0.5, None, 0.0)[1]
        assert simulate_plan(fits[0.5][0], plan, meta).makespan == pytest.approx(true_s, rel=0.03)
        assert simulate_plan(fits[0.0][0], plan, meta).makespan > 1.1 * true_s


def twin_calibrator(model, truth: CostModel, base: CostModel, metas, kappa: float, *, iteration_kappa: float | None = None,
                    serial_first: bool = False) -> PairCalibrator:
    """A ``PairCalibrator`` fed, per batch, a balanced plan (mbs 1 or 2) and its serial twin as
    calibration runs, timed on ``truth`` with contention ``kappa`` (iteration times as under
    ``iteration_kappa`` where given), the twin first if ``serial_first``."""
    rng = np.random.default_rng(0)
    cal = PairCalibrator(base.table, base.layout, 4)
    for i, meta in enumerate(metas):
        plan = PlannerConfig(mode="balanced", mbs=1 + i % 2, max_seq_len=4096, memory_bytes=80e9).build(model, truth).plan(meta)
        twin = plan.serialised()
        assert (twin.micro_batches, twin.order) == (plan.micro_batches, plan.order) and twin.ranks != plan.ranks
        for p in (twin, plan) if serial_first else (plan, twin):
            timeline, span = contended_timeline(truth, p, meta, kappa, rng, 0.03)
            if iteration_kappa is not None:
                _, span = contended_timeline(truth, p, meta, iteration_kappa, rng, 0.0)
            step = MeasuredStep.from_timelines(base, [timeline], p, meta, span)
            cal.update(step, calibration=True) if p is plan else cal.observe_serial(step)
    return cal


@pytest.mark.parametrize("kappa", [0.0, 0.5])
def test_serial_twins_measure_contention_and_the_window_holds_it(job, kappa):
    """Calibration steps run their plan pipelined and serially (``IterationPlan.serialised``: the
    same actions, no overlap): the calibrator takes kappa from those pairs, within 0.05 of the
    machine's, and holds it while its window moves on to the planner's plans. The window here
    carries no information on kappa (every row's overlap replaced by the step's mean, as when
    nearly every action overlaps alike): fitted alone it moves kappa off the machine's; held,
    kappa stays. The calibrator's state restores to the same fit."""
    model, base, metas = job
    truth = CostModel(replace(base.table, scales={"rest": 1.3}), base.layout)
    cal = twin_calibrator(model, truth, base, metas[:4], kappa)
    assert cal.contention == pytest.approx(kappa, abs=0.05)
    steps = steps_of(model, truth, base, metas[4:8], [1] * 4, kappa, noise=0.03, seed=1)
    flat = [replace(s, design=replace(s.design, overlap=np.full(len(s.design.y), s.design.overlap.mean()))) for s in steps]
    alone = PairCalibrator(base.table, base.layout, 4)
    for s in flat:
        cost, report = cal.update(s)
        alone.update(s)
    assert report.contention == cost.table.contention == cal.contention and list(cal.steps) == flat
    if kappa:
        assert abs(alone.fit()[1].contention - kappa) > 0.1
    again = PairCalibrator(base.table, base.layout, 4)
    restored, _ = again.load_state_dict(cal.state_dict())
    assert restored.table == cost.table and again.twins == cal.twins


def test_twins_measure_the_contention_iteration_times_show_where_action_times_understate_it(job):
    """A machine where part of what two busy ranks cost shows between actions (wake-ups, message
    hand-offs), not in them: actions timed as under kappa 0.2, iteration times as under 0.5. Fitted
    to the action times, kappa is 0.2, and the model prices every twin's pipelined run 10 % or more
    too fast against its serial one; measured on the twins' iteration times (``twin_contention``,
    what the calibrator holds) it is 0.5 and prices those ratios within 1 %."""
    model, base, metas = job
    truth = CostModel(replace(base.table, scales={"rest": 1.3}), base.layout)
    cal = twin_calibrator(model, truth, base, metas[:4], 0.2, iteration_kappa=0.5, serial_first=True)
    runs = Design.stack([run.design for run in cal.calibration_runs])
    acted = calibrate_design(base.table, runs)[1].contention
    assert acted == pytest.approx(0.2, abs=0.05) and cal.contention == pytest.approx(0.5, abs=0.05)
    assert twin_contention(base, cal.calibration_runs, cal.twins) == cal.contention and len(cal.twins) == 4
    for kappa, worst in ((acted, (-1, -0.1)), (cal.contention, (-0.01, 0.01))):
        cost = CostModel(calibrate_design(replace(base.table, contention=kappa), runs, fit_contention=False)[0], base.layout)
        for pipelined, serial in cal.twins:
            predicted = simulate_plan(cost, pipelined.plan, pipelined.meta).makespan / simulate_plan(cost, serial.plan, serial.meta).makespan
            assert worst[0] <= predicted / (pipelined.measured_s / serial.measured_s) - 1 <= worst[1]
    with pytest.raises(ValueError, match="at least one"):
        twin_contention(base, cal.calibration_runs, [])


def test_size_twins_measure_the_per_call_overhead_iteration_times_show(job):
    """A machine where splitting a batch into more micro-batches costs a fixed time per stage call
    that shows between actions, not in them (hand-offs): actions timed by the table, iteration
    times as with that overhead. Calibration steps at mbs 1 run pipelined, serially and at mbs 8
    serially (the size twin). Fitted to the action times the overhead is zero, and the model
    prices each serial mbs-1 run 3 % or more too cheap against its size twin; measured on the
    pairs' iteration times (``size_overhead``) it is the machine's, within the grid's step, and
    the window's fit, which holds it, prices a one-micro-batch batch against the same batch at
    mbs 1 within 1 %. The calibrator's state restores to the same fit."""
    model, base, metas = job
    truth = CostModel(replace(base.table, scales={"rest": 1.3}), base.layout)
    unit = float(np.median(steps_of(model, truth, base, metas[:1], [1], 0.0)[0].design.y))
    handoff = CostModel(with_overhead(truth.table, 0.06 * unit), base.layout)  # what iteration times show
    rng = np.random.default_rng(0)
    cal = PairCalibrator(base.table, base.layout, 4)

    def run(plan, meta):
        timeline, _ = contended_timeline(truth, plan, meta, 0.3, rng, 0.01)
        return MeasuredStep.from_timelines(base, [timeline], plan, meta, contended_timeline(handoff, plan, meta, 0.3, rng, 0.0)[1])

    for meta in metas[:4]:
        plan = PlannerConfig(mode="balanced", mbs=1, max_seq_len=4096, memory_bytes=80e9).build(model, truth).plan(meta)
        large = PlannerConfig(mode="balanced", mbs=8, max_seq_len=4096, memory_bytes=80e9).build(model, truth).plan(meta).serialised()
        assert large.num_micro_batches < plan.num_micro_batches
        cal.update(run(plan, meta), calibration=True)
        cal.observe_serial(run(plan.serialised(), meta))
        cal.observe_serial(run(large, meta), size_twin=True)
    assert len(cal.size_pairs) == len(cal.twins) == 4 and cal.contention == pytest.approx(0.3, abs=0.05)
    runs = Design.stack([r.design for r in cal.calibration_runs])
    acted = CostModel(calibrate_design(replace(base.table, contention=cal.contention), runs, fit_contention=False)[0], base.layout)
    assert acted.table.fixed("fwd") + acted.table.fixed("bwd") < 0.01 * unit
    step = float(np.diff(OVERHEAD_GRID)[0]) * float(np.median(runs.y[runs.stage_work_rows()]))
    assert cal.overhead == pytest.approx(0.06 * unit, abs=step)
    assert size_overhead(cal.held(), cal.calibration_runs, cal.size_pairs) == cal.overhead

    def ratio(cost, small, large):
        return simulate_plan(cost, small.plan, small.meta).makespan / simulate_plan(cost, large.plan, large.meta).makespan

    for small, large in cal.size_pairs:
        measured = small.measured_s / large.measured_s
        assert ratio(acted, small, large) / measured - 1 < -0.03
    window = steps_of(model, truth, base, metas[4:8], [1] * 4, 0.3, noise=0.01, seed=1)
    for s in window:
        cost, _ = cal.update(s)
    assert cost.table.fixed("fwd") + cost.table.fixed("bwd") > 0
    for meta in metas[8:]:
        small, large = (PlannerConfig(mode="balanced", mbs=m, max_seq_len=4096, memory_bytes=80e9).build(model, truth).plan(meta).serialised()
                        for m in (1, 12))
        assert large.num_micro_batches == 1
        true = simulate_plan(handoff, small, meta).makespan / simulate_plan(handoff, large, meta).makespan
        assert simulate_plan(cost, small, meta).makespan / simulate_plan(cost, large, meta).makespan == pytest.approx(true, rel=0.01)
    with pytest.raises(ValueError, match="at least one"):
        size_overhead(base, cal.calibration_runs, [])
    again = PairCalibrator(base.table, base.layout, 4)
    assert again.load_state_dict(cal.state_dict())[0].table == cost.table


def test_isolated_timings_leave_contention_as_it_was(job):
    model, base, metas = job
    prior = CostModel(replace(base.table, contention=0.2), base.layout)
    steps = steps_of(model, base, prior, metas[:4], [2] * 4, 0.0)
    isolated = [replace(s, design=replace(s.design, overlap=np.zeros(len(s.design.y)))) for s in steps]
    assert fit_steps(prior, isolated)[1].contention == 0.2


def test_table_keeps_contention_and_refuses_a_bad_one(job):
    _, base, _ = job
    raw = replace(base.table, contention=0.25).to_dict()
    assert table_from_dict(raw).contention == 0.25
    assert "contention" not in base.table.to_dict()
    for bad in (-0.1, "0.3", float("nan")):
        with pytest.raises(LatencyTableError, match="contention must be a finite number >= 0"):
            table_from_dict({**raw, "contention": bad})


def test_tuned_twins_measure_the_contention_of_the_plans_being_priced(job):
    """A machine whose contention differs between plan families: the calibration's balanced plans
    run as under kappa 0.3, the planner's pipetune plans as under 0.6 (iteration times; actions as
    under 0.3 throughout). Measured on the calibration twins kappa is 0.3 and prices the pipetune
    plans' pipelined runs against their serial ones 5 % or more too fast. Each pipetune step run
    also serially (a tuned twin, paired whichever of its runs comes first, not with a serial run
    of another batch) joins the twins kappa is measured on; from ``TUNED_TWINS_MIN`` of them on,
    kappa is theirs alone: 0.6, pricing those ratios within 1 %. The state restores to the same
    fit."""
    model, base, metas = job
    truth = CostModel(replace(base.table, scales={"rest": 1.3}), base.layout)
    cal = twin_calibrator(model, truth, base, metas[:4], 0.3)
    assert cal.contention == pytest.approx(0.3, abs=0.05)
    rng = np.random.default_rng(1)
    planner = PlannerConfig(mode="pipetune", max_seq_len=4096, memory_bytes=80e9, max_mbs=2).build(model, truth)

    def run(plan, meta):
        timeline, _ = contended_timeline(truth, plan, meta, 0.3, rng, 0.01)
        return MeasuredStep.from_timelines(base, [timeline], plan, meta, contended_timeline(truth, plan, meta, 0.6, rng, 0.0)[1])

    def ratio_error(pipelined, serial):
        cost = cal.fit()[0]
        predicted = simulate_plan(cost, pipelined.plan, pipelined.meta).makespan / simulate_plan(cost, serial.plan, serial.meta).makespan
        return predicted / (pipelined.measured_s / serial.measured_s) - 1

    stray = run(planner.plan(metas[9]).serialised(), metas[9])
    cal.observe_serial(stray, tuned=True)  # its pipelined run never comes: it pairs with nothing
    for i, meta in enumerate(metas[4:8]):
        plan = planner.plan(meta)
        assert plan.has_serial_twin
        pipelined, serial = run(plan, meta), run(plan.serialised(), meta)
        for step in (serial, pipelined) if i % 2 else (pipelined, serial):
            cal.update(step) if step is pipelined else cal.observe_serial(step, tuned=True)
        assert len(cal.tuned_twins) == i + 1 and cal.tuned_twins[-1] == (pipelined, serial)
        if i == 0:
            assert ratio_error(pipelined, serial) < -0.05
        if i + 1 < TUNED_TWINS_MIN:
            assert cal.contention_twins() == cal.twins + list(cal.tuned_twins)
    assert cal.contention_twins() == list(cal.tuned_twins) and cal.contention == pytest.approx(0.6, abs=0.05)
    assert all(abs(ratio_error(*twin)) < 0.01 for twin in cal.tuned_twins)
    again = PairCalibrator(base.table, base.layout, 4)
    assert again.load_state_dict(cal.state_dict())[0].table == cal.fit()[0].table and list(again.tuned_twins) == list(cal.tuned_twins)
