import numpy as np
import pytest

from pipetune.data import BatchStream, Overlong, OverlongTotals, SampleTable, apply_overlong_policy, batch_meta


def table(text, images, offsets=None, tpi=10):
    return SampleTable.build(
        ids=np.arange(100, 100 + len(text)),
        source=np.zeros(len(text)),
        source_names=("s",),
        text_tokens=text,
        num_images=images,
        image_offsets=offsets,
        tokens_per_image=tpi,
    )


def test_lengths_count_image_tokens():
    t = table([5, 7], [0, 2])
    assert t.lengths.tolist() == [5, 27]


def test_fitting_batch_is_unchanged():
    t = table([5, 7], [0, 2])
    out, rep = apply_overlong_policy(t, 27, "truncate")
    assert np.array_equal(out.lengths, t.lengths) and np.array_equal(out.image_offsets, t.image_offsets)
    assert rep.to_dict() == {"policy": "truncate", "truncated": 0, "rejected": 0, "tokens_cut": 0}
    assert (rep.samples, rep.tokens) == (2, 32)


def test_truncate_keeps_a_prefix_and_drops_images_past_the_cut():
    # text 30 with images at offsets 0, 12, 25 (10 tokens each): layout I(10) T(12) I(10) T(13) I(10) T(5) = 60
    t = table([30, 4], [3, 0], [[0, 12, 25], []])
    out, rep = apply_overlong_policy(t, 40, Overlong.TRUNCATE)
    # 10 image + 12 text + 10 image = 32, then 8 more text tokens -> text 20, images 2
    assert out.text_tokens.tolist() == [20, 4] and out.num_images.tolist() == [2, 0]
    assert out.offsets_of(0).tolist() == [0, 12]
    assert out.lengths.max() == 40
    assert rep.truncated_ids == (100,) and rep.tokens_cut == 60 - 40


def test_truncate_drops_an_image_that_would_straddle_the_cut():
    t = table([30], [2], [[5, 20]])
    out, _ = apply_overlong_policy(t, 18, "truncate")
    # T(5) I(10) = 15; the next text run (15 tokens) is cut at 3 -> text 8, one image
    assert (out.text_tokens[0], out.num_images[0]) == (8, 1)
    out, _ = apply_overlong_policy(t, 12, "truncate")
    # T(5) then the image (10) does not fit in the 7 left: text stops at the image's offset
    assert (out.text_tokens[0], out.num_images[0], out.lengths[0]) == (5, 0, 5)


def test_truncation_rejects_a_sample_whose_leading_frames_fill_the_budget():
    # Sample 101 is a video: 14 frames of 10 tokens before its 3 text tokens; no text fits in 100.
    t = table([5, 3, 7], [0, 14, 1], [[], [0] * 14, [2]], tpi=10)
    out, rep = apply_overlong_policy(t, 100, "truncate")
    assert out.ids.tolist() == [100, 102] and rep.rejected_ids == (101,) and rep.truncated_ids == ()
    assert rep.tokens_cut == 143 and out.lengths.tolist() == [5, 17]
    line = (OverlongTotals("truncate") + rep).describe()
    assert "0 of 3 samples truncated" in line and "1 rejected (no text token fits after their leading images)" in line


def test_reject_counts_and_removes():
    t = table([5, 50, 6], [0, 0, 0])
    out, rep = apply_overlong_policy(t, 10, "reject")
    assert out.ids.tolist() == [100, 102] and rep.rejected_ids == (101,) and rep.tokens_cut == 50


def test_error_policy_names_the_sample_and_its_shape():
    t = table([5, 50], [0, 1], [[], [3]])
    with pytest.raises(ValueError, match=r"sample id=101 is 60 tokens \(50 text \+ 1 images of 10 tokens\), longer than max_seq_len=20"):
        apply_overlong_policy(t, 20, "error")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(text=[3, 0], images=[0, 0]), "sample id=101 has no text tokens"),
        (dict(text=[3, 4], images=[0, -1]), "sample id=101 has a negative image count"),
        (dict(text=[3, 4], images=[1, 0], offsets=[[9], []]), r"sample id=100 has image offsets \[9\] outside its text of 3"),
        (dict(text=[9, 4], images=[2, 0], offsets=[[5, 2], []]), "sample id=100 has image offsets not in ascending order"),
    ],
)
def test_degenerate_samples_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        table(kwargs["text"], kwargs["images"], kwargs.get("offsets"))


def test_images_without_an_encoder_are_an_error():
    t = table([3, 4], [0, 2])
    stream = BatchStream(num_rows=2, gbs=2, seed=0, shuffle=False)
    with pytest.raises(ValueError, match="sample id=101 has 2 images but the model has no vision encoder"):
        batch_meta(t, stream, 0, images=None, max_seq_len=100)


def test_take_keeps_image_offsets_aligned():
    t = table([10, 20, 30], [1, 0, 2], [[4], [], [1, 29]])
    sub = t.take(np.array([2, 0]))
    assert sub.ids.tolist() == [102, 100]
    assert sub.offsets_of(0).tolist() == [1, 29] and sub.offsets_of(1).tolist() == [4]
