"""Stage layout: parsing, and the layout search (never worse than even, memory respected, equal to
exhaustive search where that is affordable)."""

import numpy as np
import pytest

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.data import make_mix
from pipetune.plan.layout.layout_search import LayoutSearch, sample_batches
from pipetune.plan.layout.planner_config import SplitBackward


def test_parse_and_from_sizes():
    assert StageLayout.parse("7,9,8,8", 32, 4).layer_ranges == ((0, 7), (7, 16), (16, 24), (24, 32))
    assert StageLayout.parse("even", 32, 4) == StageLayout.even(32, 4)
    with pytest.raises(ValueError, match="summing to the model's 32"):
        StageLayout.parse("7,9,8", 32, 4)
    with pytest.raises(ValueError, match="expected auto, even"):
        StageLayout.parse("seven", 32, 4)
    with pytest.raises(ValueError, match="at least one layer"):
        StageLayout.from_sizes([0, 32])


def _search(name, pp, tp, mix, memory_gib, recompute=False, count=3, gbs=64, max_seq_len=4096, chunks_per_rank=1,
            split_backward=SplitBackward.OFF):
    model = load_model_config(name)
    even = StageLayout.even(model.backbone.n_layers, pp * chunks_per_rank, chunks_per_rank=chunks_per_rank)
    cost = CostModel(analytical_table(model, load_hardware("h100"), tp=tp), even, recompute_encoder=recompute)
    sample = sample_batches(make_mix(mix, 3000, 0), model, gbs=gbs, max_seq_len=max_seq_len, count=count, seed=0)
    return LayoutSearch(model, cost, sample, max_seq_len=max_seq_len, memory_bytes=memory_gib * 2**30, split_backward=split_backward)


def test_heavy_encoder_moves_layers_off_stage_zero_and_fits_memory():
    ls = _search("dip_5b_8b", 4, 4, "datamix3", 80, recompute=True)
    r = ls.search()
    assert r.best.iter_s <= r.even.iter_s
    assert r.best.layout.layers_per_stage()[0] < 8
    assert (r.best.peak_bytes <= ls.budget).all()


def test_tight_memory_excludes_layouts_that_do_not_fit():
    loose = _search("dip_5b_8b", 4, 4, "datamix3", 80, recompute=True).search()
    # Budget just below the unconstrained best's stage-0 peak: that layout must not be chosen.
    gib = float(loose.best.peak_bytes.max()) / 2**30 / 0.9 - 0.5
    ls = _search("dip_5b_8b", 4, 4, "datamix3", gib, recompute=True)
    r = ls.search()
    assert (r.best.peak_bytes <= ls.budget).all()
    assert r.best.layout != loose.best.layout or r.best.iter_s > loose.best.iter_s


def test_two_stage_search_matches_exhaustive():
    ls = _search("3b", 2, 1, "datamix2", 80, count=2)
    n = ls.n_layers
    every = [ls.score(StageLayout.from_sizes([k, n - k])) for k in range(1, n)]
    r = ls.search()
    assert np.isclose(r.best.iter_s, min(s.iter_s for s in every))


def test_interleaved_search_moves_layers_off_chunk_zero_and_keeps_its_chunks():
    """Virtual stages: the search runs over the V x P chunks (a trained 5B ViT beside chunk 0),
    every layout it scores keeps two chunks per rank, and it is scored with zero-bubble tables when
    the planner may choose them, never slower than without."""
    ls = _search("dip_5b_8b", 2, 4, "datamix3", 80, recompute=True, chunks_per_rank=2, split_backward=SplitBackward.AUTO)
    r = ls.search()
    assert r.best.layout.chunks_per_rank == 2 and r.best.layout.num_stages == 4
    assert all(layout.chunks_per_rank == 2 for layout in ls._scores)
    assert r.best.iter_s < r.even.iter_s
    assert r.best.layout.layers_per_stage()[0] < r.even.layout.layers_per_stage()[0]
    assert (r.best.peak_bytes <= ls.budget).all() and len(r.best.peak_bytes) == 2
    whole = _search("dip_5b_8b", 2, 4, "datamix3", 80, recompute=True, chunks_per_rank=2)
    assert r.best.iter_s <= whole.score(r.best.layout).iter_s
    with pytest.raises(ValueError, match="the separated layout does not run 2 chunks per rank and split backward"):
        ls.search(separated=True)


def test_one_rule_says_what_keeps_a_job_off_the_separated_layout():
    """``auto`` (command line and trainer), ``PlannerConfig.build``, the trainer's settings and
    TorchTitan job checks all ask ``separated_excluded``."""
    from pipetune.plan.layout.planner_config import PlannerConfig, separated_excluded
    from torchtitan_patches.settings import PipeTuneSettings

    assert separated_excluded() == [] and separated_excluded(split_backward="off", jitter_draws=0) == []
    assert separated_excluded(encoder=False, chunks_per_rank=2, split_backward="auto", jitter_draws=4) == [
        "a model without a vision encoder", "2 chunks per rank", "split backward",
        "jitter_draws (the separated layout's planner scores deterministic times only)"]
    model = load_model_config("tiny")
    cost = CostModel(analytical_table(model, load_hardware("a100"), max_tokens=256, max_images=2),
                     StageLayout.even(model.backbone.n_layers, 2).separated(model.encoder.n_layers, 1, 1))
    config = PlannerConfig(max_seq_len=256, memory_bytes=2**34)
    assert type(config.build(model, cost)).__name__ == "SeparatedPlanner"
    with pytest.raises(ValueError, match="the separated layout does not run split backward: plan a co-located layout"):
        PlannerConfig(max_seq_len=256, memory_bytes=2**34, split_backward="auto").build(model, cost)
    with pytest.raises(ValueError, match="pipetune.layout separated does not run split backward"):
        PipeTuneSettings.Config(layout="separated", split_backward="on")


def test_layout_cli_searches_the_chunks_of_virtual_stages(capsys):
    import json

    from pipetune.cli.main import main

    assert main(["layout", "--model", "dip_5b_8b", "--tp", "4", "--pp", "2", "--hardware", "h100", "--gbs", "32", "--max-seq-len", "4096",
                 "--mix", "datamix3", "--samples", "3000", "--recompute-encoder", "--chunks-per-rank", "2", "--split-backward", "auto",
                 "--layout-sample", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "separated" not in out  # one chunk per rank only
    assert len(out["auto"]["layers_per_stage"]) == 4 and sum(out["auto"]["layers_per_stage"]) == 32
    assert out["auto"]["predicted_iter_s"] <= out["even"]["predicted_iter_s"]
