"""Linear-attention layers (Qwen3.5's Gated DeltaNet) in planning: the backbone config that declares
them, their FLOPs, their cost (linear in a stage's tokens, blind to how they split into documents,
where full attention is quadratic per document), the layout search's pricing of stages by the kinds
of layers they hold, calibration of their curve, and the profiler's curve on this CPU."""

import dataclasses
import itertools
import json

import numpy as np
import pytest

from pipetune.calibrate.action_fit import Observation, calibrate
from pipetune.config import load_hardware, load_model_config
from pipetune.config.model import BackboneConfig, ConfigError, LinearAttentionConfig, ModelConfig
from pipetune.cost import CostModel, MicroBatchShapes, StageLayout, analytical_table
from pipetune.cost.latency_table import Curve, LatencyTable
from pipetune.data.samples import SampleTable
from pipetune.packing.flops import FlopsModel
from pipetune.plan.layout.layout_search import LayoutSearch, sample_batches

SHAPES = dict(n_key_heads=16, n_value_heads=32, key_head_dim=128, value_head_dim=128)


def qwen_like(linear=(0, 1, 2, 4, 5, 6), n_layers=8, encoder=None) -> ModelConfig:
    """A Qwen3.5-like backbone of width 4096 (at Qwen3.5 ``debugmodel``'s width of 256 an H100
    estimate is all kernel launches), full attention every 4th layer by default."""
    la = LinearAttentionConfig(layers=tuple(linear), **SHAPES) if linear else None
    backbone = BackboneConfig(n_layers=n_layers, dim=4096, ffn_dim=12288, n_heads=16, n_kv_heads=4, vocab_size=2048, output_gate=True,
                              linear_attention=la)
    return ModelConfig(name="qwen_like", backbone=backbone, encoder=encoder)


def one_mb(docs) -> MicroBatchShapes:
    docs = np.asarray(docs)
    return MicroBatchShapes(docs, np.zeros(len(docs), np.int64), np.array([docs.sum()]), np.array([0]))


def stage_seconds(cost: CostModel, docs) -> np.ndarray:
    c = cost.stage_costs(one_mb(docs))
    return (c.fwd + c.bwd)[0]


# -- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize("edit,message", [
    (dict(layers=[8]), r"layers \[8\] are not layers of this 8-layer backbone"),
    (dict(layers=[-1]), r"layers \[-1\] are not layers"),
    (dict(layers=[]), "non-empty list of layer indices"),
    (dict(layers=[1, 1]), "lists a layer twice"),
    (dict(layers=[1.5]), "non-empty list of layer indices"),
    (dict(n_key_heads=3), "n_value_heads=32 is not divisible by n_key_heads=3"),
    (dict(chunk=0), "chunk must be > 0"),
    (dict(width=3), r"unknown keys \['width'\]"),
])
def test_bad_linear_attention_is_refused_with_the_reason(edit, message):
    table = {"layers": [0, 1, 2], **SHAPES, **edit}
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(qwen_like().backbone, linear_attention=table)


def test_a_toml_model_declares_its_linear_layers_and_round_trips(tmp_path):
    path = tmp_path / "hybrid.toml"
    path.write_text('name = "hybrid"\n[backbone]\nn_layers=4\ndim=128\nffn_dim=384\nn_heads=4\nn_kv_heads=2\nvocab_size=512\n'
                    "[backbone.linear_attention]\nlayers=[2, 0, 1]\nn_key_heads=2\nn_value_heads=4\nkey_head_dim=32\nvalue_head_dim=32\n")
    m = load_model_config(path)
    assert m.backbone.linear_layers == (0, 1, 2) and m.backbone.n_full_layers == 1
    assert ModelConfig.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    plain = dataclasses.replace(m, backbone=dataclasses.replace(m.backbone, linear_attention=None))
    assert plain.fingerprint() != m.fingerprint()  # a table of the all-full-attention model does not fit this one
    path.write_text(path.read_text().replace("layers=[2, 0, 1]", "layers=[0, 7]"))
    with pytest.raises(ConfigError, match=r"hybrid.toml \[backbone\].*layers \[7\] are not layers of this 4-layer backbone"):
        load_model_config(path)


def test_tensor_parallelism_must_split_the_linear_heads_too():
    qwen_like().check_tp(2)
    with pytest.raises(ConfigError, match="n_key_heads=16"):
        dataclasses.replace(qwen_like(), backbone=dataclasses.replace(qwen_like().backbone, n_heads=32, n_kv_heads=32)).check_tp(32)


# -- FLOPs (the packing weight) -----------------------------------------------------------------


def test_packing_flops_count_attention_pairs_in_full_layers_only():
    """Splitting a document changes its FLOPs only through the full-attention layers' pairs: not at all
    when every layer is linear (chunk-aligned pieces), by n_full / n_layers of the all-full change
    in a hybrid."""
    L, pieces = 4096, [1024, 512, 2560]
    split = lambda f: f.sequence_flops([L])[0] - f.sequence_flops(pieces).sum()  # noqa: E731
    all_linear = FlopsModel(qwen_like(linear=range(8)))
    assert split(all_linear) == pytest.approx(0.0, abs=1e-6 * all_linear.sequence_flops([L])[0])
    all_full, hybrid = FlopsModel(qwen_like(linear=())), FlopsModel(qwen_like())
    assert split(all_full) > 0
    assert split(hybrid) == pytest.approx(2 / 8 * split(all_full), rel=1e-9)


def test_linear_attention_flops_are_what_the_kernel_multiplies():
    """``linear_attention_per_token`` against torch's FLOP counter on the gated delta rule the model
    runs off CUDA (``gated_delta_cpu``), documents padded to whole chunks."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from torchtitan_patches.models.qwen3_5.gated_delta_cpu import gated_delta_rule

    la = LinearAttentionConfig(layers=(0,), n_key_heads=1, n_value_heads=2, key_head_dim=32, value_head_dim=16)
    model = ModelConfig(name="m", backbone=dataclasses.replace(qwen_like().backbone, linear_attention=la))
    bounds = [0, 64, 200, 256]  # 1, 3 and 1 chunks: 320 tokens computed for 256
    T, H, K, V = bounds[-1], la.n_value_heads, la.key_head_dim, la.value_head_dim
    q, k = torch.randn(1, T, H, K), torch.randn(1, T, H, K)
    v, g, beta = torch.randn(1, T, H, V), -torch.rand(1, T, H), torch.rand(1, T, H)
    with FlopCounterMode(display=False) as counter:
        gated_delta_rule(q, k, v, g, beta, bounds=bounds, chunk=la.chunk)
    chunked = la.chunked(np.diff(bounds)).sum()
    assert chunked == 320
    assert counter.get_total_flops() == FlopsModel(model).linear_attention_per_token * chunked


# -- cost ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def h100():
    return load_hardware("h100")


def test_a_linear_stage_grows_linearly_in_document_length_a_full_stage_quadratically(h100):
    """Stage 0 holds four linear-attention layers, stage 1 four full-attention ones."""
    cost = CostModel(analytical_table(qwen_like(linear=(0, 1, 2, 3)), h100), StageLayout.even(8, 2))
    lengths = np.arange(1, 9) * 2048
    t = np.array([stage_seconds(cost, [L]) for L in lengths])
    curvature = np.diff(t, 2, axis=0)
    assert np.abs(curvature[:, 0]).max() < 1e-9 * t[:, 0].max()  # linear in the length
    assert (curvature[:, 1] > 0).all()  # convex: attention pairs grow with the length squared
    # the part of stage 1 that depends on how tokens split into documents grows ~ quadratically
    excess = {L: stage_seconds(cost, [L])[1] - stage_seconds(cost, [64] * (L // 64))[1] for L in (8192, 16384)}
    assert excess[16384] / excess[8192] > 3.5


def test_a_linear_only_stage_prices_equal_tokens_equally_whatever_the_documents(h100):
    cost = CostModel(analytical_table(qwen_like(linear=(0, 1, 2, 3)), h100), StageLayout.even(8, 2))
    packings = [[4096], [1024, 3072], [64] * 64, [2048, 1024, 512, 512]]  # whole chunks: the kernel pads nothing
    t = np.array([stage_seconds(cost, docs) for docs in packings])
    assert t[:, 0] == pytest.approx(t[0, 0], rel=1e-12)
    assert (t[0, 1] > t[1:, 1]).all()  # the full-attention stage pays more for the one long document
    # the kernel pads each document to whole chunks: equal tokens in more chunks cost more
    assert stage_seconds(cost, [1, 1, 1, 1])[0] > stage_seconds(cost, [4])[0]
    assert stage_seconds(cost, [65, 63])[0] > stage_seconds(cost, [64, 64])[0]


def test_in_a_hybrid_stage_only_its_full_layers_pay_per_document(h100):
    """Qwen3.5's pattern: each stage of 4 holds 1 full-attention and 3 linear-attention layers, so
    its sensitivity to the document split is a quarter of an all-full-attention stage's."""
    hybrid = CostModel(analytical_table(qwen_like(), h100), StageLayout.even(8, 2))
    full = CostModel(analytical_table(qwen_like(linear=()), h100), StageLayout.even(8, 2))
    for L in (2048, 16384):
        excess = [stage_seconds(c, [L]) - stage_seconds(c, [64] * (L // 64)) for c in (hybrid, full)]
        assert excess[0] == pytest.approx(excess[1] / 4, rel=1e-9)


def test_a_stage_pays_the_layer_seconds_of_the_layers_it_holds(h100):
    """What the layout search prices per layer: moving layers between stages moves exactly their
    ``layer_seconds``; on a long document a full-attention layer costs more than a linear one."""
    table = analytical_table(qwen_like(), h100)
    shapes = MicroBatchShapes(np.array([6000, 300, 2000]), np.array([0, 0, 1]), np.array([6300, 2000]), np.array([0, 0]))
    per_layer = CostModel(table, StageLayout.even(8, 2)).layer_seconds(shapes)
    linear = list(table.model.backbone.linear_layers)
    assert np.allclose(per_layer[linear], per_layer[0]) and (per_layer[[3, 7]] > per_layer[0]).all()
    rest_of_stage = []
    for sizes in ([1, 7], [3, 5], [4, 4], [6, 2]):
        cost = CostModel(table, StageLayout.from_sizes(sizes))
        c = cost.stage_costs(shapes)
        rest_of_stage.append((c.fwd + c.bwd).sum(axis=0) - [per_layer[lo:hi].sum() for lo, hi in cost.layout.layer_ranges])
    assert np.allclose(rest_of_stage, rest_of_stage[0], rtol=1e-12)


def test_balanced_split_is_the_most_even_contiguous_split():
    rng = np.random.default_rng(0)
    for _ in range(30):
        n, S = int(rng.integers(2, 9)), int(rng.integers(1, 4))
        S = min(S, n)
        layer_s, fixed = rng.uniform(0.1, 3.0, n), rng.uniform(0.0, 5.0, S)
        best = StageLayout.balanced(fixed, layer_s)

        def spread(layout):
            return sum((f + layer_s[lo:hi].sum()) ** 2 for f, (lo, hi) in zip(fixed, layout.layer_ranges))

        every = [StageLayout.from_sizes(np.diff([0, *cuts, n])) for cuts in itertools.combinations(range(1, n), S - 1)]
        assert spread(best) == pytest.approx(min(spread(x) for x in every), rel=1e-12)


def test_the_layout_search_gives_the_stage_with_the_full_attention_layers_fewer_layers(h100):
    """On long documents a full-attention layer costs more than a linear one: the search's start puts
    fewer layers on the stage that holds the full-attention ones, wherever they are, and predicts
    it faster than the even split; with layers of one kind it stays even."""
    rng = np.random.default_rng(0)
    n = 64
    data = SampleTable.build(ids=np.arange(n), source=np.zeros(n, np.int64), source_names=("text",),
                             text_tokens=rng.integers(8192, 16384, n), num_images=np.zeros(n, np.int64))
    starts = {}
    for name, linear in (("full at the end", range(12)), ("full at the start", range(4, 16)), ("one kind", range(16))):
        model = qwen_like(linear=linear, n_layers=16)
        cost = CostModel(analytical_table(model, h100), StageLayout.even(16, 2))
        sample = sample_batches(data, model, gbs=8, max_seq_len=16384, count=2, seed=0)
        search = LayoutSearch(model, cost, sample, max_seq_len=16384, memory_bytes=80 * 2**30, max_mbs=1)
        start = search.balanced_start()
        starts[name] = start.layers_per_stage()
        if name != "one kind":
            assert search.score(start).iter_s < search.score(StageLayout.even(16, 2)).iter_s
    assert starts == {"full at the end": [9, 7], "full at the start": [7, 9], "one kind": [8, 8]}


def test_calibration_recovers_the_linear_attention_scale():
    model = qwen_like()

    def table(scales):
        def c(x, grid, fwd):
            return Curve(x, np.asarray(grid, float), np.asarray(fwd, float), 2 * np.asarray(fwd, float))

        return LatencyTable(
            model=model,
            curves={"attention": c("seq_len", [1, 10, 100], [1e-3, 10e-3, 100e-3]), "rest": c("packed_len", [10, 1000], [1e-2, 5e-2]),
                    "embedding": c("packed_len", [10, 1000], [1e-4, 1e-4]), "head": c("packed_len", [10, 1000], [5e-3, 5e-3]),
                    "linear_attention": c("chunked_len", [64, 6400], [2e-3, 0.2])},
            memory=dict.fromkeys(("layer_bytes_per_token", "embedding_bytes_per_token", "head_bytes_per_token", "image_feature_bytes",
                                  "projector_bytes_per_image"), 1.0),
            p2p={"latency_s": 1e-4, "bytes_per_s": 1e9}, device="test", dtype="float32", scales=scales)

    layout = StageLayout.from_sizes([3, 5])
    truth = CostModel(table({"attention": 1.3, "rest": 0.8, "linear_attention": 1.5}), layout)
    rng = np.random.default_rng(0)
    obs = []
    for _ in range(30):
        sh = one_mb(rng.integers(1, 100, size=int(rng.integers(1, 6))))
        c = truth.stage_costs(sh)
        obs += [Observation(sh, float(c.fwd[0, s] + c.bwd[0, s]), stage=s) for s in range(2)]
    base = table({})
    cal, report = calibrate(base, CostModel(base, layout), obs)
    assert report.mean_abs_pct_error_after < 1 < report.mean_abs_pct_error_before
    assert cal.scale("linear_attention") == pytest.approx(1.5, rel=0.03)


# -- profiling ----------------------------------------------------------------------------------


def test_the_profiler_measures_the_linear_curve_and_the_cost_model_reads_it(tmp_path):
    """Small shapes on this CPU: the model's own Gated DeltaNet layer (its CPU path) is timed over
    whole chunks; the cost model then prices a linear-only stage by tokens, whatever the documents."""
    from pipetune.cost import load_latency_table
    from profiling.profile_layers import ProfileConfig, measurement_tasks, run_profile

    la = LinearAttentionConfig(layers=(0, 1), n_key_heads=1, n_value_heads=2, key_head_dim=16, value_head_dim=16, chunk=16)
    model = ModelConfig(name="small_hybrid", backbone=BackboneConfig(n_layers=4, dim=64, ffn_dim=128, n_heads=4, n_kv_heads=2,
                                                                    vocab_size=256, output_gate=True, linear_attention=la))
    cfg = ProfileConfig(max_seq_len=64, max_tokens=128, max_images=0, points=3, repeats=3, warmup=1, p2p=False)
    assert not any(c.startswith("linear") for c, _ in measurement_tasks(load_model_config("tiny"), cfg))  # other models: as before
    run_profile(model, cfg, tmp_path / "t.json", progress=False)
    table = load_latency_table(tmp_path / "t.json", model=model, tp=1)
    curve = table.curves["linear_attention"]
    assert curve.x == "chunked_len" and (curve.grid % 16 == 0).all() and curve.grid[-1] >= 128
    assert curve.fwd[-1] > 0 and curve.bwd[-1] > 0
    cost = CostModel(table, StageLayout.even(4, 2))
    assert stage_seconds(cost, [96])[0] == pytest.approx(stage_seconds(cost, [32, 48, 16])[0], rel=1e-12)
    assert stage_seconds(cost, [128])[0] > stage_seconds(cost, [16])[0]
