"""pipetune's trainer beside TorchTitan's data parallelism (FSDP) and tensor parallelism on 4 and 8 gloo
ranks: every replica runs its own plan of its share of the global batch, and each step's loss,
gradients and gradient norm equal the unsplit model's on the whole global batch."""

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipetune_configs import config_registry
from pipetune.plan.plan import IterationPlan
from pipetune.records import StepRecord
from launch import torchrun
from small_job import job_args
from titan_reference import check_unsplit_step, unsplit_step

pytestmark = pytest.mark.timeout(170)
WORKER = Path(__file__).with_name("titan_scale_out_worker.py")
STEPS = 2


def _unsplit_model(trained: bool = False):
    spec = config_registry.muse_glimmer_mm().model_spec
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.vision_encoder.requires_grad_(trained)
    return model


def _reference(weights: dict, batches, dtype, trained: bool) -> tuple[float, dict]:
    """Loss and gradients of the unsplit model with ``weights`` on the replicas' batches in
    ``dtype`` (the vision encoder's too when ``trained``)."""
    model = _unsplit_model(trained)
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():  # not Module.to(dtype), which would cast the complex RoPE cache to a real one
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point() or t.is_complex():
                t.data = t.data.to(dtype.to_complex() if t.is_complex() else dtype)
    mbs = [dataclasses.replace(mb, pixel_values=mb.pixel_values.to(dtype)) for b in batches for mb in b.micro_batches]
    loss = unsplit_step(model, SimpleNamespace(micro_batches=mbs, num_label_tokens=batches[0].num_label_tokens))
    return loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _check_steps(ranks: list[list[dict]], records: list[StepRecord], replicas: int, *, trained: bool = False) -> None:
    """Every step of a 4- or 8-rank job: the replicas' batches partition the global batch; loss,
    gradients (joined over TP, after FSDP's reduction) and the clipped norm equal the unsplit
    model's on the whole batch from the same weights (``check_unsplit_step``; gradients at least
    2e-5 relative)."""
    shapes = {k: v.shape for k, v in _unsplit_model().state_dict().items()}
    assert sorted((r.step, r.replica) for r in records) == [(s, d) for s in range(1, STEPS + 1) for d in range(replicas)]
    for r in records:  # per stage: no device memory statistics on CPU, the plan's predicted peak
        assert r.peak_bytes == [None, None] and len(r.predicted_peak_bytes) == 2 and min(r.predicted_peak_bytes) > 0
    for step in range(STEPS):
        at = [r[step] for r in ranks]
        batches = [next(a["batch"] for a in at if a["replica"] == d) for d in range(replicas)]
        assert len({b.step for b in batches}) == 1 and len({b.num_label_tokens for b in batches}) == 1
        ids = [set(s for mb in b.micro_batches for s in mb.sample_ids.tolist()) for b in batches]
        assert sum(map(len, ids)) == len(set().union(*ids)) == 8  # a partition of the 8-sample global batch
        assert sum(mb.num_label_tokens for b in batches for mb in b.micro_batches) == batches[0].num_label_tokens
        for d, b in enumerate(batches):  # each replica's record counts its share's tokens, padding apart
            r = next(r for r in records if (r.step, r.replica) == (step + 1, d))
            assert r.real_tokens + r.padding_tokens == sum(mb.num_tokens for mb in b.micro_batches) and r.model_flops > 0
            assert r.padding_tokens < len(b.micro_batches) * max(1, len(at) // (2 * replicas))  # sequence-parallel rounding only

        loss = sum(r.loss for r in records if r.step == step + 1)
        exact = check_unsplit_step(at, batches, loss, shapes, lambda w, b, dtype: _reference(w, b, dtype, trained), step=step + 1,
                                   replicas=replicas, floor=2e-5)
        assert any(n.startswith("vision_encoder.") for n in exact) == trained


def _scale_out_job(job, tmp_path, *extra: str, ranks: int = 4) -> None:
    """Runs the job (its output in ``tmp_path / "job.log"``); every rank's steps and the records."""
    dump = tmp_path / "dump"
    out = torchrun([str(WORKER), str(tmp_path), str(STEPS)] + job_args(job, dump, "--training.steps", str(STEPS), "--training.max_norm", "1e9",
                                                                         *extra), timeout=160 if ranks == 4 else 400, ranks=ranks)
    (tmp_path / "job.log").write_text(out)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(ranks)]
    return ranks, StepRecord.read(dump / "pipetune" / "steps.jsonl")


@pytest.fixture
def unsplit_backend(monkeypatch):
    """The single-process reference runs without TorchTitan's SPMD type annotations (no mesh)."""
    from torchtitan.distributed import utils as dist_utils

    monkeypatch.setattr(dist_utils, "_spmd_backend", "partial_dtensor")


def _separated_job(job, tmp_path, *extra: str, replicate: int = 1, dp: int = 1, tp: int = 1):
    """A job in DIP's separated layout with a trained encoder on a 5:5:90 mix (some replica's share
    has no image when there are several), ``replicate x dp`` replicas (HSDP when both exceed 1), TP
    ``tp``; its TP table is the trained one relabelled: this checks numerics, not planning. Checks
    that stage 1's encoder chunks are TP-sharded exactly when ``tp > 1`` and every step against the
    unsplit model; returns the ranks' records."""
    import json

    from pipetune.data import make_mix, write_dataset

    write_dataset(make_mix("5:5:90", 300, 7), tmp_path / "data", {"mix": "5:5:90"})  # 1-2 image samples in each of the first 3 steps
    table = json.loads((job / "table_trained.json").read_text())
    (tmp_path / "table.json").write_text(json.dumps({**table, "tp": tp}))
    ranks, records = _scale_out_job(job, tmp_path, "--parallelism.data_parallel_replicate_degree", str(replicate),
                                    "--parallelism.data_parallel_shard_degree", str(dp), "--parallelism.tensor_parallel_degree", str(tp),
                                    "--pipetune.layout", "separated", "--pipetune.no-freeze_vision_encoder", "--pipetune.latency_table",
                                    str(tmp_path / "table.json"), "--dataloader.dataset_path", str(tmp_path / "data"), *extra,
                                    ranks=2 * replicate * dp * tp)
    assert all(r.separated for r in records)
    if replicate * dp > 1:
        assert 0 in [sum(mb.num_images for mb in step["batch"].micro_batches) for a in ranks for step in a]
    whole = _unsplit_model().state_dict()
    later = {n: g.shape for a in ranks if a[0]["stage"] == 1 for n, g in a[0]["grads"].items() if n.startswith("vision_encoder.layers.")}
    assert later and any(shape != whole[n].shape for n, shape in later.items()) == (tp > 1)  # TP shards on stage 1 too
    _check_steps(ranks, records, replicas=replicate * dp, trained=True)
    return ranks


@pytest.mark.timeout(450)
@pytest.mark.parametrize("replicate, dp, tp", [(1, 2, 2), (2, 2, 1)], ids=["dp2-tp2", "hsdp2x2"])
def test_separated_layout_beside_data_and_tensor_parallelism(job, tmp_path, unsplit_backend, replicate, dp, tp):
    """DIP's separated layout with a trained encoder beside DP 2 (FSDP) x TP 2 (sequence parallel)
    and HSDP (2 replicas of 2 FSDP shards), 8 ranks each (DP 2 alone: the next test): every rank's
    encoder chunks, stage 1's (no adapter) included, are TP-sharded as stage 0's are and
    FSDP-sharded, gathered and reduced once per step whatever its replica's share of the images.
    Loss, every gradient (the ViT's blocks on both stages) and the norm equal the unsplit model's,
    as above."""
    _separated_job(job, tmp_path, replicate=replicate, dp=dp, tp=tp)


def test_separated_layout_checkpoints_every_encoder_chunk(job, tmp_path, unsplit_backend):
    """The separated layout with a trained encoder beside DP 2 (FSDP), under full activation
    checkpointing (``activation_checkpoint:full``): every ViT block of both stages is
    checkpoint-wrapped, as the job asks (stage 1's chunks are parallelised apart from TorchTitan's
    ``parallelize_fn``), and, as above, every step's loss, gradients and norm equal the unsplit
    model's."""
    ranks = _separated_job(job, tmp_path, "activation_checkpoint:full", dp=2)
    blocks = {a[0]["stage"]: {n for n in a[0]["checkpointed"] if n.startswith("vision_encoder.layers.")} for a in ranks}
    held = {a[0]["stage"]: {n.split(".")[2] for n in a[0]["grads"] if n.startswith("vision_encoder.layers.")} for a in ranks}
    assert blocks == {s: {f"vision_encoder.layers.{i}" for i in held[s]} for s in (0, 1)} and all(held.values())


def test_data_parallel_job_resumes_as_if_uninterrupted(job, tmp_path):
    """DP 2 x PP 2 reading real files (caption pairs and documents with images, raw text under the
    job's tokenizer) through a metadata index the command line built; checkpoints at steps 2 and 4
    (FSDP-sharded weights and optimizer, the loader's stream position, every lead's learning);
    restarted as if it had died before the step-4 checkpoint, it trains steps 3 and 4 exactly as
    the first run did, replica by replica."""
    import shutil

    from pipetune.cli.main import main

    index = tmp_path / "index"
    assert main(["data", "index", str(job / "fixture" / "data"), "--out", str(index), "--tokenizer", str(job / "fixture" / "tokenizer")]) == 0
    dump = tmp_path / "job"
    run = ["-m", "torchtitan.train", *job_args(job, dump, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2",
                                               "--parallelism.data_parallel_shard_degree", "2", "--dataloader.dataset_path", str(index))]
    torchrun(run, timeout=160, ranks=4)
    first = StepRecord.read(dump / "pipetune" / "steps.jsonl")
    assert max(i for r in first for mb in r.samples for i in mb) < 32  # the indexed corpus's 32 samples, not job/data's 300
    shutil.rmtree(dump / "checkpoint" / "step-4")
    (dump / "pipetune" / "steps.jsonl").unlink()
    assert "Training starts at step 3" in torchrun(run, timeout=160, ranks=4)
    resumed = StepRecord.read(dump / "pipetune" / "steps.jsonl")
    key = lambda r: (r.step, r.replica)  # noqa: E731
    assert sorted(map(key, resumed)) == [(s, d) for s in (3, 4) for d in range(2)]
    for x, y in zip(sorted((r for r in first if r.step > 2), key=key), sorted(resumed, key=key)):
        assert (x.batch, x.samples, x.order) == (y.batch, y.samples, y.order)
        assert x.loss == y.loss, f"step {x.step} replica {x.replica}: loss {x.loss} uninterrupted, {y.loss} resumed"


def test_bf16_job_trains_within_bf16_tolerance_of_fp32(job, tmp_path):
    """The same DP 2 x PP 2 job in bf16 (``training.mixed_precision_param``: FSDP computes with
    bf16 weights, messages are bf16) trains 3 steps whose losses stay within bf16's precision of
    the fp32 job's. Its latency table is the fp32 one relabelled bf16: this checks numerics, not
    planning."""
    import json

    table = json.loads((job / "table.json").read_text())
    (tmp_path / "table_bf16.json").write_text(json.dumps({**table, "dtype": "bfloat16"}))
    losses = {}
    for dtype, path in (("float32", job / "table.json"), ("bfloat16", tmp_path / "table_bf16.json")):
        dump = tmp_path / dtype
        torchrun(["-m", "torchtitan.train", *job_args(job, dump, "--training.steps", "3", "--parallelism.data_parallel_shard_degree", "2",
                                                       "--training.mixed_precision_param", dtype, "--pipetune.latency_table", str(path),
                                                       "--pipetune.mode", "balanced", "--pipetune.mbs", "1")], timeout=160, ranks=4)
        records = StepRecord.read(dump / "pipetune" / "steps.jsonl")
        losses[dtype] = [sum(r.loss for r in records if r.step == s) for s in (1, 2, 3)]
    assert losses["float32"] != losses["bfloat16"]  # the bf16 job did compute in bf16
    for a, b in zip(losses["float32"], losses["bfloat16"]):
        assert b == pytest.approx(a, rel=2e-2)


@pytest.mark.timeout(450)
@pytest.mark.parametrize("schedule", ["1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"])
def test_data_tensor_and_pipeline_parallel_steps_equal_the_unsplit_model(job, tmp_path, schedule, unsplit_backend, monkeypatch):
    """DP 2 x TP 2 x PP 2 on 8 gloo ranks: FSDP over the replicas and sequence-parallel TP inside
    each stage, each replica planning its own share on its lead, 2 steps. Under ``1F1B`` one chunk
    per rank, TorchTitan's selective activation checkpointing (its recompute counted on step 1 for
    ``hfu(%)``), and replica 1's planner process is killed before the first step: replica 1 runs its
    planner's fallback of its share every step and its records and the log say why, replica 0 its
    own searched plans. Under TorchTitan's ``InterleavedZeroBubble`` two backbone chunks per rank,
    every backward split into input and weight gradients, so weight gradients arrive after the
    input gradients that FSDP's and TP's backward hooks see; under ``ZBVZeroBubble`` the same in a V
    (chunks 0 and 3 on rank 0, handing over from chunk 1 to 2 on rank 1 without a message). Either
    way the replicas' plans
    partition each global batch, and each step's loss (summed over replicas), gradients (joined
    over TP after FSDP's reduction) and norm equal the unsplit model's on the global batch from the
    same weights."""
    killed = schedule == "1F1B"
    if killed:
        monkeypatch.setenv("KILL_PLANNER_OF_REPLICA", "1")
    ranks, records = _scale_out_job(job, tmp_path, "--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree",
                                    "2", "--pipetune.latency_table", str(job / "table_tp2.json"), "--parallelism.pipeline_parallel_schedule",
                                    schedule, *(["activation_checkpoint:selective"] if killed else []), ranks=8)
    plans = [IterationPlan.from_json(r.plan) for r in records]
    assert {(p.placement.chunks_per_rank, p.table().split_backward) for p in plans} == {(1, False) if killed else (2, True)}
    assert {p.placement.style.value for p in plans} == {"v" if schedule == "ZBVZeroBubble" else "loop"}
    _check_steps(ranks, records, replicas=2)
    log = (tmp_path / "job.log").read_text()
    if killed:  # selective AC: every backbone block wrapped, its recompute counted on step 1 (hfu(%))
        assert all(any(n.startswith("layers.") for n in a[0]["checkpointed"]) for a in ranks)
        shares = {tuple(x if x == x else None for x in step["recompute_share"]) for a in ranks for step in a}  # NaN: None
        (weights, attention, *vit), = shares  # summed over ranks: one share on all of them
        assert 0 < weights < 1 and 0 <= attention <= 1 and vit == [None, None]  # a frozen ViT recomputes nothing
    for r in records:
        assert r.fallback == (killed and r.replica == 1), (r.step, r.replica, r.fallback_reason)
        assert bool(r.fallback_reason) == r.fallback and (not r.fallback or "exited with code -9 (Killed)" in r.fallback_reason)
    assert log.count("fallback plans on replica 1 (pipetune planner process") == (STEPS if killed else 0)
