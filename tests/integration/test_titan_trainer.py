"""TorchTitan's own trainer entry point (``torchrun -m torchtitan.train``, 2 gloo ranks; forked
from the tests' fork server but for one job under torchrun itself) running
pipetune's plans on TorchTitan's Muse Glimmer ``debugmodel_mm``: a checkpointed, resumed job equals
the uninterrupted one, and step-1 gradients equal the unsplit TorchTitan model's on the same batch."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from torchtitan_patches.testbed.learning import TestbedRecord
from torchtitan_patches.testbed.runs import Twin
from launch import torchrun as _torchrun
from small_job import job_args as _args
from titan_reference import unsplit_step
from pipetune_configs import config_registry
from torchtitan_patches.models.model_spec import planning_model_config
from pipetune.plan.plan import IterationPlan
from pipetune.serve.plan_source import load_replay
from pipetune.records import StepKind, StepRecord

pytestmark = pytest.mark.timeout(170)
WORKER = Path(__file__).with_name("titan_grad_worker.py")


def _records(dump: Path) -> list[StepRecord]:
    return StepRecord.read(dump / "pipetune" / "steps.jsonl")


def test_resumed_job_equals_uninterrupted_job(job, tmp_path):
    """A 4-step job checkpoints at steps 2 and 4; restarted as if it had died before the step-4
    checkpoint, it resumes from step 2 and must train steps 3 and 4 exactly as the first run did."""
    import shutil

    dump = tmp_path / "job"
    run = ["-m", "torchtitan.train", *_args(job, dump, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2")]
    _torchrun(run)
    first = _records(dump)
    shutil.rmtree(dump / "checkpoint" / "step-4")
    (dump / "pipetune" / "steps.jsonl").unlink()
    log = _torchrun(run)
    assert "Training starts at step 3" in log
    resumed = _records(dump)
    assert [r.step for r in first] == [1, 2, 3, 4] and [r.step for r in resumed] == [3, 4]
    for x, y in zip(first[2:], resumed):
        assert (x.batch, x.samples, x.order) == (y.batch, y.samples, y.order)
        assert x.loss == y.loss, f"step {x.step}: loss {x.loss} uninterrupted, {y.loss} resumed"
    assert len({r.loss for r in first}) == 4  # the model trains: losses move


def _unsplit_gradients(weights: dict, batch, *, trained: bool = False) -> dict:
    """Step 1 of the same TorchTitan model, unsplit, through its own forward (encoder inside), in
    this single process (no device mesh: TorchTitan's plain-tensor backend)."""
    spec = config_registry.muse_glimmer_mm().model_spec
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # buffers (rope tables); the weights come from the pipelined run
    model.load_state_dict(weights, strict=True)
    model.vision_encoder.requires_grad_(trained)
    unsplit_step(model, batch)
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout, schedule, trained", [("5,3", "1F1B", False), ("separated", "1F1B", True),
                                                       ("1,3,2,2", "Interleaved1F1B", False), ("auto", "InterleavedZeroBubble", True),
                                                       ("1,3,3,1", "DualPipeV", True)])
def test_step_one_gradients_equal_the_unsplit_model(job, tmp_path, monkeypatch, layout, schedule, trained):
    """``5,3``: an uneven co-located split with a frozen encoder (pre-computed when the planner
    finds it faster on this machine's table; pre-computation's gradients are proven for any placement
    in test_pipeline_runtime); ``separated``: DIP's layout with a trained encoder cut into chunks on both ranks
    and padded image sub-microbatches; TorchTitan's ``Interleaved1F1B``: four parts from its split,
    two per rank (chunk c on rank c mod 2), of 1, 3, 2 and 2 layers; ``InterleavedZeroBubble``: four
    chunks in the layout the search chose for them (``auto``), every backbone backward split into
    input and weight gradients, a trained encoder taking its features' gradients from chunk 0's
    input-gradient action; ``DualPipeV``: TorchTitan's V split (chunks 0 and 3 with the encoder on
    rank 0, 1 and 2 on rank 1), pipetune's split-backward tables on that placement (``ZBVZeroBubble``,
    the same placement, runs in test_titan_scale_out beside DP and TP). Every parameter's gradient
    (none of them zero) equals the unsplit model's, and no rank's action loop synchronised host and
    device (counted as on a GPU: ``runtime.host_sync``)."""
    from torchtitan.distributed import utils as dist_utils

    monkeypatch.setattr(dist_utils, "_spmd_backend", "partial_dtensor")
    extra = ["--pipetune.no-freeze_vision_encoder", "--pipetune.latency_table", str(job / "table_trained.json")] if trained else []
    extra += ["--parallelism.pipeline_parallel_schedule", schedule] + (["--training.local_batch_size", "4"] if schedule == "DualPipeV" else [])
    # no gradient clipping: the gradients compared are the step's own, before TorchTitan scales them
    _torchrun([str(WORKER), str(tmp_path)] + _args(job, tmp_path / "dump", "--training.steps", "1", "--pipetune.layout", layout,
                                                   "--training.max_norm", "1e9", "--pipetune.count_host_syncs", *extra))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    batch = ranks[0]["batch"]
    assert any(mb.num_images for mb in batch.micro_batches), "the batch should exercise the vision encoder"
    record = _records(tmp_path / "dump")[0]
    assert record.separated == (layout == "separated")
    assert record.host_syncs == [0, 0]
    plan = IterationPlan.from_json(record.plan)
    assert plan.placement.chunks_per_rank == (1 if schedule == "1F1B" else 2)
    assert plan.placement.backbone == {"1F1B": (0, 1), "ZBVZeroBubble": (0, 1, 1, 0), "DualPipeV": (0, 1, 1, 0)}.get(schedule, (0, 1, 0, 1))
    assert len(record.layout) == (2 if schedule == "1F1B" else 4) and sum(record.layout) == 8
    assert plan.table().split_backward == (schedule not in ("1F1B", "Interleaved1F1B"))
    weights = {k: v for r in ranks for k, v in r["weights"].items()}
    reference = _unsplit_gradients(weights, batch, trained=trained)
    pipelined = {k: v for r in ranks for k, v in r["grads"].items()}
    assert set(pipelined) == set(reference)
    assert any(k.startswith("vision_encoder.") for k in reference) == trained  # frozen, as PipeTune trains it, unless asked
    assert not [k for k, g in reference.items() if not g.abs().max() > 0], "a gradient is zero: the comparison would prove nothing"
    for name, g in reference.items():
        err = float((pipelined[name] - g).norm() / g.norm())
        assert err < 1e-4, f"{name}: relative gradient error {err:.2e}"


def test_bad_job_settings_are_named(tmp_path):
    from torchtitan_patches.testbed.trainer import TestbedSettings
    from torchtitan_patches.settings import CalibrationSettings, GuardSettings, PipeTuneSettings
    from torchtitan_patches.titan.dataloader import PipeTuneTitanDataLoader

    with pytest.raises(ValueError, match="'fast'"):
        PipeTuneSettings.Config(mode="fast")
    with pytest.raises(ValueError, match="pipetune.plan_ahead"):
        PipeTuneSettings.Config(plan_ahead=-1)
    with pytest.raises(ValueError, match="pipetune.mbs must be >= 1, got 0"):  # unset is None, as in PlannerConfig and `plan --mbs`
        PipeTuneSettings.Config(mbs=0)
    with pytest.raises(ValueError, match="pipetune.calibration.steps"):
        CalibrationSettings.Config(steps=-2)
    with pytest.raises(ValueError, match="pipetune.guard.probe_every"):
        GuardSettings.Config(probe_every=1)
    with pytest.raises(ValueError, match="testbed.heap_reserve_gib and testbed.tuned_twin_every"):
        TestbedSettings.Config(tuned_twin_every=-1)
    with pytest.raises(ValueError, match="separated layout's planner scores deterministic"):
        PipeTuneSettings.Config(layout="separated", jitter_draws=4)
    bad = tmp_path / "steps.jsonl"
    with pytest.raises(ValueError, match="line 2: not a pipetune step record"):
        bad.write_text(StepRecordLine + "\n" + '{"batch": 2}\n')
        load_replay(bad)
    with pytest.raises(ValueError, match="not a text file of pipetune step records"):
        bad.write_bytes(b"\xff\xfe")
        load_replay(bad)
    with pytest.raises(ValueError, match="records batch 0 twice"):
        bad.write_text(StepRecordLine + "\n" + StepRecordLine + "\n")
        load_replay(bad)
    with pytest.raises(ValueError, match="holds no step records"):
        bad.write_text("")
        load_replay(bad)
    with pytest.raises(ValueError, match="dataset_path is empty"):
        PipeTuneTitanDataLoader.Config().build(seq_len=512)
    with pytest.raises(ValueError, match="data-parallel degree 2"):
        PipeTuneTitanDataLoader.Config(dataset_path="x", gbs=1).build(seq_len=512, dp_world_size=2)


StepRecordLine = StepRecord(step=1, batch=0, mode="pipetune", mbs=1, micro_batches=1, order=[0], samples=[[0]], precomputed_encoders=0,
                            predicted_s=0.1, measured_s=0.1, plan_setup_s=0.0, loss=1.0, fallback=False, layout=[4, 4],
                            separated=False, plan="{}").to_json()


def test_torchtitans_stock_pipeline_trains_the_same_batches_to_the_same_losses(job, tmp_path):
    """The baseline of benchmarks/vs_torchtitan.py: TorchTitan's own trainer and 1F1B schedule
    (with the torch 2.13 shim) on fixed-shape rows of the same global batches (``pad_steps``, 8
    rows of one sample at most) computes pipetune's losses from the same initial weights. Both log
    the same work the same way (``titan.metrics``): the same model FLOPs and real tokens per step,
    TorchTitan's throughput and MFU over them, padding only in the stock rows."""
    import json

    stock = tmp_path / "stock"
    stock_log = _torchrun(["-m", "torchtitan.train", "--module", "pipetune_configs", "--config", "muse_glimmer_mm_stock", "--dump_folder", str(stock),
               "--hf_assets_path", str(job / "fixture" / "tokenizer"), "--dataloader.dataset_path", str(job / "data"), "--dataloader.gbs", "8", "--training.seq_len", "512", "--debug.seed", "0",
               "--training.steps", "2", "--dataloader.pad_steps", "--dataloader.rows_per_step", "8", "--training.local_batch_size", "8"],
              timeout=100)
    log = _torchrun(["-m", "torchtitan.train", *_args(job, tmp_path / "pipetune", "--training.steps", "2")], timeout=100)
    theirs = [json.loads(line) for line in (stock / "stock" / "steps.jsonl").read_text().splitlines()]
    ours = sorted(StepRecord.read(tmp_path / "pipetune" / "pipetune" / "steps.jsonl"), key=lambda r: r.step)
    assert len(theirs) == len(ours) == 2
    assert theirs[0]["loss"] == pytest.approx(ours[0].loss, rel=1e-5)
    assert theirs[1]["loss"] == pytest.approx(ours[1].loss, rel=1e-4)
    for t, o in zip(theirs, ours):
        assert t["real_tokens"] == o.real_tokens > 0 and t["model_flops"] == pytest.approx(o.model_flops, rel=1e-12)
        assert o.padding_tokens == 0 and t["padding_tokens"] == 8 * 512 - t["real_tokens"]
    for text in (stock_log, log):
        assert text.count("tflops: ") >= 2 and "mfu: N/A" not in text


def test_a_non_finite_loss_stops_the_job_before_the_optimizer_step(job, tmp_path):
    """TorchTitan's own check: a learning rate of 1e30 makes step 2's loss non-finite, and every
    rank stops there with TorchTitan's message instead of training on."""
    out = _torchrun(["-m", "torchtitan.train", *_args(job, tmp_path / "dump", "--training.steps", "4", "--optimizer.param-groups.0.optimizer-kwargs.lr", "1e30",
                                                      "--lr_scheduler.warmup_steps", "0")], timeout=100, check=False,
                    real=True)  # torchrun itself: the launch path a user takes (the other jobs' ranks are forked)
    assert "Loss is not finite" in out and "at step 2" in out
    assert len(StepRecord.read(tmp_path / "dump" / "pipetune" / "steps.jsonl")) == 2


def test_the_guard_falls_back_while_tuned_plans_are_slowed_and_returns(job, tmp_path):
    """Steps of 4 samples; tuned plans sleep 150 ms per stage forward during batches 8-17 (about
    doubling their time); the baseline (best fixed configuration) runs at full speed. The guard
    must fall back within a bounded number of steps (two windows of tuned steps, a probe among
    them), run only baseline plans while it is back, and return to pipetune's plans after the
    slow-down."""
    dump = tmp_path / "slowed"
    window, slow = 4, range(8, 18)
    _torchrun(["-m", "torchtitan.train", *_args(
        job, dump, "--training.steps", "56", "--pipetune.calibration.steps", "4", "--pipetune.guard.probe_every", "4",
        "--pipetune.guard.window", str(window), "--slow_from", str(slow.start), "--slow_to", str(slow.stop), "--slow_s", "0.15", "--dataloader.gbs", "4",
        module="titan_slowed_job", config="slowed_muse_glimmer_mm")], timeout=210)
    recs = _records(dump)
    calibration = [r for r in recs if r.kind is StepKind.CALIBRATION]
    assert [r.batch for r in calibration] == [0, 1, 2, 3] and [r.mbs for r in calibration] == [1, 2, 3, 4]
    states = {r.batch: r.guard for r in recs}
    fell = [b for b, s in states.items() if s == "fallback"]
    assert fell, "the guard never fell back although pipetune's plans were slowed"
    assert slow.start <= fell[0] <= slow.start + 2 * window + 2, f"fell back at batch {fell[0]}"
    for r in recs:  # a step that starts in fallback runs the baseline plan
        if states.get(r.batch - 1) == "fallback":
            assert r.kind is StepKind.BASELINE and r.mode != "pipetune"
    # back to pipetune's plans after the slow-down: a retry alternates baseline and tuned steps (8 steps for a window of
    # 4); 56 steps leave room for one false alarm on the first retry (its backoff doubles to 16)
    assert any(b > slow.stop and states[b] == "tuned" for b in states), states
    retry = [r.kind for r in recs if states.get(r.batch - 1) == "retry"]
    assert retry[:2] == [StepKind.BASELINE, StepKind.TUNED], retry
    assert not any(r.kind is StepKind.TUNED and r.mode != "pipetune" for r in recs)


def test_a_replayed_job_runs_the_recorded_plans_with_the_same_losses(job, tmp_path):
    """``--pipetune.replay.path`` runs an earlier job's recorded plans; on the same data and
    weights the losses are the same, bit for bit."""
    steps = "3"
    tuned = tmp_path / "tuned"
    _torchrun(["-m", "torchtitan.train", *_args(job, tuned, "--training.steps", steps, "--pipetune.max_mbs", "2")])
    _torchrun(["-m", "torchtitan.train", *_args(job, tmp_path / "replayed", "--training.steps", steps, "--pipetune.replay.path",
                                                 str(tuned / "pipetune" / "steps.jsonl"), "--pipetune.mode", "original")])
    a, b = _records(tuned), _records(tmp_path / "replayed")
    assert [r.kind for r in b] == [StepKind.REPLAY] * 3
    for x, y in zip(a, b):
        assert (x.samples, x.order, x.mode, x.loss) == (y.samples, y.order, y.mode, y.loss)


def test_testbed_job_runs_twins_beside_its_steps_and_replays_side_by_side(job, tmp_path):
    """The CPU testbed (``TestbedTrainer``): with two sizes to calibrate, every calibration step of
    several micro-batches also runs its plan serially (same micro-batches, order and loss, bit for
    bit), those at mbs 1 also the batch at mbs 2 serially (same samples, loss up to packing's
    rounding), and with ``tuned_twin_every 2`` every second later step whose plan is pipetune's
    runs serially too; twins are ``extra_run`` records, so replaying the job runs its own plans
    only, and feeding its records to the testbed's learner (as the benchmarks re-analyse a job)
    learns exactly what the job recorded. Replayed side by side with another job's records, every step runs both jobs' plans of its
    batch, and each run's loss on batch 0 equals the recorded one (same weights). Which runs a step
    schedules and in which order is tested as pure rules in ``test_testbed_runs``; messages under
    ``strict_order``, as NCCL orders them."""
    dump = tmp_path / "testbed"
    testbed = dict(module="configs", config="muse_glimmer_mm_testbed")
    _torchrun(["-m", "torchtitan.train", *_args(job, dump, "--training.steps", "6", "--pipetune.calibration.steps", "3",
                                                 "--pipetune.calibration.online_window", "4", "--pipetune.max_mbs", "2",
                                                 "--testbed.tuned_twin_every", "2", "--testbed.heap_reserve_gib", "0", **testbed)])
    recs = TestbedRecord.read(dump / "pipetune" / "steps.jsonl")
    runs = {b: [r for r in recs if r.batch == b] for b in range(6)}
    for b, rs in runs.items():
        own = [r for r in rs if not r.extra_run]
        assert len(own) == 1 and own[0].twin is None
        for twin in (r for r in rs if r.twin is not None):
            assert twin.extra_run
            if twin.twin is Twin.SIZE:
                assert b in (0, 2) and (twin.mbs, own[0].mbs) == (2, 1) and twin.kind is StepKind.CALIBRATION
                assert sorted(i for mb in twin.samples for i in mb) == sorted(i for mb in own[0].samples for i in mb)
                assert twin.loss == pytest.approx(own[0].loss, rel=1e-4)
            else:
                assert (twin.samples, twin.order, twin.loss, twin.cold) == (own[0].samples, own[0].order, own[0].loss, own[0].cold)
                assert twin.kind is (StepKind.CALIBRATION if b < 3 else StepKind.TUNED)
    assert {r.twin for r in recs} == {None, Twin.SERIAL, Twin.SIZE, Twin.TUNED}
    at = {id(r): k for k, r in enumerate(recs)}
    for b, rs in runs.items():  # kappa is measured once a plan's pipelined and serial runs are both in: the later one carries it
        own, serial = next(r for r in rs if not r.extra_run), [r for r in rs if r.twin is Twin.SERIAL]
        if serial and not own.cold and not serial[0].cold:
            assert max(own, serial[0], key=lambda r: at[id(r)]).contention is not None, f"batch {b}: no contention measured"
    assert any(r.contention is not None for r in recs if r.twin is Twin.SERIAL)
    replayed = load_replay(dump / "pipetune" / "steps.jsonl")
    assert all(replayed[b] == [next(r.plan for r in rs if not r.extra_run)] for b, rs in runs.items())
    _replaying_the_records_learns_what_the_job_learnt(job, recs, window=4)

    other = tmp_path / "original"
    _torchrun(["-m", "torchtitan.train", *_args(job, other, "--training.steps", "2", "--pipetune.mode", "original")])
    both = tmp_path / "both"
    files = [tmp_path / "testbed_first_2.jsonl", other / "pipetune" / "steps.jsonl"]  # both record batches 0 and 1
    for r in recs:
        if r.batch < 2:
            r.append_to(files[0])
    _torchrun(["-m", "torchtitan.train", *_args(job, both, "--training.steps", "2", "--pipetune.replay.path", str(files[0]),
                                                 "--testbed.side_by_side", str(files[1]), "--testbed.heap_reserve_gib", "0", **testbed)])
    recorded = [{r.batch: r for r in StepRecord.read(f) if not r.extra_run} for f in files]
    sbs = TestbedRecord.read(both / "pipetune" / "steps.jsonl")
    assert [(r.batch, r.replay_of) for r in sbs] == [(0, 0), (0, 1), (1, 1), (1, 0)]
    for r in sbs:
        x = recorded[r.replay_of][r.batch]
        assert (r.samples, r.order, r.mode, r.kind) == (x.samples, x.order, x.mode, StepKind.REPLAY)
        if r.batch == 0:
            assert r.loss == x.loss


def _replaying_the_records_learns_what_the_job_learnt(job: Path, recs: list[TestbedRecord], *, window: int) -> None:
    """The benchmarks re-analyse a job by feeding its records to ``PairLearner``, the learner its
    trainer ran: every contention and per-call overhead the job recorded comes out again."""
    from torchtitan_patches.testbed.learning import PairLearner
    from pipetune.calibrate.pairs import PairCalibrator
    from pipetune.cost import CostModel, StageLayout, load_latency_table
    from pipetune.data import Overlong
    from pipetune.packing import PackingConfig
    from pipetune.plan.data_parallel.replicas import ReplicaPlans
    from torchtitan_patches.data import DataLoaderConfig

    config = config_registry.muse_glimmer_mm()
    model = planning_model_config(config.model_spec, image_grid=config.pipetune.image_grid)
    loader = DataLoaderConfig(data=str(job / "data"), gbs=8, max_seq_len=512, seed=0, overlong=Overlong.TRUNCATE,
                              packing=PackingConfig(max_seq_len=512)).build(model)
    profiled = CostModel(load_latency_table(job / "table.json", model=model, tp=1), StageLayout.from_sizes(recs[0].layout))
    learner = PairLearner(profiled, calibrator=PairCalibrator(profiled.table, profiled.layout, window))
    for r in recs:
        again = replace(r, contention=None, call_overhead_s=None)
        learner.observe([again], ReplicaPlans(r.batch, (IterationPlan.from_json(r.plan),)), loader.meta(r.batch))
        assert (again.contention, again.call_overhead_s) == (r.contention, r.call_overhead_s), (r.step, r.batch, r.twin)
    assert any(r.contention is not None for r in recs) and any(r.call_overhead_s is not None for r in recs if r.extra_run)
