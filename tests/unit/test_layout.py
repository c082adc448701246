"""Stage layout: parsing, and the layout search (never worse than even, memory respected, equal to
exhaustive search where that is affordable)."""

import numpy as np
import pytest

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.data import make_mix
from pipetune.plan.layout_search import LayoutSearch, sample_batches


def test_parse_and_from_sizes():
    assert StageLayout.parse("7,9,8,8", 32, 4).layer_ranges == ((0, 7), (7, 16), (16, 24), (24, 32))
    assert StageLayout.parse("even", 32, 4) == StageLayout.even(32, 4)
    with pytest.raises(ValueError, match="summing to the model's 32"):
        StageLayout.parse("7,9,8", 32, 4)
    with pytest.raises(ValueError, match="expected auto, even"):
        StageLayout.parse("seven", 32, 4)
    with pytest.raises(ValueError, match="at least one layer"):
        StageLayout.from_sizes([0, 32])


def _search(name, pp, tp, mix, memory_gib, recompute=False, count=3, gbs=64, max_seq_len=4096):
    model = load_model_config(name)
    cost = CostModel(analytical_table(model, load_hardware("h100"), tp=tp), StageLayout.even(model.backbone.n_layers, pp), recompute_encoder=recompute)
    sample = sample_batches(make_mix(mix, 3000, 0), model, gbs=gbs, max_seq_len=max_seq_len, count=count, seed=0)
    return LayoutSearch(model, cost, sample, max_seq_len=max_seq_len, memory_bytes=memory_gib * 2**30)


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
