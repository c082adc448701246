"""The heavy-encoder TorchTitan job (``muse_glimmer_heavy_vit``, run by
``benchmarks/layout_real.py``): its planning shapes are what the built ViT produces, its encoder
outweighs its backbone on the job's data, and the layout search moves layers off stage 0.

Timing-free: the layout claim is checked on a latency table whose every entry is FLOPs at one rate
(what a CPU that runs every matmul equally well would measure), so it holds for the model and data,
not for one noisy machine."""

import numpy as np
import torch

from pipetune.config.hardware import HardwareSpec
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.data import make_mix
from pipetune.packing.flops import FlopsModel
from pipetune.plan.layout.layout_search import LayoutSearch, sample_batches
from pipetune_configs import config_registry
from torchtitan_patches.models.model_spec import planning_model_config
from torchtitan_patches.data.micro_batch import patchify

FLOPS_ONLY = HardwareSpec(
    name="flops-only", peak_flops=2e10, hbm_bytes_per_s=1e15, memory_bytes=16e9, gemm_efficiency=1.0, attention_fwd_efficiency=1.0,
    attention_bwd_efficiency=1.0, gemm_half_tokens=1e-9, attention_half_len=1e-9, kernel_launch_s=1e-12, tp_bytes_per_s=1e12,
    tp_latency_s=1e-12, p2p_bytes_per_s=1e12, p2p_latency_s=1e-9,
)  # time = FLOPs / 20 GFLOP/s (about one CPU core), no launch, bandwidth or small-size penalty


def _job():
    config = config_registry.muse_glimmer_heavy_vit()
    pt = config.pipetune
    return config, planning_model_config(config.model_spec, image_grid=pt.image_grid, encoder_frozen=pt.freeze_vision_encoder)


def test_planning_shapes_are_what_the_built_vision_encoder_outputs():
    config, model = _job()
    enc = model.encoder
    assert not enc.frozen and enc.image_size == config.pipetune.image_grid * enc.patch_size
    torch.manual_seed(0)
    with torch.device("meta"):
        vit = config.model_spec.model.vision_encoder.build()
    vit.to_empty(device="cpu")
    with torch.no_grad():
        vit.init_states(buffer_device=torch.device("cpu"))
    pixels = torch.randn(2, enc.channels, enc.image_size, enc.image_size).numpy()
    patches = torch.from_numpy(np.stack([patchify(im, enc.patch_size, enc.patch_temporal) for im in pixels]))
    grid = torch.tensor([[1, config.pipetune.image_grid, config.pipetune.image_grid]] * 2)
    assert patches.shape == (2, enc.patches_per_image, enc.patch_dim)
    out = vit(patches, grid_thw=grid)
    # the 2 x 2 merge: patches_per_image / 4 tokens per image, each of width dim * 4 (the projector's input)
    assert out.shape == (2 * enc.tokens_per_image, enc.merged_dim)
    assert (enc.patches_per_image, enc.tokens_per_image) == (64, 16)


def test_encoder_outweighs_backbone_and_auto_moves_layers_off_stage_zero():
    config, model = _job()
    pt, dl, seq = config.pipetune, config.dataloader, config.training.seq_len
    data = make_mix("datamix3", 4000, 0)  # what `prepare --mix datamix3` writes
    whole = sample_batches(data, model, gbs=len(data), max_seq_len=seq, count=1, seed=0)[0].table  # truncated at seq_len
    f = FlopsModel(model)
    encoder = f.encoder_flops(whole.num_images.sum())
    backbone = f.sequence_flops(whole.lengths, with_head=False).sum()
    assert encoder > backbone  # trained ViT fwd + bwd vs all backbone layers' fwd + bwd: 1.5 x

    sample = sample_batches(data, model, gbs=dl.gbs, max_seq_len=seq, count=8, seed=dl.seed)  # as the trainer's auto samples

    n, pp = model.backbone.n_layers, config.parallelism.pipeline_parallel_degree
    table = analytical_table(model, FLOPS_ONLY, max_tokens=pt.max_mbs * seq, max_images=128)
    search = LayoutSearch(model, CostModel(table, StageLayout.even(n, pp)), sample, max_seq_len=seq, memory_bytes=pt.memory_gib * 2**30,
                          max_mbs=pt.max_mbs, seed=dl.seed)
    r = search.search()
    assert r.even.busy[0] > 0.95 and r.even.busy[1] < 0.5  # even: stage 0 (encoder + half the layers) gates the pipeline
    assert r.best.layout.layers_per_stage()[0] < r.even.layout.layers_per_stage()[0]
    assert r.cut_vs_even > 0.1  # 17 % on this table
    assert np.ptp(r.best.busy) < np.ptp(r.even.busy)  # the stages' busy fractions move closer together
