"""The FLOPs model against torch's FlopCounterMode on real TorchTitan layers."""

import time

import numpy as np
import pytest
import torch
import torchtitan.components.metrics as titan_metrics
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from pipetune.config.model import BackboneConfig, EncoderConfig, ModelConfig
from pipetune.packing import FlopsModel
from torchtitan_patches.compat import cpu_device
from torchtitan_patches.data.micro_batch import PackedMicroBatch
from torchtitan_patches.titan.metrics import StepWork, WorkMetricsProcessor
from torchtitan_patches.models.reference.blocks import decoder_layer_config, no_rope, vit_layer_config
from torchtitan_patches.models.packed_attention import varlen_metadata


def counted(fn):
    """FLOPs of fn() forward and forward+backward; the math SDPA backend so attention is counted."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        out = fn()
        fwd = fc.get_total_flops()
        out.float().pow(2).sum().backward()
    return fwd, fc.get_total_flops()


@pytest.mark.parametrize("lengths", [[100, 150, 50, 200], [511], [3, 7, 1, 64, 300]])
def test_decoder_layer_flops_match_flop_counter(tiny, lengths):
    """Forward and forward + backward; and under TorchTitan's full activation checkpointing, the
    backward's extra FLOPs are one more forward of the block (what ``hfu(%)`` adds)."""
    torch.manual_seed(0)
    layer = decoder_layer_config(tiny.backbone, max_seq_len=1024, attention_backend="sdpa").build()
    layer.init_states()
    cu = torch.tensor([0, *np.cumsum(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    x = torch.randn(1, sum(lengths), tiny.backbone.dim, requires_grad=True)
    fwd, total = counted(lambda: layer(x, varlen_metadata(cu), pos))
    # FlopCounterMode counts SDPA densely (no causal discount), so compare the dense convention.
    dense = FlopsModel(tiny, causal=False)
    model = dense.layer_forward(lengths).sum()
    assert abs(fwd - model) <= 0.05 * fwd
    assert abs(total - 3 * model) <= 0.05 * total
    checkpointed = FullAC(FullAC.Config())._wrap_block(layer)
    _, recomputing = counted(lambda: checkpointed(x, varlen_metadata(cu), pos))
    one_layer = dense.block_forward_flops(lengths) / tiny.backbone.n_layers
    assert abs((recomputing - total) - one_layer) <= 0.05 * one_layer


def test_vit_layer_flops_match_flop_counter(tiny):
    enc = tiny.encoder
    layer = vit_layer_config(enc).build()
    layer.init_states()
    x = torch.randn(5, enc.tokens_per_image, enc.dim, requires_grad=True)
    fwd, _ = counted(lambda: layer(x, rope_cache=torch.zeros(1), rope_apply=no_rope, attention_mask=None))
    p = enc.tokens_per_image
    per_image_layer = 2 * p * enc.layer_params + 4 * enc.dim * p * p
    assert abs(fwd - 5 * per_image_layer) <= 0.05 * fwd


def test_causal_pairs_are_the_block_diagonal_lower_triangle(tiny):
    lengths = [5, 1, 12, 7]
    mask = torch.block_diag(*[torch.ones(n, n).tril() for n in lengths])
    f_causal = FlopsModel(tiny, causal=True)
    f_full = FlopsModel(tiny, causal=False)
    attn_causal = f_causal.layer_forward(lengths).sum() - f_causal.linear_per_token * sum(lengths)
    attn_full = f_full.layer_forward(lengths).sum() - f_full.linear_per_token * sum(lengths)
    assert attn_causal == pytest.approx(f_causal.attention_per_pair * mask.sum().item())
    assert attn_full == pytest.approx(f_full.attention_per_pair * sum(n * n for n in lengths))


def test_micro_batch_flops_are_additive_over_documents(model13b):
    f = FlopsModel(model13b)
    docs = np.array([100, 2000, 37])
    joint = f.sequence_flops(docs).sum()
    assert joint == pytest.approx(sum(f.sequence_flops([d])[0] for d in docs))
    assert f.sequence_flops([4000])[0] > 2 * f.sequence_flops([2000])[0]  # attention is superlinear


def test_frozen_encoder_is_forward_only(tiny):
    f = FlopsModel(tiny)
    assert f.encoder_flops(3) == pytest.approx(3 * f.vit_forward_per_image())
    assert f.encoder_flops(3, backward=True) == pytest.approx(9 * f.vit_forward_per_image())


def _hand_model(frozen: bool) -> ModelConfig:
    """A model small enough to count by hand: one decoder layer (dim 4, ffn 8, one head, vocab 10)
    and a one-layer ViT (dim 2, ffn 4) over 4 patches of 1 x 2 x 2 pixels, no merge."""
    return ModelConfig(name="hand", backbone=BackboneConfig(n_layers=1, dim=4, ffn_dim=8, n_heads=1, n_kv_heads=1, vocab_size=10),
                       encoder=EncoderConfig(n_layers=1, dim=2, ffn_dim=4, n_heads=1, image_size=4, patch_size=2, channels=1, frozen=frozen))


# Counted by hand (2 FLOPs per multiply-add; backward = 2 x forward):
# decoder layer weights: q, k, v, o 4 x 4 each = 64, SwiGLU 3 x 4 x 8 = 96 -> 160.
# text document of 3 tokens, forward: 2*3*160 + attention 4*4*(1+2+3) + head 2*3*4*10 = 1296; trained: 3 x = 3888.
# document of 2 text + 4 image tokens, forward: 2*6*160 + 4*4*21 + 2*6*4*10 = 2736; trained: 8208.
# its image: patch embedding 2*4*4*2 = 64, ViT layer 2*4*(4*2*2 + 2*2*4) + attention 4*2*4*4 = 384 -> forward 448;
# projector 2 -> 4 -> 4 (24 weights) over 4 tokens: 2*4*24 = 192 forward, always trained: 576.
# Blocks' forward (what full activation checkpointing recomputes): decoder layer over the text
# document 2*3*160 + 4*4*6 = 1056, over the image document 2*6*160 + 4*4*21 = 2256; the ViT layer 384
# when trained (a frozen ViT runs without autograd, so nothing of it is recomputed).
TEXT, IMAGE_DOC, VIT, PROJECTOR = 3888, 8208, 448, 576
BLOCKS_TEXT, BLOCKS_IMAGE_DOC, VIT_LAYER = 1056, 2256, 384


@pytest.mark.parametrize("frozen, vit", [(True, VIT), (False, 3 * VIT)])
def test_training_flops_match_a_hand_count(frozen, vit):
    f = FlopsModel(_hand_model(frozen))
    assert f.training_flops([3]) == TEXT  # text only
    assert f.training_flops([3, 6], [4]) == TEXT + IMAGE_DOC + vit + PROJECTOR
    assert f.block_forward_flops([3]) == BLOCKS_TEXT
    assert f.block_forward_flops([3, 6], [4]) == BLOCKS_TEXT + BLOCKS_IMAGE_DOC + (0 if frozen else VIT_LAYER)


def test_step_work_leaves_padding_out_and_mfu_is_model_flops_over_peak_time(monkeypatch):
    """A packed micro-batch (a 3-token text, a 6-token document with one 2 x 2-patch image, then
    a 3-token padding document), and the MFU TorchTitan's processor logs from its work."""
    monkeypatch.setattr(titan_metrics, "device_type", "cpu")  # as the trainer's use_cpu does, for this test only
    monkeypatch.setattr(titan_metrics, "device_module", cpu_device._cpu_device_module())
    f = FlopsModel(_hand_model(frozen=True))
    mb = PackedMicroBatch(tokens=torch.zeros(12, dtype=torch.long), labels=torch.zeros(12, dtype=torch.long), positions=torch.zeros(12, dtype=torch.long),
                          cu_seqlens=torch.tensor([0, 3, 9, 12]), pixel_values=torch.zeros(4, 4), image_token_index=torch.arange(5, 9),
                          sample_ids=torch.tensor([7, 8]), image_grids=((2, 2),))
    work = StepWork.of(f, [mb, mb])
    assert work == StepWork(2 * (TEXT + IMAGE_DOC + VIT + PROJECTOR), 18, 6, 2 * (BLOCKS_TEXT + BLOCKS_IMAGE_DOC))
    assert work.padding_share == 0.25
    assert StepWork.from_list(work.as_list()) == work

    class Dims:
        non_data_parallel_size = 4  # pipeline x tensor parallel ranks per replica

    def logged_by(activation_checkpoint) -> dict:
        logged = {}
        processor = WorkMetricsProcessor.Config(peak_tflops=1e-9).build(parallel_dims=Dims())  # 1000 FLOP/s per device
        processor.count_recompute(activation_checkpoint)
        processor.logger.log = lambda metrics, step: logged.update(metrics)
        processor.add_work(work)
        processor.time_last_log = time.perf_counter() - 100.0
        processor.data_loading_times.append(0.0)
        processor.log(1, 1.0, 1.0, 1.0)
        assert processor.work == StepWork()  # the next log counts from zero
        return logged

    seconds = 100.0  # since the last log, give or take the call's own time
    logged = logged_by(None)
    assert logged["throughput(tps)"] == pytest.approx(18 / (seconds * 4), rel=1e-3)  # real tokens per second per device
    assert logged["mfu(%)"] == pytest.approx(100 * work.model_flops / (seconds * 4 * 1000), rel=1e-3)
    assert logged["padding(%)"] == 25.0
    assert "hfu(%)" not in logged and "hfu(%)" not in logged_by(SelectiveAC.Config())  # nothing recomputed / not known
    full = logged_by(FullAC.Config())
    assert full["mfu(%)"] == pytest.approx(logged["mfu(%)"], rel=1e-3)
    assert full["hfu(%)"] == pytest.approx(100 * (work.model_flops + work.block_forward_flops) / (seconds * 4 * 1000), rel=1e-3)
