import copy
import json

import numpy as np
import pytest

from pipetune.config import load_model_config
from pipetune.cost import LatencyTableError, load_latency_table
from pipetune.cost.latency_table import table_from_dict


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """The CLI on the tiny model on its default grid, each point timed once without a warm-up (the
    defaults time 7 after 2: what is checked here is the table, not its timings). In this process:
    the profiler's imports and settings (one torch thread, retained freed memory) are this module's
    anyway (``test_profiling_resumes_from_a_partial_run``), and a process of its own spent 5 s
    importing them again."""
    from pipetune.cli.main import main

    out = tmp_path_factory.mktemp("prof") / "tiny_cpu.json"
    assert main(["profile", "--model", "tiny", "--out", str(out), "--quiet", "--repeats", "1", "--warmup", "0"]) == 0
    return (out,)


def test_profiling_the_tiny_model_gives_a_loadable_table(profiled, tiny):
    (out,) = profiled
    table = load_latency_table(out, model=tiny, tp=1)
    assert not table.estimate and table.dtype == "float32" and table.threads == 1
    assert set(table.curves) == {"attention", "rest", "embedding", "head", "projector", "encoder"}
    assert table.curves["attention"].grid[-1] >= 512 and table.curves["rest"].grid[-1] == 2048
    assert table.memory["layer_bytes_per_token"] > 4 * tiny.backbone.dim  # at least the layer input is saved
    assert table.p2p["bytes_per_s"] > 0 and any("gloo" in n for n in table.notes)
    assert (table.curves["encoder"].bwd == 0).all()  # frozen encoder: forward only


def test_profiling_resumes_from_a_partial_run(tmp_path, tiny, monkeypatch):
    from profiling import profile_layers as pl

    cfg = pl.ProfileConfig(max_seq_len=64, max_tokens=128, max_images=4, points=3, repeats=3, warmup=1, p2p=False)
    out = tmp_path / "t.json"
    real = pl._Profiler.measure
    calls = {"n": 0}

    def flaky(self, curve, x):
        calls["n"] += 1
        if calls["n"] > limit:
            raise KeyboardInterrupt
        return real(self, curve, x)

    monkeypatch.setattr(pl._Profiler, "measure", flaky)
    n_points = len(pl.measurement_tasks(tiny, cfg))
    limit = 2 * n_points + 5  # warm-up pass + one timed pass + a few points of the next
    with pytest.raises(KeyboardInterrupt):
        pl.run_profile(tiny, cfg, out, progress=False)
    assert (tmp_path / "t.json.partial.json").is_file() and not out.exists()
    calls["n"], limit = 0, 10**9
    pl.run_profile(tiny, cfg, out, progress=False)
    assert calls["n"] == 3 * n_points  # one warm-up pass and the two missing timed passes
    load_latency_table(out, model=tiny)
    assert not (tmp_path / "t.json.partial.json").exists()


@pytest.mark.parametrize("garbage", ['{"header": {"model": "x"}, "samp', "\x00\xff", '[1, 2]'])
def test_a_corrupt_resume_file_is_reported_and_profiling_starts_afresh(tmp_path, tiny, garbage):
    from profiling import profile_layers as pl

    cfg = pl.ProfileConfig(max_seq_len=32, max_tokens=64, max_images=2, points=2, repeats=1, warmup=0, p2p=False)
    out = tmp_path / "t.json"
    partial = tmp_path / "t.json.partial.json"
    partial.write_bytes(garbage.encode("latin-1"))
    with pytest.warns(UserWarning, match=f"profile resume file {partial} is corrupt"):
        pl.run_profile(tiny, cfg, out, progress=False)
    load_latency_table(out, model=tiny, tp=1)
    assert not partial.exists()


def test_p2p_fit_recovers_latency_and_bandwidth_and_refuses_flat_times():
    from profiling.p2p import P2PMeasurementError, fit_message_cost

    sizes = np.geomspace(4096, 16 << 20, 8)
    latency, bandwidth = fit_message_cost(sizes, 30e-6 + sizes / 5e9)
    assert latency == pytest.approx(30e-6, rel=1e-6) and bandwidth == pytest.approx(5e9, rel=1e-6)
    for flat in (np.full(8, 50e-6), 50e-6 - sizes * 1e-15):  # noise only, or shrinking with size
        with pytest.raises(P2PMeasurementError, match="message time does not grow with size.*--no-p2p"):
            fit_message_cost(sizes, flat)


@pytest.fixture(scope="module")
def good(profiled):
    return json.loads(profiled[0].read_text())


def broken(good, edit):
    raw = copy.deepcopy(good)
    edit(raw)
    return raw


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda r: r.update(format="other"), "not a pipetune latency table"),
        (lambda r: r.update(version=99), "version 99 is not supported"),
        (lambda r: r["curves"].pop("rest"), "missing curve 'rest'"),
        (lambda r: r["curves"]["head"].update(grid=[]), "curve 'head' has no grid values"),
        (lambda r: r["curves"]["head"].pop("fwd"), "curve 'head' has no fwd values"),
        (lambda r: r["curves"]["rest"].update(fwd=r["curves"]["rest"]["fwd"][::-1]), "curve 'rest'.fwd is not monotonic"),
        (lambda r: r["curves"]["attention"]["bwd"].__setitem__(0, -1.0), "curve 'attention'.bwd is negative at seq_len=1"),
        (lambda r: r["curves"]["encoder"]["fwd"].__setitem__(-1, float("nan")), "curve 'encoder'.fwd has non-finite values"),
        (lambda r: r["curves"]["embedding"].update(grid=r["curves"]["embedding"]["grid"][::-1]), "grid must be positive and strictly increasing"),
        (lambda r: r["curves"]["embedding"].update(fwd=r["curves"]["embedding"]["fwd"][:-1]), "fwd/bwd have"),
        (lambda r: r["curves"]["head"].update(x="images"), "curve 'head' must be over 'packed_len'"),
        (lambda r: r["memory"].pop("layer_bytes_per_token"), "memory.layer_bytes_per_token must be"),
        (lambda r: r["p2p"].update(bytes_per_s=0), "p2p.bytes_per_s must be a finite positive number"),
        (lambda r: r["model"]["backbone"].update(dim=256), "model_fingerprint does not match"),
        (lambda r: r.update(scales={"attention": -2}), "scales \\['attention'\\] are not known components"),
        (lambda r: r.pop("model"), "missing field 'model'"),
    ],
)
def test_corrupt_tables_are_refused_with_the_reason(good, edit, message):
    with pytest.raises(LatencyTableError, match=message):
        table_from_dict(broken(good, edit))


def test_table_for_another_model_or_tp_is_refused(profiled):
    with pytest.raises(LatencyTableError, match="profiled for model 'tiny'.*job uses '13b'"):
        load_latency_table(profiled[0], model=load_model_config("13b"))
    with pytest.raises(LatencyTableError, match="profiled with TP=1, but the job uses TP=4"):
        load_latency_table(profiled[0], tp=4)


def test_unreadable_files(tmp_path):
    with pytest.raises(LatencyTableError, match="does not exist"):
        load_latency_table(tmp_path / "none.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(LatencyTableError, match="not valid JSON"):
        load_latency_table(tmp_path / "x.json")


def test_round_trip(profiled, tmp_path):
    t = load_latency_table(profiled[0])
    t.save(tmp_path / "copy.json")
    u = load_latency_table(tmp_path / "copy.json")
    assert u.to_dict() == t.to_dict()
    assert np.array_equal(u.curves["rest"].fwd, t.curves["rest"].fwd)


def test_calibrate_cli_writes_a_table_with_scales(profiled, datamix2_dir, tmp_path, capsys):
    from pipetune.cli.main import main

    out = tmp_path / "cal.json"
    assert main(["calibrate", "--table", str(profiled[0]), "--data", str(datamix2_dir), "--out", str(out), "--samples", "3"]) == 0
    assert "before ->" in capsys.readouterr().out
    table = load_latency_table(out)
    assert table.scales and all(v > 0 for v in table.scales.values())


def test_a_table_written_before_linear_attention_still_loads_and_round_trips(tmp_path):
    """``data/muse_glimmer_mm_table_v1.json``: the main job's table as the profiler wrote it before
    linear-attention layers existed. It still fits the job's model, and saving it again changes nothing
    the planner reads."""
    from pathlib import Path

    from pipetune.cost import CostModel, MicroBatchShapes, StageLayout
    from torchtitan_patches.models.muse_glimmer.spec import muse_glimmer_spec
    from torchtitan_patches.models.model_spec import planning_model_config

    old = Path(__file__).parent / "data" / "muse_glimmer_mm_table_v1.json"
    model = planning_model_config(muse_glimmer_spec("debugmodel_mm"), image_grid=4)
    table = load_latency_table(old, model=model, tp=1)
    assert "linear_attention" not in table.curves and model.backbone.linear_attention is None
    table.save(tmp_path / "again.json")
    again = load_latency_table(tmp_path / "again.json", model=model, tp=1)
    shapes = MicroBatchShapes(np.array([300, 40, 700]), np.array([0, 0, 1]), np.array([340, 700]), np.array([2, 0]))
    costs = [CostModel(t, StageLayout.even(8, 2)).stage_costs(shapes) for t in (table, again)]
    assert np.array_equal(costs[0].fwd, costs[1].fwd) and np.array_equal(costs[0].bwd, costs[1].bwd)


def test_a_table_without_the_linear_curve_is_refused_for_a_model_with_linear_layers(tmp_path):
    """Both ways a Qwen3.5 table can lack the curve: written before the mapping declared its linear
    layers (its model has none), or edited. Each error names the file and what to run."""
    import dataclasses

    from pipetune.config.model import BackboneConfig, LinearAttentionConfig, ModelConfig
    from pipetune.cost import analytical_table
    from pipetune.config import load_hardware

    la = LinearAttentionConfig(layers=(0, 1, 2), n_key_heads=2, n_value_heads=4, key_head_dim=32, value_head_dim=32)
    hybrid = ModelConfig(name="hybrid", backbone=BackboneConfig(n_layers=4, dim=128, ffn_dim=384, n_heads=4, n_kv_heads=2, vocab_size=512,
                                                                linear_attention=la))
    before = dataclasses.replace(hybrid, backbone=dataclasses.replace(hybrid.backbone, linear_attention=None))
    analytical_table(before, load_hardware("h100")).save(tmp_path / "before.json")
    with pytest.raises(LatencyTableError, match=r"before.json prices every layer of 'hybrid' as full attention.*linear-attention "
                                                r"layers \[0, 1, 2\].*python -m profiling.prepare_job"):
        load_latency_table(tmp_path / "before.json", model=hybrid)
    raw = analytical_table(hybrid, load_hardware("h100")).to_dict()
    raw["curves"].pop("linear_attention")
    (tmp_path / "edited.json").write_text(json.dumps(raw))
    with pytest.raises(LatencyTableError, match=r"edited.json: missing curve 'linear_attention'.*python -m profiling.prepare_job"):
        load_latency_table(tmp_path / "edited.json", model=hybrid)
    raw = analytical_table(before, load_hardware("h100")).to_dict()
    raw["curves"]["linear_attention"] = analytical_table(hybrid, load_hardware("h100")).to_dict()["curves"]["linear_attention"]
    with pytest.raises(LatencyTableError, match="curve 'linear_attention' given, but model 'hybrid' has no linear-attention layers"):
        table_from_dict(raw)
