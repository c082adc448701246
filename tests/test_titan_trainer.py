"""TorchTitan's own trainer entry point (``torchrun -m torchtitan.train``, 2 gloo ranks) running
pipetune's plans on TorchTitan's Muse Glimmer ``debugmodel_mm``: a checkpointed, resumed job equals
the uninterrupted one, and step-1 gradients equal the unsplit TorchTitan model's on the same batch."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipetune.data import make_mix, write_dataset
from pipetune.data.mixes import parse_mix
from titan_reference import unsplit_step
from configs import config_registry
from torchtitan_patches.titan.model_spec import planning_model_config
from pipetune.plan.plan_source import load_replay

pytestmark = pytest.mark.timeout(170)
ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("titan_grad_worker.py")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A small generated data set and a coarse latency table of the job's planning shapes."""
    from profiling.profile_layers import ProfileConfig, run_profile

    d = tmp_path_factory.mktemp("titan_job")
    write_dataset(make_mix(parse_mix("datamix2"), 300, 0), d / "data", {"mix": "datamix2"})
    config = config_registry.pipetune_muse_glimmer_mm()
    for frozen, name in ((True, "table.json"), (False, "table_trained.json")):  # a trained ViT's table also times its backward
        model = planning_model_config(config.model_spec, image_grid=config.pipetune.image_grid, encoder_frozen=frozen)
        run_profile(model, ProfileConfig(max_seq_len=512, max_tokens=2048, max_images=8, points=3, repeats=1, warmup=1, p2p=False),
                    d / name, progress=False)
    return d


def _args(job: Path, dump: Path, *extra: str, module: str = "torchtitan_patches.titan", config: str = "pipetune_muse_glimmer_mm") -> list[str]:
    return ["--module", module, "--config", config, "--dump_folder", str(dump),
            "--dataloader.dataset_path", str(job / "data"), "--pipetune.latency_table", str(job / "table.json"),
            "--dataloader.gbs", "8", "--training.seq_len", "512", "--pipetune.online_window", "0", "--pipetune.budget_s", "60",
            "--pipetune.strict_order", "--debug.seed", "0", *extra]


def _torchrun(target: list[str], timeout: float = 100) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port), *target]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return res.stdout + res.stderr


def _records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "pipetune" / "steps.jsonl").read_text().splitlines()]


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
    assert [r["step"] for r in first] == [1, 2, 3, 4] and [r["step"] for r in resumed] == [3, 4]
    for x, y in zip(first[2:], resumed):
        assert x["batch"] == y["batch"] and x["samples"] == y["samples"] and x["order"] == y["order"]
        assert x["loss"] == y["loss"], f"step {x['step']}: loss {x['loss']} uninterrupted, {y['loss']} resumed"
    assert len({r["loss"] for r in first}) == 4  # the model trains: losses move


def _unsplit_gradients(weights: dict, batch, *, trained: bool = False) -> dict:
    """Step 1 of the same TorchTitan model, unsplit, through its own forward (encoder inside), in
    this single process (no device mesh: TorchTitan's plain-tensor backend)."""
    spec = config_registry.pipetune_muse_glimmer_mm().model_spec
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # buffers (rope tables); the weights come from the pipelined run
    model.load_state_dict(weights, strict=True)
    model.vision_encoder.requires_grad_(trained)
    unsplit_step(model, batch)
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout", ["5,3", "separated"])
def test_step_one_gradients_equal_the_unsplit_model(job, tmp_path, monkeypatch, layout):
    """``5,3``: an uneven co-located split with a frozen encoder (pre-computed when the planner
    finds it faster on this machine's table; pre-computation's gradients are proven for any placement
    in test_pipeline_runtime); ``separated``: DIP's layout with a trained encoder cut into chunks on both ranks
    and padded image sub-microbatches. Every parameter's gradient (none of them zero) equals the
    unsplit model's."""
    from torchtitan.distributed import utils as dist_utils

    monkeypatch.setattr(dist_utils, "_spmd_backend", "partial_dtensor")
    trained = layout == "separated"
    extra = ["--pipetune.no-freeze_vision_encoder", "--pipetune.latency_table", str(job / "table_trained.json")] if trained else []
    # no gradient clipping: the gradients compared are the step's own, before TorchTitan scales them
    _torchrun([str(WORKER), str(tmp_path)] + _args(job, tmp_path / "dump", "--training.steps", "1", "--pipetune.layout", layout,
                                                   "--training.max_norm", "1e9", *extra))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    batch = ranks[0]["batch"]
    assert any(mb.num_images for mb in batch.micro_batches), "the batch should exercise the vision encoder"
    record = _records(tmp_path / "dump")[0]
    assert record["separated"] == trained
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
    from torchtitan_patches.titan.dataloader import PipeTuneTitanDataLoader
    from pipetune.plan.plan_source import load_replay, load_replays
    from torchtitan_patches.trainer import PipeTuneSettings

    with pytest.raises(ValueError, match="'fast'"):
        PipeTuneSettings.Config(mode="fast")
    with pytest.raises(ValueError, match="pipetune.plan_ahead"):
        PipeTuneSettings.Config(plan_ahead=-1)
    with pytest.raises(ValueError, match="pipetune.calibrate_steps"):
        PipeTuneSettings.Config(calibrate_steps=-2)
    with pytest.raises(ValueError, match="pipetune.tuned_twin_every"):
        PipeTuneSettings.Config(tuned_twin_every=-1)
    with pytest.raises(ValueError, match="pipetune.guard_probe_every"):
        PipeTuneSettings.Config(guard_probe_every=1)
    with pytest.raises(ValueError, match="pipetune.cpu_heap_reserve_gib"):
        PipeTuneSettings.Config(cpu_heap_reserve_gib=-1)
    with pytest.raises(ValueError, match="separated layout's planner scores deterministic"):
        PipeTuneSettings.Config(layout="separated", jitter_draws=4)
    with pytest.raises(ValueError, match="line 2: not a pipetune step record"):
        bad = tmp_path / "steps.jsonl"
        bad.write_text('{"batch": 1, "plan": "{}"}\n{"batch": 2}\n')
        load_replay(bad)
    with pytest.raises(ValueError, match="not a text file of pipetune step records"):
        bad.write_bytes(b"\xff\xfe")
        load_replay(bad)
    short, long = tmp_path / "short.jsonl", tmp_path / "long.jsonl"
    short.write_text('{"batch": 0, "plan": "{}"}\n')
    long.write_text('{"batch": 0, "plan": "{}"}\n{"batch": 1, "plan": "{}"}\n')
    with pytest.raises(ValueError, match=r"long.jsonl records batches 0..1 \(2\) but .*short.jsonl records 0..0 \(1\)"):
        load_replays([str(short), str(long)])
    with pytest.raises(ValueError, match="holds no step records"):
        bad.write_text("")
        load_replay(bad)
    with pytest.raises(ValueError, match="dataset_path is empty"):
        PipeTuneTitanDataLoader.Config().build(seq_len=512)
    with pytest.raises(ValueError, match="data-parallel degree 2"):
        PipeTuneTitanDataLoader.Config(dataset_path="x").build(seq_len=512, dp_world_size=2)


def test_the_guard_falls_back_while_tuned_plans_are_slowed_and_returns(job, tmp_path):
    """Tuned plans sleep 150 ms per stage forward during batches 8-17 (about doubling their time);
    the baseline (best fixed configuration) runs at full speed. The guard must fall back within a
    bounded number of steps (two windows of tuned steps, a probe among them), run only baseline
    plans while it is back, and return to pipetune's plans after the slow-down."""
    dump = tmp_path / "slowed"
    window, slow = 4, range(8, 18)
    _torchrun(["-m", "torchtitan.train", *_args(
        job, dump, "--training.steps", "56", "--pipetune.calibrate_steps", "4", "--pipetune.guard_probe_every", "4",
        "--pipetune.guard_window", str(window), "--slow_from", str(slow.start), "--slow_to", str(slow.stop), "--slow_s", "0.15",
        module="titan_slowed_job", config="slowed_muse_glimmer_mm")], timeout=210)
    recs = [r for r in _records(dump) if not r.get("serial")]
    calibration = [r for r in recs if r["kind"] == "calibration"]
    assert [r["batch"] for r in calibration] == [0, 1, 2, 3] and [r["mbs"] for r in calibration] == [1, 2, 3, 4]
    states = {r["batch"]: r.get("guard") for r in recs}
    fell = [b for b, s in states.items() if s == "fallback"]
    assert fell, "the guard never fell back although pipetune's plans were slowed"
    assert slow.start <= fell[0] <= slow.start + 2 * window + 2, f"fell back at batch {fell[0]}"
    for r in recs:  # a step that starts in fallback runs the baseline plan
        if states.get(r["batch"] - 1) == "fallback":
            assert r["kind"] == "baseline" and r["mode"] != "pipetune"
    # back to pipetune's plans after the slow-down: a retry alternates baseline and tuned steps (8 steps for a window of
    # 4); 56 steps leave room for one false alarm on the first retry (its backoff doubles to 16)
    assert any(b > slow.stop and states[b] == "tuned" for b in states), states
    retry = [r["kind"] for r in recs if states.get(r["batch"] - 1) == "retry"]
    assert retry[:2] == ["baseline", "tuned"], retry
    assert not any(r["kind"] == "tuned" and r["mode"] != "pipetune" for r in recs)


def test_a_replayed_job_runs_the_recorded_plans_with_the_same_losses(job, tmp_path):
    """``--pipetune.replay`` runs an earlier job's recorded plans (how benchmarks time one plan
    several times); on the same data and weights the losses are the same, bit for bit. Given two
    jobs' records, every step runs both jobs' plans of its batch, the first of them alternating:
    step 0's runs reproduce each job's loss bit for bit (the same initial weights, no update
    between the runs), and later steps, trained on the last run's gradients, stay within float
    rounding of both jobs' losses (every plan of a batch gives the same gradients)."""
    steps = "3"
    tuned, original = tmp_path / "tuned", tmp_path / "original"
    _torchrun(["-m", "torchtitan.train", *_args(job, tuned, "--training.steps", steps, "--pipetune.max_mbs", "2")])
    _torchrun(["-m", "torchtitan.train", *_args(job, original, "--training.steps", steps, "--pipetune.mode", "original")])
    files = [d / "pipetune" / "steps.jsonl" for d in (tuned, original)]
    _torchrun(["-m", "torchtitan.train", *_args(job, tmp_path / "replayed", "--training.steps", steps, "--pipetune.replay",
                                                 str(files[0]), "--pipetune.mode", "original")])
    a, b = _records(tuned), _records(tmp_path / "replayed")
    assert [r["kind"] for r in b] == ["replay"] * 3
    for x, y in zip(a, b):
        assert (x["samples"], x["order"], x["mode"], x["loss"]) == (y["samples"], y["order"], y["mode"], y["loss"])

    _torchrun(["-m", "torchtitan.train", *_args(job, tmp_path / "both", "--training.steps", steps, "--pipetune.replay",
                                                 ",".join(map(str, files)))])
    recorded = [{r["batch"]: r for r in _records(d)} for d in (tuned, original)]
    assert any(recorded[0][k]["samples"] != recorded[1][k]["samples"] for k in recorded[0]), "the two jobs ran the same plans"
    runs = _records(tmp_path / "both")
    assert [(r["batch"], r["replay_of"]) for r in runs] == [(0, 0), (0, 1), (1, 1), (1, 0), (2, 0), (2, 1)]
    for r in runs:
        x = recorded[r["replay_of"]][r["batch"]]
        assert (r["samples"], r["order"], r["mode"], r["kind"]) == (x["samples"], x["order"], x["mode"], "replay")
        if r["batch"] == 0:
            assert r["loss"] == x["loss"]
        assert r["loss"] == pytest.approx(x["loss"], rel=1e-4)


def _overlap_s(rec: dict) -> float:
    """Seconds during which two of a run's actions ran at once. A serial run's come only from a
    sender's bookkeeping after its message left (measured: usually up to 2 ms, once 17 ms on a CI
    machine); pipelined runs of the calibration's plans overlap 30-56 % of their time."""
    spans = sorted((s, e) for _, _, s, e, _ in rec["timeline"])
    return sum(max(0.0, min(x[1], y[1]) - y[0]) for k, x in enumerate(spans) for y in spans[k + 1:])


def test_calibration_steps_also_run_their_plans_serially(job, tmp_path):
    """A calibration step of several micro-batches runs its plan pipelined and serially
    (``calibrate_serial``, on by default), the first of the two alternating with the batch: the
    serial run has the same micro-batches and order, no two ranks compute at once, and its
    loss equals the pipelined run's bit for bit (same weights, same micro-batch order). Rank 0
    fits kappa on those pairs and holds it after the calibration steps. Replaying the job runs its
    pipelined plans only. Messages under ``strict_order``, as NCCL orders them."""
    dump = tmp_path / "serial"
    _torchrun(["-m", "torchtitan.train", *_args(job, dump, "--training.steps", "4", "--pipetune.calibrate_steps", "3",
                                                 "--pipetune.online_window", "4", "--pipetune.max_mbs", "1")])
    recs = _records(dump)
    runs = {b: [r for r in recs if r["batch"] == b] for b in range(4)}
    assert [len(r) for r in runs.values()] == [2, 2, 2, 1] and not runs[3][0].get("serial")
    for b in range(3):
        pipelined, twin = sorted(runs[b], key=lambda r: bool(r.get("serial")))
        assert runs[b][b % 2] is pipelined and twin["serial"] and twin["kind"] == pipelined["kind"] == "calibration"
        assert (twin["samples"], twin["order"]) == (pipelined["samples"], pipelined["order"]) and twin["plan"] != pipelined["plan"]
        assert twin["loss"] == pipelined["loss"]
        assert _overlap_s(twin) < 0.04 * twin["measured_s"] and _overlap_s(pipelined) > 0.05 * pipelined["measured_s"]
    assert runs[3][0]["contention"] == runs[2][-1]["contention"]  # measured on the twins, then held
    # the size's first step is cold (one-off costs): both its runs say so, and its twin measures no kappa
    assert [[bool(r.get("cold")) for r in runs[b]] for b in range(4)] == [[True, True], [False, False], [False, False], [False]]
    assert "contention" not in runs[0][1]
    replayed = load_replay(dump / "pipetune" / "steps.jsonl")
    assert all(replayed[b] == next(r["plan"] for r in runs[b] if not r.get("serial")) for b in range(4))


def test_every_nth_tuned_step_also_runs_its_plan_serially(job, tmp_path):
    """With ``tuned_twin_every 2`` every second step after calibration whose plan is pipetune's
    (not the guard's baseline) also runs it serially, the first of the two alternating from twin
    to twin: same micro-batches, order and loss, no two ranks computing at once, recorded as a
    serial run of kind ``tuned``; the other steps run once, and replaying the job runs its
    pipelined plans only. Messages under ``strict_order``, as NCCL orders them."""
    dump = tmp_path / "tuned_twins"
    _torchrun(["-m", "torchtitan.train", *_args(job, dump, "--training.steps", "6", "--pipetune.calibrate_steps", "2",
                                                 "--pipetune.online_window", "4", "--pipetune.max_mbs", "1",
                                                 "--pipetune.tuned_twin_every", "2")])
    recs = _records(dump)
    runs = {b: [r for r in recs if r["batch"] == b] for b in range(6)}
    twinned = [b for b in range(2, 6) if len(runs[b]) == 2]
    assert twinned == [b for b in (2, 4) if runs[b][0]["mode"] == "pipetune"] and twinned
    for b in twinned:
        pipelined, twin = sorted(runs[b], key=lambda r: bool(r.get("serial")))
        assert runs[b][(b - 2) // 2 % 2] is pipelined and twin["serial"] and twin["kind"] == "tuned" and "size_twin" not in twin
        assert (twin["samples"], twin["order"], twin["mode"]) == (pipelined["samples"], pipelined["order"], "pipetune")
        assert twin["loss"] == pipelined["loss"] and pipelined["micro_batches"] > 1
        assert _overlap_s(twin) < 0.04 * twin["measured_s"] and _overlap_s(pipelined) > 0.05 * pipelined["measured_s"]
    assert all(len(runs[b]) == 1 for b in (3, 5))
    replayed = load_replay(dump / "pipetune" / "steps.jsonl")
    assert all(replayed[b] == next(r["plan"] for r in runs[b] if not r.get("serial")) for b in range(6))


def test_calibration_steps_of_the_smallest_size_also_run_the_batch_at_the_largest(job, tmp_path):
    """With two sizes to calibrate, a calibration step at mbs 1 also runs its batch at mbs 2 on
    the serial schedule (the size twin): the same samples, no two ranks computing at once, the
    same loss up to packing's rounding. Rank 0 measures the per-call overhead on the (serial twin,
    size twin) pair of a warm step and holds it; replaying the job runs its pipelined plans only.
    Messages under ``strict_order``, as NCCL orders them."""
    dump = tmp_path / "size_twin"
    _torchrun(["-m", "torchtitan.train", *_args(job, dump, "--training.steps", "4", "--pipetune.calibrate_steps", "3",
                                                 "--pipetune.online_window", "4", "--pipetune.max_mbs", "2")])
    recs = _records(dump)
    runs = {b: [r for r in recs if r["batch"] == b] for b in range(4)}
    for b in (0, 2):
        size_twin = next(r for r in runs[b] if r.get("size_twin"))
        pipelined = next(r for r in runs[b] if not r.get("serial"))
        assert size_twin["serial"] and size_twin["kind"] == "calibration" and (size_twin["mbs"], pipelined["mbs"]) == (2, 1)
        assert sorted(i for mb in size_twin["samples"] for i in mb) == sorted(i for mb in pipelined["samples"] for i in mb)
        assert size_twin["micro_batches"] < pipelined["micro_batches"]
        assert size_twin["loss"] == pytest.approx(pipelined["loss"], rel=1e-4)
        assert _overlap_s(size_twin) < 0.04 * size_twin["measured_s"]
    assert not any(r.get("size_twin") for b in (1, 3) for r in runs[b])
    # batch 0 is every size's first step (cold, no pair); batch 2's runs go size twin, pipelined,
    # serial twin, and the pair is complete with the last
    assert [bool(r.get("size_twin")) for r in runs[2]] == [True, False, False] and runs[2][2]["serial"]
    assert runs[2][0]["call_overhead_s"] is None and runs[2][2]["call_overhead_s"] >= 0
    assert "call_overhead_s" not in runs[0][2]
    replayed = load_replay(dump / "pipetune" / "steps.jsonl")
    assert all(replayed[b] == next(r["plan"] for r in runs[b] if not r.get("serial")) for b in range(4))
