"""The FLOPs model against torch's FlopCounterMode on real TorchTitan layers."""

import time
from dataclasses import replace

import numpy as np
import pytest
import torch
import torchtitan.components.metrics as titan_metrics
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC

from pipetune.config.model import BackboneConfig, EncoderConfig, ModelConfig
from pipetune.packing import FlopsModel
from torchtitan_patches.compat import cpu_device
from torchtitan_patches.data.micro_batch import PackedMicroBatch
from torchtitan_patches.titan.metrics import EXTRA_FORMULAS, FORMULAS, RecomputeCount, StepWork, WorkMetricsProcessor
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
    one_layer = dense.block_forward_parts(lengths).sum() / tiny.backbone.n_layers
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
# Blocks' forward (what full activation checkpointing recomputes), as (matmuls with weights, attention):
# decoder layer over the text document (2*3*160, 4*4*6) = (960, 96), over the image document
# (2*6*160, 4*4*21) = (1920, 336); the ViT layer (256, 128) when trained (a frozen ViT runs without
# autograd, so nothing of it is recomputed).
TEXT, IMAGE_DOC, VIT, PROJECTOR = 3888, 8208, 448, 576
BLOCKS_TEXT, BLOCKS_IMAGE_DOC, VIT_LAYER = (960, 96), (1920, 336), (256, 128)


@pytest.mark.parametrize("frozen, vit", [(True, VIT), (False, 3 * VIT)])
def test_training_flops_match_a_hand_count(frozen, vit):
    f = FlopsModel(_hand_model(frozen))
    assert f.training_flops([3]) == TEXT  # text only
    assert f.training_flops([3, 6], [4]) == TEXT + IMAGE_DOC + vit + PROJECTOR
    assert f.block_forward_parts([3]).tolist() == [*BLOCKS_TEXT, 0, 0]
    backbone = np.add(BLOCKS_TEXT, BLOCKS_IMAGE_DOC).tolist()
    assert f.block_forward_parts([3, 6], [4]).tolist() == [*backbone, *((0, 0) if frozen else VIT_LAYER)]


class _Dims:
    non_data_parallel_size = 4  # pipeline x tensor parallel ranks per replica


SECONDS = 100.0  # since a log's previous one, give or take the call's own time


def _processor(monkeypatch, activation_checkpoint, model_parts=()) -> WorkMetricsProcessor:
    """TorchTitan's processor as the trainers build it, at 1000 FLOP/s per device."""
    monkeypatch.setattr(titan_metrics, "device_type", "cpu")  # as the trainer's use_cpu does, for this test only
    monkeypatch.setattr(titan_metrics, "device_module", cpu_device._cpu_device_module())
    processor = WorkMetricsProcessor.Config(peak_tflops=1e-9).build(parallel_dims=_Dims())
    processor.count_recompute(activation_checkpoint, model_parts)
    return processor


def _log(processor: WorkMetricsProcessor, work: StepWork) -> dict:
    """What the processor logs for one step of ``work`` that took ``SECONDS``."""
    logged = {}
    processor.logger.log = lambda metrics, step: logged.update(metrics)
    processor.add_work(work)
    processor.time_last_log = time.perf_counter() - SECONDS
    processor.data_loading_times.append(0.0)
    processor.log(1, 1.0, 1.0, 1.0)
    assert processor.work == StepWork()  # the next log counts from zero
    return logged


def test_step_work_leaves_padding_out_and_mfu_is_model_flops_over_peak_time(monkeypatch):
    """A packed micro-batch (a 3-token text, a 6-token document with one 2 x 2-patch image, then
    a 3-token padding document), and the MFU TorchTitan's processor logs from its work."""
    f = FlopsModel(_hand_model(frozen=True))
    mb = PackedMicroBatch(tokens=torch.zeros(12, dtype=torch.long), labels=torch.zeros(12, dtype=torch.long), positions=torch.zeros(12, dtype=torch.long),
                          cu_seqlens=torch.tensor([0, 3, 9, 12]), pixel_values=torch.zeros(4, 4), image_token_index=torch.arange(5, 9),
                          sample_ids=torch.tensor([7, 8]), image_grids=((2, 2),))
    work = StepWork.of(f, [mb, mb])
    assert work == StepWork(2 * (TEXT + IMAGE_DOC + VIT + PROJECTOR), 18, 6, *(2 * np.add(BLOCKS_TEXT, BLOCKS_IMAGE_DOC)).tolist())
    assert work.padding_share == 0.25
    assert StepWork.from_list(work.as_list()) == work

    logged = _log(_processor(monkeypatch, None), work)
    assert logged["throughput(tps)"] == pytest.approx(18 / (SECONDS * 4), rel=1e-3)  # real tokens per second per device
    assert logged["mfu(%)"] == pytest.approx(100 * work.model_flops / (SECONDS * 4 * 1000), rel=1e-3)
    assert logged["padding(%)"] == 25.0
    assert "hfu(%)" not in logged  # nothing recomputed
    assert "hfu(%)" not in _log(_processor(monkeypatch, MemoryBudgetAC.Config()), work)  # the compiler decides
    assert "hfu(%)" not in _log(_processor(monkeypatch, SelectiveAC.Config()), work)  # no block counted: shares not known
    full = _log(_processor(monkeypatch, FullAC.Config()), work)
    assert full["mfu(%)"] == pytest.approx(logged["mfu(%)"], rel=1e-3)
    assert full["hfu(%)"] == pytest.approx(100 * (work.model_flops + work.block_forward.sum()) / (SECONDS * 4 * 1000), rel=1e-3)


def _layer_part(backbone) -> torch.nn.Module:
    """A model part holding one TorchTitan decoder layer as ``layers.0`` (what AC policies wrap)."""
    torch.manual_seed(0)
    layer = decoder_layer_config(backbone, max_seq_len=1024, attention_backend="sdpa").build()
    layer.init_states()
    return torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"0": layer})})


def _train(part, lengths, backend) -> tuple[int, torch.Tensor]:
    """FlopCounterMode's total (with the attention kernels it lacks) of a forward + backward of the
    part over packed documents of ``lengths``, and the input's gradient."""
    torch.manual_seed(1)
    cu = torch.tensor([0, *np.cumsum(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    x = torch.randn(1, sum(lengths), part["layers"]["0"].attention_norm.normalized_shape[0], requires_grad=True)
    with sdpa_kernel(backend), FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS) as fc:
        part["layers"]["0"](x, varlen_metadata(cu), pos).pow(2).sum().backward()
    return fc.get_total_flops(), x.grad


# MATH: attention as bmm, which TorchTitan's SAC policy saves; FLASH_ATTENTION: CPU SDPA's flash kernel, which it recomputes.
BACKENDS = [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths", [[100, 150, 50, 200], [511], [3, 7, 1, 64, 300]])
def test_selective_ac_count_is_what_the_recompute_adds(tiny, backend, lengths):
    """Under TorchTitan's SelectiveAC the count sees exactly the recomputed ops: its recomputed
    FLOPs are FlopCounterMode's total with SAC minus without AC, and its forward, by part, is the
    FLOPs model's one layer (dense attention, as FlopCounterMode counts). Counting changes no gradient."""
    plain, plain_grad = _train(_layer_part(tiny.backbone), lengths, backend)
    part = _layer_part(tiny.backbone)
    SelectiveAC(SelectiveAC.Config()).apply(part)
    count = RecomputeCount([part])
    with_sac, grad = _train(part, lengths, backend)
    count.stop()
    assert with_sac > plain  # SAC recomputes something here
    assert count.recomputed.sum() == pytest.approx(with_sac - plain, rel=1e-9)
    one_layer = FlopsModel(tiny, causal=False).block_forward_parts(lengths) / tiny.backbone.n_layers
    assert count.forward == pytest.approx(one_layer, rel=1e-9)
    torch.testing.assert_close(grad, plain_grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_ac_hfu_adds_the_counted_shares(monkeypatch, tiny, backend):
    """The processor counts the first step only (until its ``add_work``), then logs hfu = model FLOPs
    + each part's counted share of the steps' block forward FLOPs: in FlopCounterMode's dense
    convention, exactly what the recompute adds, in the counted step and in a later, uncounted one."""
    one_layer = FlopsModel(replace(tiny, backbone=replace(tiny.backbone, n_layers=1)), causal=False)
    part = _layer_part(tiny.backbone)
    SelectiveAC(SelectiveAC.Config()).apply(part)
    processor = _processor(monkeypatch, SelectiveAC.Config(), [part])
    count, plain = processor.counting, _layer_part(tiny.backbone)

    def step(lengths) -> tuple[float, float]:
        """Train a step and hand its work over: its model FLOPs and the FLOPs SAC's recompute added."""
        added = _train(part, lengths, backend)[0] - _train(plain, lengths, backend)[0]
        processor.add_work(StepWork(one_layer.training_flops(lengths), sum(lengths), 0, *one_layer.block_forward_parts(lengths).tolist()))
        return one_layer.training_flops(lengths), added

    model_1, added_1 = step([100, 150, 50, 200])
    assert count.recomputed.sum() == pytest.approx(added_1, rel=1e-9)
    model_2, added_2 = step([3, 7, 1, 64, 300])
    assert count.recomputed.sum() == pytest.approx(added_1, rel=1e-9)  # not counted: the wrappers have their own context_fn back
    logged = _log(processor, StepWork())
    assert logged["hfu(%)"] == pytest.approx(100 * (model_1 + model_2 + added_1 + added_2) / (SECONDS * 4 * 1000), rel=1e-3)
    assert processor.recompute_share[:2] == pytest.approx(count.recomputed[:2] / count.forward[:2])
    assert np.isnan(processor.recompute_share[2:]).all()  # no ViT here: its shares are not known


def test_varlen_attention_formula_is_the_dense_per_document_count(tiny):
    """TorchTitan's varlen attention op (CUDA only, so not run here) counts per document, as
    FlopCounterMode counts the flash kernel it wraps (dense, GQA)."""
    b, lengths = tiny.backbone, [5, 1, 12, 7]
    q = torch.zeros(sum(lengths), b.n_heads, b.head_dim)
    kv = torch.zeros(sum(lengths), b.n_kv_heads, b.head_dim)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    flops = FORMULAS[torch.ops.torch_attn._varlen_attn](q, kv, kv, cu, None, max(lengths), max(lengths))
    assert flops == FlopsModel(tiny, causal=False).attention_per_pair * sum(n * n for n in lengths)
