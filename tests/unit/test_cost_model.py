import numpy as np
import pytest

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, LatencyTable, MicroBatchShapes, StageLayout, analytical_table
from pipetune.calibrate.action_fit import Observation, Observed, Part, calibrate
from pipetune.cost.cost_model import lookup
from pipetune.cost.latency_table import Curve, table_from_dict
from pipetune.packing import Packing
from pipetune.packing.flops import attention_pairs


def simple_table(model, scales=None):
    def c(x, grid, fwd):
        grid, fwd = np.asarray(grid, float), np.asarray(fwd, float)
        return Curve(x, grid, fwd, 2 * fwd)

    return LatencyTable(
        model=model,
        curves={
            "attention": c("seq_len", [1, 10, 100], [1e-3, 10e-3, 100e-3]),
            "rest": c("packed_len", [10, 100, 1000], [1e-2, 2e-2, 11e-2]),
            "embedding": c("packed_len", [10, 1000], [1e-4, 1e-4]),
            "head": c("packed_len", [10, 1000], [5e-3, 5e-3]),
            "projector": c("images", [1, 10], [1e-3, 1e-3]),
            "encoder": c("images", [1, 2, 4], [3e-3, 4e-3, 6e-3]),
        },
        memory={"layer_bytes_per_token": 10.0, "embedding_bytes_per_token": 1.0, "head_bytes_per_token": 2.0,
                "image_feature_bytes": 100.0, "projector_bytes_per_image": 7.0},
        p2p={"latency_s": 1e-4, "bytes_per_s": 1e9},
        device="test",
        dtype="float32",
        scales=scales or {},
    )


def shapes_of(docs_per_mb, images_per_mb):
    lengths = np.concatenate([np.asarray(d) for d in docs_per_mb])
    mb = np.repeat(np.arange(len(docs_per_mb)), [len(d) for d in docs_per_mb])
    tokens = np.array([sum(d) for d in docs_per_mb])
    return MicroBatchShapes(lengths, mb, tokens, np.asarray(images_per_mb))


def test_stage_costs_by_hand(tiny):
    cm = CostModel(simple_table(tiny), StageLayout.even(4, 2))
    c = cm.stage_costs(shapes_of([[10, 40], [100]], [2, 0]))
    # micro-batch 0: attention 10 + 40 ms, rest(50) = 10 + (40/90) * 10 ms; 2 layers per stage
    layer0 = (10e-3 + 40e-3) + (1e-2 + 40 / 90 * 1e-2)
    assert c.fwd[0, 0] == pytest.approx(2 * layer0 + 1e-4 + 1e-3)  # + embedding + projector
    assert c.fwd[0, 1] == pytest.approx(2 * layer0 + 5e-3)  # + head
    assert c.bwd[0, 1] == pytest.approx(2 * c.fwd[0, 1])
    layer1 = 100e-3 + 2e-2
    assert c.fwd[1, 0] == pytest.approx(2 * layer1 + 1e-4)  # no images: no projector
    assert c.encoder[:, 0].tolist() == pytest.approx([4e-3, 0.0])
    assert c.activation_bytes[0].tolist() == pytest.approx([50 * 2 * 10 + 50 * 1 + 2 * 7, 50 * 2 * 10 + 50 * 2])
    assert c.image_feature_bytes.tolist() == [200.0, 0.0]
    assert c.p2p[1] == pytest.approx(1e-4 + 100 * tiny.backbone.dim * 4 / 1e9)
    assert c.extrapolated == 0


def test_lookup_interpolates_clamps_and_extrapolates_by_flops():
    curve = Curve("seq_len", np.array([2.0, 4.0]), np.array([1.0, 3.0]), np.array([2.0, 6.0]))
    v, n = lookup(curve, np.array([2, 3, 4, 1, 0, 8]), "fwd")
    assert v[:3].tolist() == [1.0, 2.0, 3.0] and n == 1
    assert v[3] == 1.0 and v[4] == 0.0  # below the grid: first point; zero size: free
    assert v[5] == pytest.approx(3.0 * attention_pairs(np.array([8]))[0] / attention_pairs(np.array([4]))[0])
    lin = Curve("packed_len", np.array([2.0, 4.0]), np.array([1.0, 3.0]), np.array([1.0, 3.0]))
    assert lookup(lin, np.array([12]), "bwd")[0][0] == pytest.approx(9.0)


def test_extrapolation_is_counted(tiny):
    cm = CostModel(simple_table(tiny), StageLayout.even(4, 2))
    assert cm.stage_costs(shapes_of([[500, 800]], [8])).extrapolated > 0


def test_shapes_from_a_packing_and_take(tiny):
    from pipetune.data import SampleTable

    t = SampleTable.build(ids=[1, 2, 3], source=[0, 0, 0], source_names=("s",), text_tokens=[5, 6, 7],
                          num_images=[1, 0, 2], tokens_per_image=10)
    s = MicroBatchShapes.from_packing(t, Packing.from_groups([[2], [0, 1]], 100))
    assert s.tokens.tolist() == [27, 21] and s.images.tolist() == [2, 1]
    sub = s.take(np.array([1]))
    assert sub.tokens.tolist() == [21] and sorted(sub.doc_lengths.tolist()) == [6, 15] and set(sub.doc_mb) == {0}


def test_layout_even_split():
    assert StageLayout.even(40, 4).layer_ranges == ((0, 10), (10, 20), (20, 30), (30, 40))
    assert StageLayout.even(10, 4).layers_per_stage() == [2, 3, 3, 2]
    with pytest.raises(ValueError, match="cannot split 3 layers into 4"):
        StageLayout.even(3, 4)
    with pytest.raises(ValueError, match="not contiguous"):
        StageLayout(((0, 2), (3, 4)))


def test_layout_must_match_the_model(tiny):
    with pytest.raises(ValueError, match="covers 6 layers but model 'tiny' has 4"):
        CostModel(simple_table(tiny), StageLayout.even(6, 2))


@pytest.mark.parametrize("hw", ["a100", "h100", "h200"])
@pytest.mark.parametrize("name,tp", [("3b", 1), ("7b", 4), ("13b", 4), ("13b", 1)])
def test_analytical_presets_are_valid_estimates(hw, name, tp):
    model = load_model_config(name)
    t = analytical_table(model, load_hardware(hw), tp=tp)
    assert t.estimate and "estimate" in t.device
    again = table_from_dict(t.to_dict())  # passes every loader check
    assert again.model == model and again.tp == tp


def test_analytical_per_token_time_falls_then_flattens():
    """PipeTune Fig. 10: normalised layer latency drops with length, then is flat."""
    t = analytical_table(load_model_config("7b"), load_hardware("a100"), tp=4)
    n = np.array([128, 512, 2048, 8192, 16384], dtype=float)
    per_token = lookup(t.curves["rest"], n, "fwd")[0] / n
    assert (np.diff(per_token) < 0).all()
    assert per_token[0] > 2 * per_token[3]
    assert per_token[3] / per_token[4] < 1.1


def test_analytical_small_micro_batches_pay_fixed_costs():
    model = load_model_config("13b")
    cm = CostModel(analytical_table(model, load_hardware("a100"), tp=4), StageLayout.even(40, 4))
    docs = [300] * 32
    one = cm.stage_costs(shapes_of([docs], [0]))
    many = cm.stage_costs(shapes_of([[d] for d in docs], [0] * 32))
    assert many.fwd.sum() > 1.5 * one.fwd.sum()


@pytest.mark.parametrize("encoder", ["frozen", "trained", "trained+recompute"])
def test_calibration_recovers_known_scales(tiny, encoder):
    """A trained encoder's backward (after its recomputed forward, with recompute) is timed as its own action."""
    from dataclasses import replace

    model = tiny if encoder == "frozen" else replace(tiny, encoder=replace(tiny.encoder, frozen=False))
    recompute = encoder == "trained+recompute"
    layout = StageLayout.even(4, 2)
    truth = CostModel(simple_table(model, scales={"attention": 1.3, "rest": 0.7, "head": 1.1, "encoder": 0.9}), layout,
                      recompute_encoder=recompute)
    base = simple_table(model)
    rng = np.random.default_rng(0)
    obs = []
    for _ in range(20):
        docs = rng.integers(1, 100, size=int(rng.integers(1, 6))).tolist()
        sh = shapes_of([docs], [int(rng.integers(0, 4))])
        c = truth.stage_costs(sh)
        for s in range(2):
            obs.append(Observation(sh, float(c.fwd[0, s] + c.bwd[0, s]), stage=s))
        if sh.images[0]:
            obs.append(Observation(sh, float(c.encoder[0, 0]), kind=Observed.ENCODER, part=Part.FWD))
            if encoder != "frozen":  # the encoder's backward is an action of its own
                obs.append(Observation(sh, float(c.encoder_bwd[0, 0]), kind=Observed.ENCODER, part=Part.BWD))
    cal, report = calibrate(base, CostModel(base, layout, recompute_encoder=recompute), obs)
    # the ridge towards the old factors (see calibration.RIDGE) leaves a small bias, larger for
    # components that are a small part of every timing (the head)
    assert report.mean_abs_pct_error_before > 10 and report.mean_abs_pct_error_after < 1
    for k, v in {"attention": 1.3, "rest": 0.7, "encoder": 0.9}.items():
        assert cal.scale(k) == pytest.approx(v, rel=0.03)
    assert 1.0 < cal.scale("head") <= 1.1
    assert table_from_dict(cal.to_dict()).scales == cal.scales


def test_calibration_recovers_per_call_overheads(tiny):
    layout = StageLayout.even(4, 2)
    truth_table = simple_table(tiny)
    from dataclasses import replace

    truth = CostModel(replace(truth_table, overhead={"fwd_s": 2e-3, "bwd_s": 5e-3}), layout)
    base = simple_table(tiny)
    rng = np.random.default_rng(1)
    obs = []
    for _ in range(30):
        sh = shapes_of([rng.integers(1, 100, size=int(rng.integers(1, 5))).tolist()], [0])
        c = truth.stage_costs(sh)
        for s in range(2):
            obs.append(Observation(sh, float(c.fwd[0, s]), stage=s, part=Part.FWD))
            obs.append(Observation(sh, float(c.bwd[0, s]), stage=s, part=Part.BWD))
    cal, report = calibrate(base, CostModel(base, layout), obs)
    assert cal.fixed("fwd") == pytest.approx(2e-3, rel=0.05) and cal.fixed("bwd") == pytest.approx(5e-3, rel=0.05)
    assert report.mean_abs_pct_error_after < 1.0 < report.mean_abs_pct_error_before
    assert table_from_dict(cal.to_dict()).overhead == cal.overhead


def test_negative_overhead_is_refused(tiny):
    raw = simple_table(tiny).to_dict()
    raw["overhead"] = {"fwd_s": -1.0}
    from pipetune.cost import LatencyTableError

    with pytest.raises(LatencyTableError, match="overhead.fwd_s must be a finite number >= 0"):
        table_from_dict(raw)
