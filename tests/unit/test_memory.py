"""Memory model: encoder patch merge, trained-encoder activations, and plans that never exceed the budget."""

import numpy as np
import pytest

from pipetune.config import load_hardware, load_model_config
from pipetune.config.model import EncoderConfig
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.data import make_mix
from pipetune.data.batch import batch_meta
from pipetune.data.stream import BatchStream
from pipetune.packing.flops import FlopsModel
from pipetune.plan.mode import Mode
from pipetune.plan.layout.planner_config import PlannerConfig
from pipetune.data.images import ImageSizing


def _heavy(recompute=False):
    model = load_model_config("dip_5b_8b")
    table = analytical_table(model, load_hardware("h100"), tp=4)
    return model, CostModel(table, StageLayout.even(32, 4), recompute_encoder=recompute)


def test_merge_moves_encoder_cost_to_patches_and_backbone_to_tokens():
    kw = dict(n_layers=2, dim=64, ffn_dim=128, n_heads=4, image_size=56, patch_size=14)
    plain, merged = EncoderConfig(**kw), EncoderConfig(**kw, merge=2)
    assert plain.tokens_per_image == merged.patches_per_image == 16 and merged.tokens_per_image == 4
    base = load_model_config("7b")
    fp = FlopsModel(base.__class__(name="a", backbone=base.backbone, encoder=plain))
    fm = FlopsModel(base.__class__(name="b", backbone=base.backbone, encoder=merged))
    assert fp.vit_forward_per_image() == fm.vit_forward_per_image()
    with pytest.raises(ValueError, match="merge"):
        EncoderConfig(**{**kw, "image_size": 42}, merge=2)


def test_trained_encoder_activations_are_hundreds_of_mib_per_image():
    _, cost = _heavy()
    assert 200 * 2**20 < cost.encoder_bytes_per_image < 2**30
    _, rc = _heavy(recompute=True)
    assert rc.encoder_bytes_per_image < cost.encoder_bytes_per_image / 4


def test_recompute_adds_encoder_forward_to_backward():
    _, cost = _heavy()
    _, rc = _heavy(recompute=True)
    from pipetune.cost.cost_model import MicroBatchShapes

    shapes = MicroBatchShapes(np.array([1000]), np.array([0]), np.array([1000]), np.array([3]))
    a, b = cost.stage_costs(shapes), rc.stage_costs(shapes)
    assert np.isclose(b.encoder_bwd[0, 0] - a.encoder_bwd[0, 0], a.encoder[0, 0]) and b.bwd[0, 0] == a.bwd[0, 0]


def test_heavy_trained_encoder_plans_never_exceed_budget():
    model, cost = _heavy(recompute=True)
    data = make_mix("datamix3", 3000, 0)
    stream = BatchStream(num_rows=len(data), gbs=64, seed=0)
    # Memory where the worst-case token bound admits mbs 2 but mbs 2's images do not fit.
    cfg = PlannerConfig(mode=Mode.PIPETUNE, max_seq_len=4096, memory_bytes=50 * 2**30)
    planner = cfg.build(model, cost)
    fixed = PlannerConfig(mode=Mode.BALANCED, max_seq_len=4096, memory_bytes=50 * 2**30, mbs=planner.max_mbs).build(model, cost)
    over = 0
    for step in range(3):
        meta = batch_meta(data, stream, step, images=ImageSizing.for_model(model), max_seq_len=4096)
        plan = planner.plan(meta)
        assert max(plan.peak_bytes) <= planner.budget
        over += max(fixed.plan(meta).peak_bytes) > planner.budget
    assert over > 0, "the test needs a fixed mbs that would run out of memory"
