import numpy as np
import pytest

from pipetune.data import MIXES, make_mix
from pipetune.data.sources import SOURCES

TABLE1 = {  # source: (images mean, median), (text mean, median, max)
    "coyo": ((1.0, 1.0), (17.24, 13, 1523)),
    "mmc4": ((4.08, 3.0), (408.94, 362, 16470)),
    "flan": ((0.0, 0.0), (154.68, 52, 222109)),
}


@pytest.fixture(scope="module")
def big_mix():
    return make_mix({"mmc4": 1, "coyo": 1, "flan": 1}, 150_000, seed=3)


@pytest.mark.parametrize("source", sorted(TABLE1))
def test_generated_sources_hit_table1_mean_and_median(big_mix, source):
    (img_mean, img_median), (text_mean, text_median, text_max) = TABLE1[source]
    sel = big_mix.source == big_mix.source_names.index(source)
    text, images = big_mix.text_tokens[sel], big_mix.num_images[sel]
    assert abs(text.mean() - text_mean) <= 0.10 * text_mean
    assert abs(np.median(text) - text_median) <= 0.10 * text_median
    assert text.max() <= text_max and text.min() >= 1
    assert abs(images.mean() - img_mean) <= 0.10 * max(img_mean, 1e-9) + 1e-12
    assert np.median(images) == img_median
    assert images.max() <= max(1, SOURCES[source].images_max)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_mix_ratios_are_exact(mix):
    t = make_mix(mix, 10_000, seed=0)
    counts = {name: int((t.source == k).sum()) for k, name in enumerate(t.source_names)}
    w = MIXES[mix]
    total = sum(w.values())
    for name, weight in w.items():
        assert abs(counts[name] - 10_000 * weight / total) <= 1


def test_mix_is_deterministic_and_seed_dependent():
    a, b, c = make_mix("datamix2", 1000, 5), make_mix("datamix2", 1000, 5), make_mix("datamix2", 1000, 6)
    assert np.array_equal(a.text_tokens, b.text_tokens) and np.array_equal(a.image_offsets, b.image_offsets)
    assert not np.array_equal(a.text_tokens, c.text_tokens)


def test_interleaved_images_sit_inside_their_text():
    t = make_mix("datamix3", 2000, 0)
    for i in range(len(t)):
        offs = t.offsets_of(i)
        assert len(offs) == t.num_images[i]
        assert np.all(np.diff(offs) >= 0) and (offs <= t.text_tokens[i]).all()


@pytest.mark.parametrize("spec", ["datamix9", "1:2", "a:b:c", "0:0:0"])
def test_bad_mix_names_are_rejected(spec):
    with pytest.raises(ValueError, match="unknown mix"):
        make_mix(spec, 10)


def test_image_heavy_tails_hit_their_targets():
    """``webdocs``: 3.3 images a document (median 2, p99 17, at most 64), text mean about 810 and
    median about 520 tokens (p99 about 4.7k); ``video``: about 36 frames a sample, at most 64, text
    about 60 tokens, frames before the text. (About 1 s.)"""
    docs, video = make_mix("webdocs", 100_000, seed=1), make_mix("video", 20_000, seed=1)
    k, t = docs.num_images, docs.text_tokens
    assert docs.source_names == ("webdoc",) and abs(k.mean() - 3.3) <= 0.1 and np.median(k) == 2
    assert 16 <= np.percentile(k, 99) <= 18 and k.max() == 64 and k.min() >= 1
    assert abs(t.mean() - 810) <= 40 and abs(np.median(t) - 520) <= 20 and 4200 <= np.percentile(t, 99) <= 5200
    f = video.num_images
    assert abs(f.mean() - 36) <= 1 and f.max() == 64 and abs(video.text_tokens.mean() - 60) <= 5
    assert all((video.offsets_of(i) == 0).all() for i in range(100))


def test_a_mix_of_unknown_sources_is_refused():
    with pytest.raises(ValueError, match="unknown source"):
        make_mix({"webdoc": 1, "podcast": 1}, 10)
