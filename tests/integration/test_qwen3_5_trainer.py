"""TorchTitan's Qwen3.5 ``debugmodel`` (small vocabulary) under ``PipeTuneTrainer`` on 2 gloo ranks
(``torchrun -m torchtitan.train``'s config path): step-1 gradients equal the unsplit TorchTitan
model's on the same batch, as Muse Glimmer's do in test_titan_trainer, with the ViT frozen (as
pipetune trains it by default; its merger trains) and trained. Gated DeltaNet runs its CPU path."""

from pathlib import Path

import pytest
import torch

from launch import torchrun
from small_job import job_args
from titan_reference import qwen3_5_unsplit_model, qwen3_5_unsplit_step

WORKER = Path(__file__).with_name("titan_grad_worker.py")
CONFIG = "qwen3_5_debug"


def _unsplit_gradients(weights: dict, batch, *, trained: bool) -> dict:
    """Step 1 of the same model, unsplit, through its own forward (ViT and merger inside), with the
    MRoPE positions of ``models.qwen3_5.stages`` (proven equal to TorchTitan's collator's in the unit tests)."""
    from torchtitan.distributed import utils as dist_utils

    model = qwen3_5_unsplit_model(weights, trained=trained)
    backend, dist_utils._spmd_backend = dist_utils._spmd_backend, "partial_dtensor"  # no device mesh in this process
    try:
        qwen3_5_unsplit_step(model, batch)
    finally:
        dist_utils._spmd_backend = backend
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("trained", [False, True], ids=["frozen_vit", "trained_vit"])
def test_qwen3_5_step_one_gradients_equal_the_unsplit_model(qwen_job, tmp_path, trained):
    """An uneven co-located split (5 layers, one of them full attention, then 3) on packed
    micro-batches with images: every trained parameter's gradient (none zero) equals the unsplit
    model's. With the ViT frozen (pipetune's default) its blocks get no gradient and its merger
    does; trained, both do."""
    extra = ["--pipetune.no-freeze_vision_encoder", "--pipetune.latency_table", str(qwen_job / "table_trained.json")] if trained else []
    torchrun([str(WORKER), str(tmp_path)] + job_args(qwen_job, tmp_path / "dump", "--training.steps", "1", "--pipetune.layout", "5,3",
                                                      "--training.max_norm", "1e9", *extra, config=CONFIG), timeout=50)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    batch = ranks[0]["batch"]
    assert any(mb.num_images for mb in batch.micro_batches) and len(batch.micro_batches) > 1
    weights = {k: v for r in ranks for k, v in r["weights"].items()}
    reference = _unsplit_gradients(weights, batch, trained=trained)
    pipelined = {k: v for r in ranks for k, v in r["grads"].items()}
    assert set(pipelined) == set(reference)
    assert any(k.startswith("vision_encoder.merger.") for k in reference)
    assert any(k.startswith("vision_encoder.layers.") for k in reference) == trained
    assert any(k.endswith(".attn.A_log") for k in reference)  # the Gated DeltaNet layers train
    assert not [k for k, g in reference.items() if not g.abs().max() > 0], "a gradient is zero: the comparison would prove nothing"
    for name, g in reference.items():
        err = float((pipelined[name] - g).norm() / g.norm())
        assert err < 1e-4, f"{name}: relative gradient error {err:.2e}"
