"""Float32 weights under autocast (a reduced-precision job without FSDP): every forward keeps its
own compute-dtype copy of the weights it trains until its backward. The cost model counts those
copies per micro-batch (``CostModel.weight_copy_bytes``); the profiler times the layers the same
way (``ProfileConfig.master_weights``)."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table, load_latency_table
from torchtitan_patches.models.packed_attention import varlen_metadata
from torchtitan_patches.models.reference.vlm import build_stages


def _copies_kept(stage, x, forwards: int) -> int:
    """Bytes of the distinct bf16 tensors shaped like a trained weight that autograd keeps for
    ``forwards`` forwards of ``stage`` under bf16 autocast (37 tokens: no activation has a weight's shape)."""
    shapes = {s for p in stage.parameters() if p.requires_grad for s in (tuple(p.shape), tuple(p.shape)[::-1])}  # saved transposed
    kept: dict[int, int] = {}

    def pack(t):
        if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    masks = varlen_metadata(torch.tensor([0, 20, x.shape[1]]), "cpu")
    outs = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for _ in range(forwards):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outs.append(stage(x, positions=torch.arange(x.shape[1])[None], masks=masks))
    return sum(kept.values())


@pytest.mark.parametrize("forwards", [1, 3])
def test_each_forward_keeps_the_weight_copies_the_cost_model_counts(forwards):
    model = load_model_config("tiny")
    layout = StageLayout.even(model.backbone.n_layers, 2)
    _, stages = build_stages(model, list(layout.layer_ranges), [0, 1], max_seq_len=64, seed=0, attention_backend="sdpa")
    table = analytical_table(model, load_hardware("h100"), tp=1)  # bf16: 2 bytes per copied weight
    counted = CostModel(replace(table, master_weights=True), layout).weight_copy_bytes
    measured = [_copies_kept(stages[0], torch.randint(0, model.backbone.vocab_size, (1, 37)), forwards),
                _copies_kept(stages[1], torch.randn(1, 37, model.backbone.dim, requires_grad=True), forwards)]
    np.testing.assert_array_equal(measured, forwards * counted)
    assert not CostModel(table, layout).weight_copy_bytes.any()  # weights held in bf16 (FSDP): no copies


def test_master_weights_raise_every_micro_batchs_activation_bytes_by_its_copies():
    from pipetune.cost.cost_model import MicroBatchShapes

    model = load_model_config("tiny")
    table = analytical_table(model, load_hardware("h100"), tp=1)
    layout = StageLayout.even(model.backbone.n_layers, 2)
    shapes = MicroBatchShapes(np.array([300, 100]), np.array([0, 1]), np.array([300, 100]), np.array([2, 0]))
    plain, master = CostModel(table, layout), CostModel(replace(table, master_weights=True), layout)
    extra = master.activation_bytes(shapes) - plain.activation_bytes(shapes)
    np.testing.assert_allclose(extra, master.weight_copy_bytes[None, :] + np.array([[master.projector_copy_bytes, 0], [0, 0]]))


def test_the_profiler_times_master_weights_under_autocast_and_records_it(tmp_path):
    from profiling.profile_layers import ProfileConfig, run_profile

    model = load_model_config("tiny")
    small = dict(dtype="bfloat16", max_tokens=512, max_seq_len=256, max_images=4, points=2, warmup=0, repeats=1, p2p=False)
    master = run_profile(model, ProfileConfig(master_weights=True, **small), tmp_path / "m.json", progress=False)
    plain = run_profile(model, ProfileConfig(**small), tmp_path / "p.json", progress=False)
    assert master.master_weights and not plain.master_weights
    assert load_latency_table(tmp_path / "m.json").master_weights and not load_latency_table(tmp_path / "p.json").master_weights
    assert master.memory == plain.memory  # per-token activations; the copies are the cost model's, per micro-batch
