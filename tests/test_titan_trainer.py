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
from torchtitan_patches.model.attention import varlen_metadata
from torchtitan_patches.model.vlm import token_loss_sum
from torchtitan_patches.titan import config_registry
from torchtitan_patches.titan.model_spec import planning_model_config
from torchtitan_patches.titan.stages import patchify

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
    model = planning_model_config(config.model_spec, image_grid=config.pipetune.image_grid)
    run_profile(model, ProfileConfig(max_seq_len=512, max_tokens=2048, max_images=8, points=3, repeats=1, warmup=1, p2p=False), d / "table.json",
                progress=False)
    return d


def _args(job: Path, dump: Path, *extra: str) -> list[str]:
    return ["--module", "torchtitan_patches.titan", "--config", "pipetune_muse_glimmer_mm", "--dump_folder", str(dump),
            "--dataloader.dataset_path", str(job / "data"), "--pipetune.latency_table", str(job / "table.json"),
            "--dataloader.gbs", "8", "--training.seq_len", "512", "--pipetune.online_window", "0", "--pipetune.budget_s", "60",
            "--pipetune.strict_order", *extra]


def _torchrun(target: list[str], timeout: float = 100) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port), *target]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
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


def _unsplit_gradients(weights: dict, batch) -> dict:
    """Step 1 of the same TorchTitan model, unsplit, through its own forward (encoder inside), in
    this single process (no device mesh: TorchTitan's plain-tensor backend)."""
    spec = config_registry.pipetune_muse_glimmer_mm().model_spec
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # buffers (rope tables); the weights come from the pipelined run
    model.load_state_dict(weights, strict=True)
    model.vision_encoder.requires_grad_(False)
    enc = model.vision_encoder
    for mb in batch.micro_batches:
        kwargs = {}
        if mb.num_images:
            patches, grid = patchify(mb.pixel_values, enc.patch_size, enc.patch_temporal)
            kwargs = {"pixel_values": patches, "grid_thw": grid, "special_tokens": {"image_id": 0}}
        logits = model(mb.tokens[None], mb.positions[None], varlen_metadata(mb.cu_seqlens), **kwargs)
        (token_loss_sum(logits, mb.labels[None]) / batch.num_label_tokens).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_step_one_gradients_equal_the_unsplit_model(job, tmp_path, monkeypatch):
    from torchtitan.distributed import utils as dist_utils

    monkeypatch.setattr(dist_utils, "_spmd_backend", "partial_dtensor")
    # an uneven split (5 + 3 layers) and pre-computed encoders: stage 0's forward uses E's output
    _torchrun([str(WORKER), str(tmp_path)] + _args(job, tmp_path / "dump", "--training.steps", "1", "--pipetune.layout", "5,3"))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    batch = ranks[0]["batch"]
    assert any(mb.num_images for mb in batch.micro_batches), "the batch should exercise the vision encoder"
    assert _records(tmp_path / "dump")[0]["precomputed_encoders"] > 0, "the plan should pre-compute encoders"
    weights = {k: v for r in ranks for k, v in r["weights"].items()}
    reference = _unsplit_gradients(weights, batch)
    pipelined = {k: v for r in ranks for k, v in r["grads"].items()}
    assert set(pipelined) == set(reference)
    assert not any(k.startswith("vision_encoder.") for k in reference)  # frozen, as PipeTune trains it
    for name, g in reference.items():
        err = float((pipelined[name] - g).norm() / g.norm().clamp_min(1e-30))
        assert err < 1e-4, f"{name}: relative gradient error {err:.2e}"


def test_bad_job_settings_are_named():
    from torchtitan_patches.titan.dataloader import PipeTuneTitanDataLoader
    from torchtitan_patches.titan.trainer import PipeTuneSettings

    with pytest.raises(ValueError, match="'fast'"):
        PipeTuneSettings.Config(mode="fast")
    with pytest.raises(ValueError, match="pipetune.plan_ahead"):
        PipeTuneSettings.Config(plan_ahead=-1)
    with pytest.raises(ValueError, match="dataset_path is empty"):
        PipeTuneTitanDataLoader.Config().build(seq_len=512)
    with pytest.raises(ValueError, match="data-parallel degree 2"):
        PipeTuneTitanDataLoader.Config(dataset_path="x").build(seq_len=512, dp_world_size=2)
