"""The measured guard and the per-mbs correction, on synthetic measurements with known truth."""

import math

import numpy as np
import pytest

from pipetune.calibrate.correction import FamilyCorrection
from pipetune.serve.guard import Guard, GuardConfig, GuardState, PlanKind
from pipetune.data.images import ImageSizing


def run(guard: Guard, steps: int | range, *, seed: int, slow: range = range(0), slowdown: float = 1.5, noise: float = 0.06,
        advantage: float = 0.10, drift: float = 1.0, drift_from: int | None = None) -> list[tuple[PlanKind, GuardState]]:
    """A trainer loop: per step the baseline plan's predicted time varies by batch, the model
    predicts pipetune's plan ``advantage`` faster and is right, measurements carry lognormal noise;
    during ``slow`` every tuned plan takes ``slowdown`` times longer than predicted. The machine
    slows by ``drift`` (every plan) from step ``drift_from`` on, or, if that is None, from the first
    retry after ``slow`` (the worst moment for a retry judged against the fallback's steps). Step
    ``t``'s numbers depend only on ``(seed, t)``, so a run can be continued from any step."""
    out = []
    for t in range(steps) if isinstance(steps, int) else steps:
        rng = np.random.default_rng((seed, t))
        base_pred = rng.uniform(0.8, 1.2)
        tuned_pred = base_pred * (1 - advantage)
        if drift_from is None and t >= slow.stop and guard.state is GuardState.RETRY:
            drift_from = t
        kind = guard.choose()
        truth = tuned_pred * (slowdown if t in slow else 1.0) if kind is PlanKind.TUNED else base_pred
        truth *= drift if drift_from is not None and t >= drift_from else 1.0
        measured = truth * math.exp(rng.normal(0, noise))
        d = guard.observe(kind, measured, tuned_pred if kind is PlanKind.TUNED else base_pred, base_pred)
        out.append((kind, d.state))
    return out


def test_a_real_advantage_is_kept_under_noise():
    for seed in range(20):
        states = [s for _, s in run(Guard(), 200, seed=seed)]
        assert GuardState.FALLBACK not in states, f"seed {seed}: fell back although pipetune was 10 % faster"


def test_without_the_noise_allowance_the_same_runs_do_fall_back():
    """Negative control: the z-bound is what keeps the guard quiet (a tied plan, no allowance)."""
    fell = sum(GuardState.FALLBACK in [s for _, s in run(Guard(GuardConfig(z=0.0)), 200, seed=seed, advantage=0.0)]
               for seed in range(20))
    assert fell >= 15


def test_a_slow_down_makes_it_fall_back_within_a_bounded_number_of_steps_and_return_after():
    cfg = GuardConfig()
    for seed in range(10):
        trace = run(Guard(cfg), 400, seed=seed, slow=range(60, 120))
        states = [s for _, s in trace]
        first = next(t for t, s in enumerate(states) if s is GuardState.FALLBACK)
        assert 60 <= first <= 60 + cfg.window + 2, f"seed {seed}: fell back at step {first}"
        # while slowed, retries fail and the backoff doubles; once the slow-down stops, a retry succeeds
        back = next(t for t in range(120, 400) if states[t] is GuardState.TUNED)
        assert back <= 120 + cfg.max_backoff + cfg.window + 2
        assert GuardState.FALLBACK not in states[back:], f"seed {seed}: fell back again after the slow-down ended"
        # a step that starts in fallback runs the baseline plan
        assert all(trace[t][0] is PlanKind.BASELINE for t in range(1, len(trace)) if states[t - 1] is GuardState.FALLBACK)


def test_a_retry_is_not_fooled_by_a_machine_that_slowed_since_the_fallback():
    """Pipetune 5 % faster, then slowed until step 120; the whole machine runs 15 % slower from the
    first retry after that on. The retry interleaves baseline steps, so it measures both kinds on
    the slower machine and returns; it never falls back again."""
    for seed in range(20):
        trace = run(Guard(), 400, seed=seed, slow=range(60, 120), advantage=0.05, noise=0.03, drift=1.15)
        states = [s for _, s in trace]
        retry = next(t for t in range(120, 400) if states[t - 1] is GuardState.RETRY)
        assert GuardState.FALLBACK not in states[retry:], f"seed {seed}: a retry fell back on the machine's drift"
        assert GuardState.TUNED in states[retry:]
        kinds = [k for (k, _), s in zip(trace[retry:], states[retry - 1:]) if s is GuardState.RETRY]
        assert kinds[:4] == [PlanKind.BASELINE, PlanKind.TUNED] * 2


def test_a_drift_between_probes_larger_than_the_advantage_can_cause_a_fallback():
    """The limit the retry's interleaving exists for (module doc): while tuned, the baseline is
    judged by probes from before the drift, and a 15 % drift looks like a plan 10 % slower."""
    fell = sum(GuardState.FALLBACK in [s for _, s in run(Guard(), 120, seed=seed, advantage=0.05,
                                                          noise=0.03, drift=1.15, drift_from=60)] for seed in range(20))
    assert fell >= 15


def test_probes_run_the_baseline_every_probe_every_steps_while_tuned():
    trace = run(Guard(GuardConfig(probe_every=5)), 50, seed=0)
    assert [t for t, (k, _) in enumerate(trace) if k is PlanKind.BASELINE] == list(range(4, 50, 5))


def test_a_restored_guard_decides_as_the_uninterrupted_one():
    whole = run(Guard(), 150, seed=3, slow=range(30, 80))
    first = Guard()
    head = run(first, 70, seed=3, slow=range(30, 80))
    resumed = Guard()
    resumed.load_state_dict(first.state_dict())
    assert head + run(resumed, range(70, 150), seed=3, slow=range(30, 80)) == whole
    assert {s for _, s in whole} == set(GuardState)  # the stretch covers every state


@pytest.mark.parametrize("kwargs", [{"window": 4, "min_steps": 5}, {"z": -1.0}, {"probe_every": 1}, {"backoff": 10, "max_backoff": 5}])
def test_bad_guard_settings_are_named(kwargs):
    with pytest.raises(ValueError, match="guard"):
        GuardConfig(**kwargs)


def test_the_correction_singles_out_a_size_measured_slower_than_the_rest():
    c = FamilyCorrection(prior=4.0)
    rng = np.random.default_rng(0)
    for _ in range(8):
        for mbs, bias in ((1, 1.3), (2, 1.0), (3, 1.0)):  # every plan 0-30 % over its prediction
            c.observe(mbs, bias * math.exp(rng.normal(0, 0.01)), 1.0)
    f = c.factors()
    shrink = 8 / (8 + 4.0)  # eight observations per size against a prior of four
    pooled = math.log(1.3) / 3
    assert f[1] == pytest.approx(math.exp(shrink * (math.log(1.3) - pooled)), rel=0.02)
    assert f[2] == pytest.approx(math.exp(-shrink * pooled), rel=0.02) and f[3] == pytest.approx(f[2], rel=0.02)
    # a bias common to every size changes no factor
    d = FamilyCorrection()
    for mbs in (1, 2, 3):
        d.observe(mbs, 2.0, 1.0)
    assert d.factors() == pytest.approx({1: 1.0, 2: 1.0, 3: 1.0})
    e = FamilyCorrection()
    e.load_state_dict(c.state_dict())
    assert e.factors() == f


def test_the_planner_compares_sizes_through_the_correction(tiny, datamix2_dir):
    from pipetune.cost import CostModel, StageLayout, analytical_table
    from pipetune.config import load_hardware
    from pipetune.data.batch import batch_meta
    from pipetune.data.storage import open_dataset
    from pipetune.data.stream import BatchStream
    from pipetune.plan import Mode
    from pipetune.plan.layout.planner_config import PlannerConfig

    data = open_dataset(datamix2_dir).table
    cost = CostModel(analytical_table(tiny, load_hardware("h100"), tp=1), StageLayout.even(tiny.backbone.n_layers, 2))
    planner = PlannerConfig(mode=Mode.PIPETUNE, max_seq_len=512, memory_bytes=16 * 2**30, max_mbs=4).build(tiny, cost)
    meta = batch_meta(data, BatchStream(num_rows=len(data), gbs=32, seed=0), 0, images=ImageSizing.for_model(tiny), max_seq_len=512)
    plain = planner.plan(meta)
    planner.set_correction({plain.mbs: 100.0})
    penalised = planner.plan(meta)
    assert penalised.mbs != plain.mbs
    planner.set_correction({})
    again = planner.plan(meta)
    assert (again.mbs, again.micro_batches, again.order, again.ranks) == (plain.mbs, plain.micro_batches, plain.order, plain.ranks)
