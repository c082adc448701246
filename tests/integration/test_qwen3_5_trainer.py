"""TorchTitan's Qwen3.5 ``debugmodel`` (small vocabulary) under ``PipeTuneTrainer`` on 2 gloo ranks
(``torchrun -m torchtitan.train``'s config path): step-1 gradients equal the unsplit TorchTitan
model's on the same batch, as Muse Glimmer's do in test_titan_trainer, with the ViT frozen (as
pipetune trains it by default; its merger trains) and trained. Gated DeltaNet runs its CPU path."""

from pathlib import Path

import pytest
import torch

from configs import config_registry
from pipetune.data import make_mix, write_dataset
from pipetune.data.mixes import parse_mix
from titan_jobs import job_args, torchrun
from torchtitan_patches.data.micro_batch import IMAGE_TOKEN_ID
from torchtitan_patches.model.packed_attention import varlen_metadata
from torchtitan_patches.model.vlm import token_loss_sum
from torchtitan_patches.titan.model_spec import planning_model_config
from torchtitan_patches.titan.qwen3_5 import block_order, mrope_positions
from torchtitan_patches.titan.stages import collated_images

WORKER = Path(__file__).with_name("titan_grad_worker.py")
CONFIG = "qwen3_5_debug"


@pytest.fixture(scope="module")
def qwen_job(tmp_path_factory):
    """A small generated data set and a coarse latency table of the job's planning shapes."""
    from profiling.profile_layers import ProfileConfig, run_profile

    d = tmp_path_factory.mktemp("qwen_job")
    write_dataset(make_mix(parse_mix("datamix2"), 100, 0), d / "data", {"mix": "datamix2"})
    config = getattr(config_registry, CONFIG)()
    for frozen, name in ((True, "table.json"), (False, "table_trained.json")):  # a trained ViT's table also times its backward
        model = planning_model_config(config.model_spec, image_grid=config.pipetune.image_grid, encoder_frozen=frozen)
        run_profile(model, ProfileConfig(max_seq_len=512, max_tokens=1024, max_images=4, points=2, repeats=1, warmup=0, p2p=False),
                    d / name, progress=False)
    return d


def _unsplit_gradients(weights: dict, batch, *, trained: bool) -> dict:
    """Step 1 of the same model, unsplit, through its own forward (ViT and merger inside), with the
    MRoPE positions of ``titan.qwen3_5`` (proven equal to TorchTitan's collator's in the unit tests)."""
    from torchtitan.distributed import utils as dist_utils

    config = getattr(config_registry, CONFIG)()
    with torch.device("meta"):
        model = config.model_spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.load_state_dict(weights, strict=True)
    model.vision_encoder.requires_grad_(trained)
    model.vision_encoder.merger.requires_grad_(True)
    backend, dist_utils._spmd_backend = dist_utils._spmd_backend, "partial_dtensor"  # no device mesh in this process
    try:
        for mb in batch.micro_batches:
            bounds = mb.cu_seqlens.tolist()
            images = [(span.start, (span.grid[0] // 2, span.grid[1] // 2)) for span in mb.image_spans]
            mrope = torch.from_numpy(mrope_positions(bounds, images))[None]
            kwargs = {}
            if mb.num_images:
                patches, grid_thw = collated_images(mb)  # the loader's raster order; Qwen's merger wants block order
                blocks = torch.stack([torch.nn.functional.pad(block_order(p[:h * w], (h, w), 2)[0], (0, 0, 0, len(p) - h * w))
                                      for p, (_, h, w) in zip(patches, grid_thw.tolist())])
                kwargs = {"pixel_values": blocks, "grid_thw": grid_thw}
            masks = varlen_metadata(mb.cu_seqlens)
            logits = model(mb.tokens[None], attention_masks={"quadratic_attention": masks, "deltanet": masks}, positions=mb.positions[None],
                           mrope_positions=mrope, special_tokens={"image_id": IMAGE_TOKEN_ID, "video_id": -1}, **kwargs)
            (token_loss_sum(logits, mb.labels[None]) / batch.num_label_tokens).backward()
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
