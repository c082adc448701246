"""The profiled input-/weight-gradient split of the backward: the profiler times each backward's
input-gradient part alone (``Curve.bwd_input``), the table keeps and validates it, and the cost
model's ``bwd_input`` (a split backward's ``I``) reads it where present and falls back to
``INPUT_GRAD_SHARE`` where not, exactly as before."""

import json
import warnings
from dataclasses import asdict, replace

import numpy as np
import pytest

from pipetune.cost import CostModel, LatencyTable, LatencyTableError, MicroBatchShapes, StageLayout, load_latency_table
from pipetune.cost.cost_model import INPUT_GRAD_SHARE
from pipetune.cost.latency_table import Curve, table_from_dict

SMALL = dict(points=2, warmup=0, repeats=1, max_tokens=512, max_seq_len=256, max_images=4, p2p=False)


def trained(model):
    return replace(model, encoder=replace(model.encoder, frozen=False))


@pytest.fixture(scope="module", params=["frozen", "trained"])
def profiled(request, tiny, tmp_path_factory):
    """A small CPU fp32 profile of the tiny model, its encoder frozen or trained."""
    from profiling.profile_layers import ProfileConfig, run_profile

    model = tiny if request.param == "frozen" else trained(tiny)
    out = tmp_path_factory.mktemp("prof") / f"{request.param}.json"
    return model, out, run_profile(model, ProfileConfig(**SMALL), out, progress=False)


def test_every_backward_of_a_profile_has_its_input_gradient_part(profiled):
    model, _, table = profiled
    for name, c in table.curves.items():
        if name == "encoder" and model.encoder.frozen:
            assert c.bwd_input is None and not c.bwd.any()  # no backward, nothing to split
            continue
        assert c.bwd_input is not None, name
        assert ((0 <= c.bwd_input) & (c.bwd_input <= c.bwd)).all(), name
        assert (np.diff(c.bwd_input) >= 0).all(), name
    assert not table.curves["embedding"].bwd_input.any()  # token ids take no gradient
    assert table.curves["rest"].bwd_input[-1] > 0


def test_a_profiled_split_round_trips_and_prices_a_split_backward(profiled):
    model, out, table = profiled
    loaded = load_latency_table(out, model=model, tp=1)
    assert loaded.curves.keys() == table.curves.keys()
    for name, c in table.curves.items():
        if c.bwd_input is None:
            assert loaded.curves[name].bwd_input is None and "bwd_input" not in c.to_dict()
        else:
            np.testing.assert_array_equal(loaded.curves[name].bwd_input, c.bwd_input)
    shapes = MicroBatchShapes(np.array([30, 200, 100]), np.array([0, 0, 1]), np.array([230, 100]), np.array([2, 0]))
    c = CostModel(loaded, StageLayout.even(model.backbone.n_layers, 2)).stage_costs(shapes)
    assert ((0 <= c.bwd_input) & (c.bwd_input <= c.bwd)).all() and (c.bwd_input[:, 1] > 0).all()
    assert (c.bwd_input[:, 0] > 0).tolist() == [not model.encoder.frozen, False]  # stage 0: only for a trained encoder's images


def test_an_old_resume_file_of_pairs_is_ignored_not_resumed(tmp_path, tiny):
    import torch

    from profiling import profile_layers as pl

    cfg = pl.ProfileConfig(**SMALL)
    old_header = {"model": tiny.fingerprint(), "config": asdict(cfg), "grids": pl.grids(cfg, tiny), "device": pl._device_name(torch.device("cpu"))}
    old = {f"{c}:{x}": [[1000.0, 1000.0]] for c, x in pl.measurement_tasks(tiny, cfg)}  # (fwd, bwd) pairs
    (tmp_path / "t.json.partial.json").write_text(json.dumps({"header": old_header, "samples": old}))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        table = pl.run_profile(tiny, cfg, tmp_path / "t.json", progress=False)
    assert not [w for w in seen if "resume file" in str(w.message)]  # not corrupt, another layout: profiled afresh
    assert table.curves["rest"].bwd_input is not None and table.curves["head"].fwd[-1] < 1000.0


def hand_table(model, rest_share=None, attention_share=None, scales=None, overhead=None) -> LatencyTable:
    """Curves with bwd = 2 fwd, and where asked a measured bwd_input of that share of bwd."""
    def c(x, grid, fwd, share=None):
        grid, fwd = np.asarray(grid, float), np.asarray(fwd, float)
        return Curve(x, grid, fwd, 2 * fwd, None if share is None else share * 2 * fwd)

    return LatencyTable(
        model=model,
        curves={
            "attention": c("seq_len", [1, 10, 100], [1e-3, 10e-3, 100e-3], attention_share),
            "rest": c("packed_len", [10, 100, 1000], [1e-2, 2e-2, 11e-2], rest_share),
            "embedding": c("packed_len", [10, 1000], [1e-4, 1e-4]),
            "head": c("packed_len", [10, 1000], [5e-3, 5e-3]),
            "projector": c("images", [1, 10], [1e-3, 1e-3]),
            "encoder": c("images", [1, 2, 4], [3e-3, 4e-3, 6e-3]),
        },
        memory=dict.fromkeys(("layer_bytes_per_token", "embedding_bytes_per_token", "head_bytes_per_token", "image_feature_bytes",
                              "projector_bytes_per_image"), 1.0),
        p2p={"latency_s": 1e-4, "bytes_per_s": 1e9}, device="test", dtype="float32", scales=scales or {}, overhead=overhead or {},
    )


# micro-batch 0: documents 10 and 40 (50 tokens) and 2 images; micro-batch 1: one of 100 tokens
SHAPES = MicroBatchShapes(np.array([10, 40, 100]), np.array([0, 0, 1]), np.array([50, 100]), np.array([2, 0]))
REST_BWD = 2 * np.array([1e-2 + 40 / 90 * 1e-2, 2e-2])  # rest's bwd at 50 and 100 tokens
ATTENTION_BWD = 2 * np.array([10e-3 + 40e-3, 100e-3])


def old_bwd_input(cost: CostModel, shapes: MicroBatchShapes) -> np.ndarray:
    """``bwd_input`` as the cost model computed it before the profiled split: fixed shares only."""
    parts, _ = cost.components(shapes)
    out = np.zeros((shapes.num_micro_batches, cost.num_stages)) + cost.table.fixed("bwd") * 0.5
    for name, p in parts.items():
        out += INPUT_GRAD_SHARE[name] * cost.table.scale(name) * p["bwd"]
    out[~(cost.encoder_trainable & (shapes.images > 0)), 0] = 0.0
    return out


@pytest.mark.parametrize("encoder", ["frozen", "trained"])
def test_a_table_without_a_measured_split_prices_it_exactly_as_before(tiny, encoder):
    model = tiny if encoder == "frozen" else trained(tiny)
    table = hand_table(model, scales={"rest": 1.3, "head": 0.7, "attention": 1.1}, overhead={"fwd_s": 1e-3, "bwd_s": 3e-3})
    loaded = table_from_dict(json.loads(json.dumps(table.to_dict())))
    assert all("bwd_input" not in c for c in table.to_dict()["curves"].values())
    assert all(c.bwd_input is None for c in loaded.curves.values())
    cost = CostModel(loaded, StageLayout.even(4, 2))
    np.testing.assert_array_equal(cost.stage_costs(SHAPES).bwd_input, old_bwd_input(cost, SHAPES))


@pytest.mark.parametrize("encoder", ["frozen", "trained"])
def test_a_measured_split_replaces_the_share_by_hand(tiny, encoder):
    model = tiny if encoder == "frozen" else trained(tiny)
    layout, scale = StageLayout.even(4, 2), 1.5  # two layers per stage
    shares = CostModel(hand_table(model, scales={"rest": scale}), layout).stage_costs(SHAPES)
    cost = CostModel(hand_table(model, rest_share=0.3, attention_share=0.1, scales={"rest": scale}), layout)
    measured = cost.stage_costs(SHAPES)
    parts, _ = cost.components(SHAPES)
    np.testing.assert_allclose(parts["rest"]["bwd_input"], 0.3 * parts["rest"]["bwd"], rtol=1e-15)
    np.testing.assert_array_equal(parts["attention"]["bwd_input"], parts["attention"]["bwd"])  # no weights: I is its backward
    # last stage: two layers' attention backward and 0.3 of their rest's (scaled), half the head's
    by_hand = 2 * ATTENTION_BWD + 2 * scale * 0.3 * REST_BWD + 0.5 * 1e-2
    np.testing.assert_allclose(measured.bwd_input[:, 1], by_hand, rtol=1e-12)
    np.testing.assert_allclose(measured.bwd_input[:, 1] - shares.bwd_input[:, 1], 2 * scale * (0.3 - 0.5) * REST_BWD, rtol=1e-12)
    # stage 0: idle unless a trained encoder's images need its input gradient (micro-batch 0's)
    stage0 = [2 * ATTENTION_BWD[0] + 2 * scale * 0.3 * REST_BWD[0] + 0.5 * 2e-3, 0.0] if encoder == "trained" else [0.0, 0.0]
    np.testing.assert_allclose(measured.bwd_input[:, 0], stage0, rtol=1e-12)
    np.testing.assert_array_equal(measured.bwd, shares.bwd)  # the split moves work between I and W only


def test_beyond_the_grid_the_measured_split_grows_with_its_backward(tiny):
    layout = StageLayout.even(4, 2)
    far = MicroBatchShapes(np.array([500, 1500]), np.array([0, 1]), np.array([500, 1500]), np.array([0, 0]))
    shares, measured = (CostModel(hand_table(tiny, rest_share=s), layout).stage_costs(far) for s in (None, 0.3))
    assert measured.extrapolated == shares.extrapolated > 0  # the input-gradient lookups are not counted again
    rest_bwd = 2 * np.array([2e-2 + 400 / 900 * 9e-2, 11e-2 * 1.5])
    np.testing.assert_allclose(measured.bwd_input[:, 1] - shares.bwd_input[:, 1], 2 * (0.3 - 0.5) * rest_bwd, rtol=1e-12)


@pytest.mark.parametrize(
    "bwd_input,message",
    [
        ([0.1, 0.2], "curve 'rest': grid has 3 points but bwd_input has 2"),
        ([-0.01, 0.01, 0.05], "curve 'rest'.bwd_input is negative at packed_len=10"),
        ([0.01, 0.04, 0.3], "curve 'rest'.bwd_input exceeds its bwd at packed_len=1000"),
        ([0.01, float("nan"), 0.05], "curve 'rest'.bwd_input has non-finite values"),
        ([0.01, 0.005, 0.05], "curve 'rest'.bwd_input is not monotonic"),
        ([0.01, "a", 0.05], "curve 'rest'.bwd_input must be a flat list of numbers"),
        ([], "curve 'rest' has no bwd_input values"),
    ],
)
def test_a_bad_measured_split_is_refused_naming_the_curve(tiny, bwd_input, message):
    raw = hand_table(tiny).to_dict()  # rest's bwd: 0.02, 0.04, 0.22 s
    raw["curves"]["rest"]["bwd_input"] = bwd_input
    with pytest.raises(LatencyTableError, match=message):
        table_from_dict(raw, where="t.json")


def test_a_measured_split_a_little_above_the_backward_is_cut_to_it(tiny):
    raw = hand_table(tiny).to_dict()
    bwd = np.asarray(raw["curves"]["rest"]["bwd"])
    raw["curves"]["rest"]["bwd_input"] = (bwd * [0.5, 1.04, 1.0]).tolist()  # timed apart: within 5 % over
    np.testing.assert_array_equal(table_from_dict(raw).curves["rest"].bwd_input, bwd * [0.5, 1.0, 1.0])
