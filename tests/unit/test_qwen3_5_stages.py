"""TorchTitan's Qwen3.5 under pipetune, in one process: planning shapes, MRoPE positions equal to
TorchTitan's own collator's, and the stage wrapper + encoder chunk on a two-part split giving the
unsplit model's loss and gradients (packed documents with images of several grids, a frozen ViT,
a trained merger)."""

import contextlib
import copy
import dataclasses
import sys
import types
import warnings
from unittest import mock

import numpy as np
import pytest
import torch

from pipetune.config.model import ConfigError
from torchtitan_patches.models.packed_attention import varlen_metadata
from torchtitan_patches.models.model_spec import planning_model_config
from torchtitan_patches.data.micro_batch import ImageSpan, patchify
from torchtitan_patches.models.qwen3_5.stages import Qwen35EncoderChunk, Qwen35Stage, block_order, mrope_positions
from torchtitan_patches.models.qwen3_5.spec import qwen3_5_spec

IMAGE_ID = 7
GRID = 4  # patches per image side: 2 x 2 merged tokens per image


@pytest.fixture(autouse=True)
def _plain_tensors(monkeypatch):
    """No device mesh here: TorchTitan's plain-tensor SPMD backend (as the trainer tests' references use)."""
    from torchtitan.distributed import utils as dist_utils

    monkeypatch.setattr(dist_utils, "_spmd_backend", "partial_dtensor")
    warnings.filterwarnings("ignore", message=".*Triton is not supported.*")


@pytest.fixture(scope="module")
def spec():
    return qwen3_5_spec("debugmodel_small_vocab")


def test_planning_shapes_of_debugmodel(spec):
    m = planning_model_config(spec, image_grid=GRID)
    b, e = m.backbone, m.encoder
    assert (b.n_layers, b.dim, b.ffn_dim, b.n_heads, b.n_kv_heads, b.vocab_size, b.output_gate) == (8, 256, 512, 4, 2, 2048, True)
    assert (e.n_layers, e.dim, e.ffn_dim, e.n_heads, e.patch_size, e.patch_temporal, e.merge) == (4, 256, 512, 4, 16, 2, 2)
    assert e.tokens_per_image == 4 and e.projector_hidden == (1024,) and e.merged_dim == 1024
    assert m.projector_params == 1024 * 1024 + 1024 * 256  # the merger's fc1 and fc2
    with pytest.raises(ConfigError, match="spatial_merge_size=2"):
        planning_model_config(spec, image_grid=5)
    from torchtitan.models.qwen3_5 import model_registry

    with pytest.raises(ConfigError, match="head_dim = dim / n_heads"):  # 0.8B: 8 heads of 256 on width 1024
        planning_model_config(model_registry("0.8B"), image_grid=GRID)


def test_planning_shapes_declare_the_gated_delta_net_layers_and_rebuild_them(spec):
    """The linear-attention layers are the spec's DeltaNet layers (TorchTitan's every-4th-layer
    pattern leaves 0-2 and 4-6), and the layer the profiler builds from the planning shapes has the
    spec's DeltaNet parameters, shape for shape, and its CPU path."""
    from torchtitan_patches.models.qwen3_5.cpu_paths import CpuGatedDeltaNet, gated_delta_net

    la = planning_model_config(spec, image_grid=GRID).backbone.linear_attention
    assert la.layers == tuple(i for i, layer in enumerate(spec.model.layers) if layer.delta_net is not None) == (0, 1, 2, 4, 5, 6)
    built = gated_delta_net(planning_model_config(spec, image_grid=GRID).backbone)
    own = spec.model.layers[0].delta_net.build()
    assert isinstance(built, CpuGatedDeltaNet) and type(own) is type(built)
    assert {k: v.shape for k, v in built.state_dict().items()} == {k: v.shape for k, v in own.state_dict().items()}
    half = gated_delta_net(planning_model_config(spec, image_grid=GRID).backbone, tp=2)
    assert half.in_proj_v.out_features == own.in_proj_v.out_features // 2 and half.out_proj.out_features == own.out_proj.out_features


def _torchtitan_mrope(tokens, grid_thw, positions):
    """TorchTitan's own ``MultiModalCollator._build_mrope_positions`` (its module imports
    torchvision, which does not load here; the collator's MRoPE code does not use it). The stand-in
    modules, and every module imported beside them, are gone from ``sys.modules`` afterwards."""
    names = ("torchvision", "torchvision.io", "torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.v2.functional")
    with mock.patch.dict(sys.modules, {name: types.ModuleType(name) for name in names}):
        from torchtitan.hf_datasets.multimodal.mm_collator import MultiModalCollator

        owner = types.SimpleNamespace(patch_order="block", spatial_merge_size=2)
        return MultiModalCollator._build_mrope_positions(owner, tokens, grid_thw, None, positions, image_token_id=IMAGE_ID, video_token_id=-1)


def _tokens(grid) -> int:
    return (grid[0] // 2) * (grid[1] // 2)


def _packed(lengths, images):
    """Tokens, per-document positions, bounds of packed documents and the images' spans (in
    sequence order); ``images``: (document, offset, patch grid) of each image."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(10, 2000, (sum(lengths),), generator=gen)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    spans = tuple(ImageSpan(int(bounds[d] + off), _tokens(g), g) for d, off, g in images)
    for span in spans:
        tokens[span.start:span.start + span.length] = IMAGE_ID
    positions = torch.cat([torch.arange(n) for n in lengths])
    return tokens, positions, bounds, spans


LENGTHS = [40, 23, 50]
# three images in one document, one at a document's start; three grids (never two images without a
# token between them: TorchTitan's collator finds images as runs of image tokens, its data brackets each)
IMAGES = [(0, 3, (4, 4)), (0, 12, (2, 6)), (0, 16, (4, 4)), (2, 0, (6, 4)), (2, 30, (4, 4))]


def _grid_thw(spans):
    return torch.tensor([[1, *span.grid] for span in spans])


def test_mrope_positions_equal_torchtitans_collator():
    tokens, positions, bounds, spans = _packed(LENGTHS, IMAGES)
    ours = mrope_positions(bounds, [(span.start, (span.grid[0] // 2, span.grid[1] // 2)) for span in spans])
    theirs = _torchtitan_mrope(tokens[None], _grid_thw(spans), positions[None])[0]
    assert np.array_equal(ours, theirs.numpy())
    assert ours[bounds[1]].tolist() == [0, 0, 0]  # a document starts from 0


def _model(spec):
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for name, p in model.named_parameters():  # off the zero / one inits, so every parameter gets a gradient
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))), alpha=0.05)
    model.vision_encoder.requires_grad_(False)
    model.vision_encoder.merger.requires_grad_(True)
    return model.double()  # float64: the comparison's bar then says "equal", not "within float32 rounding"


def _split(model, cut):
    """TorchTitan's split in miniature: each part the whole model class with other stages' modules None."""
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    for i in range(cut, len(model.layers)):
        del first.layers[str(i)]
    for i in range(cut):
        del last.layers[str(i)]
    first.norm = first.lm_head = None
    last.tok_embeddings = last.vision_encoder = None
    return first, last


def _case():
    """The packed micro-batch of ``LENGTHS`` and ``IMAGES``: tokens, labels, positions, document
    bounds, image spans (sequence order) and each image's patch rows."""
    tokens, positions, bounds, spans = _packed(LENGTHS, IMAGES)
    gen = torch.Generator().manual_seed(3)
    rows = [torch.from_numpy(patchify(torch.randn(3, h * 16, w * 16, generator=gen, dtype=torch.float64).numpy(), 16, 2)) for _, _, (h, w) in IMAGES]
    return tokens, torch.roll(tokens, -1), positions, bounds, spans, rows


def _unsplit_gradients(model) -> dict:
    """The unsplit TorchTitan model's gradients on ``_case`` (fed as TorchTitan's collator feeds it)."""
    tokens, labels, positions, bounds, spans, rows = _case()
    longest = max(r.shape[0] for r in rows)  # TorchTitan's collator: block order, padded to the largest image, sequence order
    patches = torch.stack([torch.nn.functional.pad(block_order(r, s.grid, 2)[0], (0, 0, 0, longest - r.shape[0])) for r, s in zip(rows, spans)])
    masks = varlen_metadata(torch.from_numpy(bounds))
    logits = model(tokens[None], pixel_values=patches, grid_thw=_grid_thw(spans),
                   attention_masks={"quadratic_attention": masks, "deltanet": masks}, positions=positions[None],
                   mrope_positions=_torchtitan_mrope(tokens[None], _grid_thw(spans), positions[None]),
                   special_tokens={"image_id": IMAGE_ID, "video_id": -1})
    torch.nn.functional.cross_entropy(logits[0], labels).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _pipelined_gradients(first, last, *, device="cpu", compute=None) -> dict:
    """Gradients of the two parts run as pipetune runs them on ``_case`` (the encoder chunk on the
    loader's image order, stage 0, stage 1), on ``device``, under autocast to ``compute`` if given."""
    tokens, labels, positions, bounds, spans, rows = _case()
    tokens, labels, positions, rows = tokens.to(device), labels.to(device), positions.to(device), [r.to(device) for r in rows]
    cast = torch.autocast(torch.device(device).type, dtype=compute) if compute is not None else contextlib.nullcontext()
    dtype = next(first.parameters()).dtype
    masks = varlen_metadata(torch.from_numpy(bounds).to(device))
    order = sorted(range(len(spans)), key=lambda i: spans[i].grid)  # the loader's feature order: images sorted by grid
    spans = tuple(spans[i] for i in order)
    with torch.no_grad(), cast:
        features = Qwen35EncoderChunk(first.vision_encoder, image_grid=GRID)(torch.cat([rows[i].to(dtype) for i in order]), tuple(s.grid for s in spans))
    assert features.shape == (sum(r.shape[0] for r in rows), first.vision_encoder.config.dim)
    s0 = Qwen35Stage(first, is_first=True, is_last=False)
    s1 = Qwen35Stage(last, is_first=False, is_last=True)
    with cast:
        hidden = s0(tokens[None], positions=positions[None], masks=masks, image_features=features, image_spans=spans)
    sent = hidden.detach().requires_grad_()
    with cast:
        loss = torch.nn.functional.cross_entropy(s1(sent, positions=positions[None], masks=masks, image_spans=spans)[0], labels)
    loss.backward()
    hidden.backward(sent.grad)
    with torch.no_grad(), cast:  # stage 0 without images: text embeddings only
        assert s0(tokens[None], positions=positions[None], masks=masks).shape == hidden.shape
    return {n: p.grad for part in (first, last) for n, p in part.named_parameters() if p.grad is not None}


def _worst(pipelined: dict, reference: dict) -> tuple[float, str]:
    assert set(pipelined) == set(reference)
    assert all(g.abs().max() > 0 for g in reference.values())
    return max((float((pipelined[n].double().cpu() - g).norm() / g.norm()), n) for n, g in reference.items())


def test_stages_and_encoder_chunk_give_the_unsplit_models_gradients(spec):
    model = _model(spec)
    first, last = _split(model, 3)
    reference = _unsplit_gradients(model)
    assert any(n.startswith("vision_encoder.merger.") for n in reference) and not any(n.startswith("vision_encoder.layers") for n in reference)
    worst, name = _worst(_pipelined_gradients(first, last), reference)
    assert worst < 1e-10, (name, worst)  # float64: images in grid batches vs padded to the largest differ by rounding only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: fla's Triton kernels run the DeltaNet layers there")
@pytest.mark.parametrize("compute, tol", [(None, 2e-3), (torch.bfloat16, 6e-2)])
def test_stages_on_a_gpu_give_the_cpu_float64_models_gradients(spec, compute, tol):
    """On a GPU the DeltaNet layers run TorchTitan's own forward (fla's chunked Triton kernels) and
    full attention its varlen path in bf16: the parts in float32 (plain, or under bf16 autocast as
    pipetune's executor trains) give the CPU float64 unsplit model's gradients within that
    precision's rounding."""
    model = _model(spec)
    first, last = (part.float().cuda() for part in _split(model, 3))
    reference = _unsplit_gradients(model)
    worst, name = _worst(_pipelined_gradients(first, last, device="cuda", compute=compute), reference)
    assert worst < tol, (name, worst)


def test_moe_flavours_are_refused():
    from torchtitan.models.qwen3_5 import model_registry

    from torchtitan_patches.models.qwen3_5.cpu_paths import with_cpu_paths

    with pytest.raises(ConfigError, match="MoE"):
        with_cpu_paths(model_registry("debugmodel_moe", attn_backend="varlen").model)


def test_qwen3_5_job_is_accepted_and_what_its_mapping_lacks_is_refused():
    from pipetune_configs import config_registry
    from torchtitan_patches.titan.job_checks import refuse_unsupported

    refuse_unsupported(config_registry.qwen3_5_debug())
    for layout in ("separated", "auto"):
        config = config_registry.qwen3_5_debug()
        config.pipetune = dataclasses.replace(config.pipetune, layout=layout)
        with pytest.raises(ValueError, match=f"pipetune.layout {layout}: Qwen3.5 runs with its vision encoder on stage 0"):
            refuse_unsupported(config)
    for degree in ("data_parallel_shard_degree", "tensor_parallel_degree"):  # run in test_qwen3_5_scale_out
        config = config_registry.qwen3_5_debug()
        setattr(config.parallelism, degree, 2)
        refuse_unsupported(config)
