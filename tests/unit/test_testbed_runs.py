"""The CPU testbed's rules for which runs a step executes, as pure functions (no job needed), and
the property the serial twins rely on: a plan's serial schedule never has two ranks computing at
once, while the same plan pipelined does."""

import numpy as np
import pytest

from torchtitan_patches.testbed.runs import Twin, first_run, has_size_twin, rotated, twin_of
from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.calibrate.online import simulate_plan
from pipetune.data import BatchStream, batch_meta, make_mix
from pipetune.plan import Mode
from pipetune.plan.layout.planner_config import PlannerConfig
from pipetune.simulate.contention import concurrent_time
from image_sizing import square_images


@pytest.fixture(scope="module")
def plans():
    model = load_model_config("7b")
    cost = CostModel(analytical_table(model, load_hardware("a100"), tp=4), StageLayout.even(32, 2))
    data = make_mix("datamix2", 2000, 0)
    meta = batch_meta(data, BatchStream(num_rows=len(data), gbs=16), 0, images=square_images(576), max_seq_len=4096)
    make = {mode: PlannerConfig(mode=mode, max_seq_len=4096, memory_bytes=80e9, max_mbs=2).build(model, cost) for mode in Mode}
    small = batch_meta(data, BatchStream(num_rows=len(data), gbs=2), 0, images=square_images(576), max_seq_len=4096)
    one = PlannerConfig(mode=Mode.ORIGINAL, max_seq_len=4096, memory_bytes=80e9, mbs=4, max_mbs=4).build(model, cost).plan(small)
    return cost, meta, {mode: p.plan(meta) for mode, p in make.items()}, one


def rules(step, plan, **kw):
    return twin_of(step, plan, **{"calibrate_steps": 4, "serial_twins": True, "tuned_twin_every": 2, "replaying": False, **kw})


def test_which_steps_run_a_serial_twin(plans):
    _, _, by_mode, _ = plans
    tuned, balanced = by_mode[Mode.PIPETUNE], by_mode[Mode.BALANCED]
    assert tuned.has_serial_twin and balanced.has_serial_twin
    assert [rules(s, balanced) for s in range(4)] == [Twin.SERIAL] * 4
    assert [rules(s, balanced, serial_twins=False) for s in range(4)] == [None] * 4
    assert [rules(s, tuned) for s in range(4, 9)] == [Twin.TUNED, None, Twin.TUNED, None, Twin.TUNED]
    assert [rules(s, balanced) for s in range(4, 9)] == [None] * 5  # the guard's baseline plans are not pipetune's
    assert [rules(s, tuned, tuned_twin_every=0) for s in range(4, 9)] == [None] * 5
    assert rules(0, balanced, replaying=True) is None and rules(4, tuned, replaying=True) is None


def test_a_plan_of_one_micro_batch_has_no_twin(plans):
    _, _, _, one = plans
    assert one.num_micro_batches == 1 and not one.has_serial_twin and rules(0, one) is None


def test_size_twins_fall_on_the_smallest_size_of_each_calibration_cycle():
    assert [s for s in range(10) if has_size_twin(s, calibrate_steps=8, sizes=4)] == [0, 4]
    assert not any(has_size_twin(s, calibrate_steps=8, sizes=1) for s in range(8))


def test_the_first_run_alternates_from_twin_to_twin():
    """Tuned twins fall on every Nth step; keyed on the step, N = 2 would put the same run first
    on every twin. Keyed on the twin's count, each run goes first on every other twin."""
    twinned = [s for s in range(4, 20) if (s - 4) % 2 == 0]
    firsts = [rotated(["pipelined", "serial"], first_run(s, calibrate_steps=4, tuned_twin_every=2, replaying=False))[0]
              for s in twinned]
    assert firsts == ["pipelined", "serial"] * (len(twinned) // 2)
    assert [first_run(s, calibrate_steps=4, tuned_twin_every=2, replaying=True) for s in (5, 6)] == [5, 6]
    assert [rotated([0, 1, 2], k) for k in (0, 1, 5)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]


def test_a_serial_twin_never_computes_on_two_ranks_at_once(plans):
    cost, meta, by_mode, _ = plans
    for plan in by_mode.values():
        if not plan.has_serial_twin:
            continue
        for p, shared in ((plan, True), (plan.serialised(), False)):
            actions = simulate_plan(cost, p, meta).actions
            overlapped = concurrent_time(np.array([[a.start] for a in actions]), np.array([[a.end] for a in actions]))[0]
            assert (overlapped > 0) == shared, (p.schedule, overlapped)


def test_files_replayed_side_by_side_must_record_the_same_batches(tmp_path):
    from torchtitan_patches.testbed.trainer import load_side_by_side
    from pipetune.records import StepRecord

    def write(name, batches):
        path = tmp_path / name
        for b in batches:
            StepRecord(step=b + 1, batch=b, mode="pipetune", mbs=1, micro_batches=1, order=[0], samples=[[0]], precomputed_encoders=0,
                       predicted_s=0.1, measured_s=0.1, plan_setup_s=0.0, loss=1.0, fallback=False, layout=[4, 4], separated=False,
                       plan=f"plan {b}").append_to(path)
        return str(path)

    first, same, short = write("a.jsonl", [0, 1]), write("b.jsonl", [0, 1]), write("c.jsonl", [0])
    assert load_side_by_side(first, [same]) == [{0: ["plan 0"], 1: ["plan 1"]}] and load_side_by_side(first, []) == []
    with pytest.raises(ValueError, match=r"c.jsonl records batches 0..0 \(1\) but .*a.jsonl records 0..1 \(2\)"):
        load_side_by_side(first, [same, short])
