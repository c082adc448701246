"""Online calibration fits how a split backward divides into ``I`` and ``W``: timelines of
zero-bubble plans time each backward's ``I`` alone, the refit writes the fitted parts as the
table's ``bwd_input`` and the cost model then prices ``I`` and ``W`` as the machine runs them;
the whole-backward fit is untouched, and without split timelines the refit is exactly as before."""

import json
from dataclasses import replace

import numpy as np
import pytest

from pipetune.calibrate import action_fit
from pipetune.calibrate.action_fit import INPUT_GRAD_FITTED, Design, Observation, Part, calibrate_design
from pipetune.serve.learner import Learner
from pipetune.calibrate.online import MeasuredStep, OnlineCalibrator, fit_steps, simulate_plan, timeline_observations
from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table, load_latency_table
from pipetune.cost.latency_table import table_from_dict
from pipetune.data import BatchStream, batch_meta, make_mix
from pipetune.plan import Mode
from pipetune.plan.layout.planner_config import PlannerConfig
from pipetune.plan.data_parallel.replicas import ReplicaPlans
from pipetune.records import StepKind, StepRecord
from pipetune.schedule.table import Op
from image_sizing import square_images
from test_profiled_input_grad import SHAPES, hand_table, old_bwd_input, trained

TRUE_REST_SHARE = 0.7  # the machine's; the planning table estimates INPUT_GRAD_SHARE["rest"] = 0.5


@pytest.fixture(scope="module")
def machine():
    """The 7b model on PP 4 (frozen encoder: stage 0's ``I`` has nothing to do) priced by an
    analytical table with the estimated split, and a machine inside the calibrated family (scales,
    per-call overheads even between forward and backward, which stage rows cannot tell apart)
    whose layers' input gradient takes 0.7 of their backward."""
    model = load_model_config("7b")
    layout = StageLayout.even(32, 4)
    base = CostModel(analytical_table(model, load_hardware("a100"), tp=4), layout)
    rest = base.table.curves["rest"]
    curves = dict(base.table.curves, rest=replace(rest, bwd_input=TRUE_REST_SHARE * rest.bwd))
    truth = CostModel(replace(base.table, curves=curves, scales={"rest": 1.2, "attention": 0.9},
                              overhead={"fwd_s": 1.5e-3, "bwd_s": 1.5e-3}), layout)
    data = make_mix("datamix2", 3000, 0)
    stream = BatchStream(num_rows=len(data), gbs=32)
    metas = [batch_meta(data, stream, s, images=square_images(576), max_seq_len=4096) for s in range(10)]
    return model, base, truth, metas


def planner_config(split: str, **kw) -> PlannerConfig:
    return PlannerConfig(max_seq_len=4096, memory_bytes=80e9, max_mbs=4, split_backward=split, **kw)


def balanced(machine, mbs: int, split: str = "on"):
    model, base, _, _ = machine
    return planner_config(split, mode=Mode.BALANCED, mbs=mbs).build(model, base)


def record(step: int, plan, meta, truth: CostModel, kind: StepKind) -> StepRecord:
    """The trainer's record of ``plan`` run on a machine that behaves like ``truth``."""
    sim = simulate_plan(truth, plan, meta)
    return StepRecord(step=step, batch=meta.step, mode="pipetune", mbs=plan.mbs, micro_batches=plan.num_micro_batches, order=[],
                      samples=[], precomputed_encoders=0, predicted_s=plan.predicted_s, measured_s=sim.makespan, plan_setup_s=0.0,
                      loss=0.0, fallback=False, layout=[], separated=False, plan=plan.to_json(), kind=kind,
                      timeline=[[t.rank, str(t.action), t.start, t.end, t.precomputed] for t in sim.actions])


def learn(machine, split: str = "on"):
    """The trainer's calibration path: 4 calibration steps (balanced plans, mbs 1-4) anchor, then 4
    of the planner's own plans fill the window; the planner prices with every refit."""
    model, base, truth, metas = machine
    planner = planner_config(split).build(model, base)
    learner = Learner(base, calibrator=OnlineCalibrator(base.table, base.layout, window=4))
    for k, meta in enumerate(metas[:8]):
        kind = StepKind.CALIBRATION if k < 4 else StepKind.TUNED
        plan = (balanced(machine, 1 + k, split) if k < 4 else planner).plan(meta)
        learned = learner.observe([record(k + 2, plan, meta, truth, kind)], ReplicaPlans(meta.step, (plan,)), meta)
        planner.set_cost(learned.cost)
    return learner, planner


def split_errors(machine, cost: CostModel) -> tuple[float, float]:
    """Largest relative error of ``cost``'s ``I`` and ``W`` seconds (all micro-batches, per stage
    past 0) against the machine's, on two batches the fit has not seen at mbs 1, 2 and 4."""
    _, _, truth, metas = machine
    worst = np.zeros(2)
    for meta in metas[8:]:
        for mbs in (1, 2, 4):
            shapes = balanced(machine, mbs).plan(meta).shapes(meta)
            (fit, true) = (c.stage_costs(shapes) for c in (cost, truth))
            for k, part in enumerate((lambda c: c.bwd_input, lambda c: c.bwd - c.bwd_input)):
                rel = part(fit)[:, 1:].sum(axis=0) / part(true)[:, 1:].sum(axis=0) - 1
                worst[k] = max(worst[k], np.abs(rel).max())
    return float(worst[0]), float(worst[1])


def measured_steps(machine, split: str) -> list[MeasuredStep]:
    _, base, truth, metas = machine
    steps = []
    for k, meta in enumerate(metas[:6]):
        plan = balanced(machine, 1 + k % 4, split).plan(meta)
        sim = simulate_plan(truth, plan, meta)
        steps.append(MeasuredStep.from_timelines(base, [list(sim.actions)], plan, meta, sim.makespan))
    return steps


def held_out_shapes(machine):
    _, _, _, metas = machine
    return balanced(machine, 2).plan(metas[9]).shapes(metas[9])


def test_a_split_timeline_times_each_input_gradient_alone(machine):
    _, base, truth, metas = machine
    plan = balanced(machine, 2).plan(metas[0])
    assert plan.table().split_backward
    shapes = plan.shapes(metas[0])
    costs = truth.stage_costs(shapes)
    obs = timeline_observations(list(simulate_plan(truth, plan, metas[0]).actions), plan, metas[0])
    inputs = [o for o in obs if o.part is Part.INPUT_GRAD]
    assert len(inputs) == plan.num_micro_batches * plan.num_stages
    for o in inputs:
        mb = next(j for j in range(plan.num_micro_batches) if np.array_equal(shapes.take([j]).doc_lengths, o.shapes.doc_lengths))
        assert o.seconds == pytest.approx(costs.bwd_input[mb, o.stage])
    # the stage observations still sum F, I and W; stage 0's I (nothing to do: frozen encoder) is no row
    whole = [o for o in obs if o.part is Part.BOTH]
    assert sum(o.seconds for o in whole) == pytest.approx(float((costs.fwd + costs.bwd).sum()))
    design = Design.of(base, obs)
    assert design.input_grad.sum() == plan.num_micro_batches * (plan.num_stages - 1)
    assert design.stage_work_rows().sum() == len(whole)


def test_the_learner_fits_the_split_to_the_machine(machine):
    _, base, truth, metas = machine
    learner, planner = learn(machine)
    cost, report = learner.calibrator.fit()
    rest = cost.table.curves["rest"]
    np.testing.assert_allclose(rest.bwd_input / rest.bwd, TRUE_REST_SHARE, rtol=0.01)
    assert report.input_grad["head"] == pytest.approx(1.0, abs=0.02)  # its split was right
    assert set(report.input_grad) == {"rest", "head"} and cost.table.curves["projector"].bwd_input is None  # no I row on stage 0
    i_err, w_err = split_errors(machine, cost)
    assert i_err < 0.01 and w_err < 0.02
    assert min(split_errors(machine, base)) > 0.3  # the estimated split is far off
    for meta in metas[8:]:  # and the planner's zero-bubble plans are priced as the machine runs them
        plan = planner.plan(meta)
        assert plan.table().split_backward
        assert plan.predicted_s == pytest.approx(simulate_plan(truth, plan, meta).makespan, rel=0.01)


def test_skipping_the_input_gradient_fit_fails_the_accuracy_check(machine, monkeypatch):
    """The check above is sensitive to the fit: without it, the refit keeps the estimated split."""
    monkeypatch.setattr(action_fit, "_fit_input_grad", lambda *args: {})
    learner, _ = learn(machine)
    cost, report = learner.calibrator.fit()
    assert not report.input_grad and cost.table.curves["rest"].bwd_input is None
    i_err, w_err = split_errors(machine, cost)
    assert i_err > 0.1 and w_err > 0.5


def test_input_gradient_rows_leave_the_whole_backward_fit_as_it_was(machine):
    _, base, _, _ = machine
    design = Design.stack([s.design for s in measured_steps(machine, "on")])
    inputs = design.input_grad
    assert inputs.any()
    with_i, with_report = calibrate_design(base.table, design)
    without_i, without_report = calibrate_design(base.table, design.rows(~inputs))
    assert with_i.scales == without_i.scales and with_i.overhead == without_i.overhead
    assert with_i.contention == without_i.contention and with_i.variability == without_i.variability
    assert replace(with_report, input_grad={}) == without_report and with_report.input_grad
    assert all(c.bwd_input is None for c in without_i.curves.values())
    shapes = held_out_shapes(machine)
    fitted, whole = (CostModel(t, base.layout).stage_costs(shapes) for t in (with_i, without_i))
    np.testing.assert_array_equal(fitted.fwd, whole.fwd)
    np.testing.assert_array_equal(fitted.bwd, whole.bwd)
    assert not np.allclose(fitted.bwd_input, whole.bwd_input)


def test_without_split_timelines_the_refit_is_exactly_as_before(machine):
    _, base, _, _ = machine
    steps = measured_steps(machine, "off")
    assert not any(a.op is Op.BACKWARD_INPUT for s in steps for r in s.plan.table().ranks for a in r)
    assert not any(s.design.input_grad.any() for s in steps)
    cost, report = fit_steps(base, steps)
    assert report.input_grad == {}
    assert all(cost.table.curves[n] is c for n, c in base.table.curves.items())  # no split written
    shapes = held_out_shapes(machine)
    np.testing.assert_array_equal(cost.stage_costs(shapes).bwd_input, old_bwd_input(cost, shapes))


def test_a_fitted_split_round_trips_through_the_table_file(machine, tmp_path):
    model, base, _, _ = machine
    cost, _ = fit_steps(base, measured_steps(machine, "on"))
    path = cost.table.save(tmp_path / "fitted.json")
    loaded = load_latency_table(path, model=model, tp=4)
    for name, c in cost.table.curves.items():
        if c.bwd_input is None:
            assert loaded.curves[name].bwd_input is None
        else:
            np.testing.assert_array_equal(loaded.curves[name].bwd_input, c.bwd_input)
    shapes = held_out_shapes(machine)
    a, b = cost.stage_costs(shapes), CostModel(loaded, base.layout).stage_costs(shapes)
    for field in ("fwd", "bwd", "bwd_input"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_a_fitted_part_never_exceeds_its_backward(machine):
    """``I`` rows measured 1.6 times longer than the machine's ask for more than the layers' whole
    backward: capped there, and the table still loads."""
    _, base, _, _ = machine
    design = Design.stack([s.design for s in measured_steps(machine, "on")])
    slow = replace(design, y=np.where(design.input_grad, 1.6 * design.y, design.y))
    table, report = calibrate_design(base.table, slow)
    assert report.input_grad["rest"] == pytest.approx(2.0)  # 1 / INPUT_GRAD_SHARE["rest"]
    np.testing.assert_array_equal(table.curves["rest"].bwd_input, table.curves["rest"].bwd)
    table_from_dict(json.loads(json.dumps(table.to_dict())))


@pytest.mark.parametrize("encoder", ["frozen", "trained"])
def test_stage_0_input_gradient_rows_only_for_a_trained_encoders_images(tiny, encoder):
    """Stage 0's I computes a gradient only for a trained encoder's images (micro-batch 0 has 2,
    micro-batch 1 none); its row holds the projector's share and half the backward call."""
    model = tiny if encoder == "frozen" else trained(tiny)
    cost = CostModel(hand_table(model), StageLayout.even(4, 2))
    obs = [Observation(SHAPES.take([j]), 0.01, stage=0, part=Part.INPUT_GRAD) for j in (0, 1)]
    design = Design.of(cost, obs)
    if encoder == "frozen":
        assert len(design.y) == 0
        return
    assert len(design.y) == 1 and design.input_grad.all()
    row = dict(zip(action_fit.UNKNOWNS, design.X[0]))
    assert row["projector"] == pytest.approx(0.5 * 2e-3) and row["embedding"] == 0.0 and row["bwd_s"] == 0.5 and row["fwd_s"] == 0.0
    assert "projector" in INPUT_GRAD_FITTED and "embedding" not in INPUT_GRAD_FITTED
