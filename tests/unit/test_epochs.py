"""Epoch boundaries: every batch is a set of distinct samples, every epoch holds every sample once,
and the stream (and the loader built on it) resumes exactly at any step."""

import copy

import numpy as np
import pytest

from pipetune.data import BatchStream, SampleTable, batch_meta, make_mix, write_dataset
from pipetune.packing import PackingConfig
from torchtitan_patches.data import DataLoaderConfig, FixedPacking
from torchtitan_patches.data.loader import groups_from_ids
from pipetune.data.images import ImageSizing


def stream_positions(stream: BatchStream, steps: int) -> np.ndarray:
    return np.concatenate([stream.rows(s) for s in range(steps)])


def assert_epochs_exact(flat: np.ndarray, num_rows: int) -> int:
    """Stream positions [e * N, (e + 1) * N) hold every row once; returns the number of whole epochs."""
    epochs = len(flat) // num_rows
    for e in range(epochs):
        chunk = flat[e * num_rows : (e + 1) * num_rows]
        assert np.array_equal(np.sort(chunk), np.arange(num_rows)), f"epoch {e} is not a permutation"
    return epochs


@pytest.mark.parametrize(
    "num_rows,gbs,steps",
    [
        (1000, 128, 2000),  # the case: 256 epochs, 250 of them end inside a batch
        (150, 128, 600),  # fewer than 2 x gbs rows: the next epoch's head also shapes its tail
        (129, 128, 600),
        (256, 128, 300),  # epochs end on batch boundaries
        (128, 128, 50),  # gbs == rows: every batch is the whole data set
        (11, 7, 400),
    ],
)
def test_every_batch_distinct_and_every_epoch_exact(num_rows, gbs, steps):
    stream = BatchStream(num_rows=num_rows, gbs=gbs, seed=3)
    batches = [stream.rows(s) for s in range(steps)]
    for s, b in enumerate(batches):
        assert len(b) == gbs and len(np.unique(b)) == gbs, f"step {s} repeats a sample"
    epochs = assert_epochs_exact(np.concatenate(batches), num_rows)
    assert epochs == steps * gbs // num_rows
    # epochs are reshuffled, not repeated
    flat = np.concatenate(batches)
    if num_rows > gbs:
        assert not np.array_equal(flat[:num_rows], flat[num_rows : 2 * num_rows])


@pytest.mark.parametrize("num_rows", [1000, 150])
def test_rows_is_a_pure_function_of_seed_and_step(num_rows):
    reference = BatchStream(num_rows=num_rows, gbs=128, seed=5)
    expect = [reference.rows(s) for s in range(400)]
    rng = np.random.default_rng(0)
    for s in rng.integers(0, 400, size=25).tolist():  # fresh streams, random access, far look-ahead first
        fresh = BatchStream(num_rows=num_rows, gbs=128, seed=5)
        fresh.rows(399)
        assert np.array_equal(fresh.rows(s), expect[s])
    assert not np.array_equal(BatchStream(num_rows=num_rows, gbs=128, seed=6).rows(0), expect[0])


@pytest.mark.parametrize("dp_size", [2, 4])
def test_data_parallel_shares_are_disjoint_and_make_up_the_global_batch(dp_size):
    whole = BatchStream(num_rows=1000, gbs=128, seed=1)
    parts = [BatchStream(num_rows=1000, gbs=128, seed=1, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    for step in list(range(0, 40)) + [780, 781, 782, 1999]:
        shares = [p.rows(step) for p in parts]
        merged = np.concatenate(shares)
        assert len(np.unique(merged)) == 128
        assert np.array_equal(np.sort(merged), np.sort(whole.rows(step)))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_rows=128, gbs=129), r"global batch size 129 is larger than the data set \(128 rows\).*use gbs <= 128"),
        (dict(num_rows=50, gbs=8, dp_size=3), "not a multiple of dp_size=3"),
        (dict(num_rows=0, gbs=8), "data set is empty"),
    ],
)
def test_impossible_streams_are_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BatchStream(**kwargs)


def test_readme_setting_crosses_the_first_epoch_through_the_loader_path(tiny, model13b):
    """100k DataMix2 samples at GBS 128: batch 781 straddles epochs 0 and 1 (it crashed the loader)."""
    table = make_mix("datamix2", 100_000, seed=0)
    stream = BatchStream(num_rows=len(table), gbs=128, seed=0)
    for model, max_seq_len in ((tiny, 512), (model13b, 8192)):
        for packer in ("balanced", "original"):
            source = FixedPacking(PackingConfig(packer=packer, mbs=2, max_seq_len=max_seq_len), model)
            for step in range(776, 787):
                meta = batch_meta(table, stream, step, images=ImageSizing.for_model(model), max_seq_len=max_seq_len)
                groups = groups_from_ids(meta, source(meta))  # the loader's check: each sample exactly once
                assert sum(len(g) for g in groups) == len(meta.table) == 128


def write_short_texts(path, num_rows=1000, seed=0):
    rng = np.random.default_rng(seed)
    table = SampleTable.build(
        ids=np.arange(num_rows) + 10_000,
        source=np.zeros(num_rows),
        source_names=("flan",),
        text_tokens=rng.integers(2, 40, size=num_rows),
        num_images=np.zeros(num_rows, np.int64),
    )
    write_dataset(table, path, {"seed": seed})
    return table


def batch_key(batch):
    return batch.step, tuple(tuple(ids) for ids in batch.sample_ids), tuple(int(mb.tokens.sum()) for mb in batch.micro_batches)


def test_loader_over_500_steps_distinct_exact_epochs_and_exact_resume(tmp_path, tiny):
    table = write_short_texts(tmp_path / "d")
    cfg = DataLoaderConfig(
        data=tmp_path / "d", gbs=128, max_seq_len=64, packing=PackingConfig(mbs=4, max_seq_len=64), max_steps=500
    )
    resume_at = (1, 7, 125, 311, 499)
    loader = cfg.build(tiny)
    reference, states = [], {}
    for batch in loader:
        reference.append(batch_key(batch))
        if batch.step + 1 in resume_at:
            states[batch.step + 1] = copy.deepcopy(loader.state_dict())
    assert [k[0] for k in reference] == list(range(500))

    row_of_id = {int(i): k for k, i in enumerate(table.ids)}
    yielded = []
    for step, groups, _ in reference:
        ids = [i for g in groups for i in g]
        assert len(set(ids)) == len(ids) == 128, f"step {step} repeats a sample"
        # the loader yields exactly the stream's rows of that step (in its packing's order)
        assert sorted(row_of_id[i] for i in ids) == sorted(loader.stream.rows(step).tolist())
        yielded.append(ids)
    assert_epochs_exact(np.concatenate([loader.stream.rows(s) for s in range(500)]), 1000)
    # without reference to stream positions: each window of lcm(1000, 128) / 128 = 125 steps
    # (16 epochs) holds every sample exactly 16 times
    for w in range(0, 500, 125):
        counts = np.bincount([row_of_id[i] for ids in yielded[w : w + 125] for i in ids], minlength=1000)
        assert (counts == 16).all()

    for step, state in states.items():
        resumed = cfg.build(tiny)
        resumed.load_state_dict(state)
        got = [batch_key(b) for _, b in zip(range(30), resumed)]
        assert got == reference[step : step + 30], f"resume at step {step} differs"
