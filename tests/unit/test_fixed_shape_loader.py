"""pipetune's data as TorchTitan's stock pipeline reads it: rows packed as TorchTitan's own packer
packs them, fixed shapes, every sample once, and (with ``pad_steps``) pipetune's batches step by
step."""

import numpy as np
import pytest
import torch
from torchtitan.hf_datasets.multimodal.utils.packing import MMSamplePacker

from pipetune.packing import PackingConfig
from torchtitan_patches.data import DataLoaderConfig
from torchtitan_patches.data.micro_batch import IGNORE_INDEX, IMAGE_TOKEN_ID, PAD_TOKEN_ID
from torchtitan_patches.titan.fixed_shape_loader import FixedShapeDataLoader, rows_needed, scan_and_pick

SEQ = 512


@pytest.mark.parametrize("seed", range(5))
def test_rows_are_torchtitans_packing_of_a_flushed_buffer(seed):
    lengths = np.random.default_rng(seed).integers(1, 200, size=40)
    packer = MMSamplePacker(max_seq_length=256, buffer_size=10**6, batch_size=1)
    for k, n in enumerate(lengths):
        packer.add_sample({"input_ids": torch.full((int(n),), k), "labels": torch.zeros(int(n)), "positions": torch.arange(int(n))})
    packer._pack_buffered_samples(flush=True)
    theirs = [list(dict.fromkeys(s["input_ids"].tolist())) for s in packer.packed_samples]
    assert scan_and_pick(lengths, 256) == theirs


def _loader(data, tiny, **kw) -> FixedShapeDataLoader:
    loader = FixedShapeDataLoader(FixedShapeDataLoader.Config(dataset_path=str(data), gbs=8, num_workers=0, **kw), seq_len=SEQ, local_batch_size=1)
    loader.bind(tiny)
    return loader


def _steps(loader, rows: int, count: int) -> list[list[tuple[dict, torch.Tensor]]]:
    it = iter(loader)
    return [[next(it) for _ in range(rows)] for _ in range(count)]


def test_streamed_steps_hold_fixed_shapes_and_count_their_real_tokens(datamix2_dir, tiny):
    loader = _loader(datamix2_dir, tiny, rows_per_step=3)
    steps = _steps(loader, 3, 6)
    assert len(loader.work) == 6
    for step, work in zip(steps, loader.work):
        n = 0
        for inputs, labels in step:
            assert inputs["input"].shape == labels.shape == inputs["positions"].shape == (1, SEQ)
            assert inputs["special_tokens"] == {"image_id": IMAGE_TOKEN_ID}
            images = int((inputs["input"] == IMAGE_TOKEN_ID).sum())
            assert (inputs["pixel_values"] is None) == (images == 0)
            if images:  # image tokens = images x tokens per image; one patch grid per image
                assert images == inputs["grid_thw"].shape[0] * tiny.tokens_per_image == inputs["pixel_values"].shape[0] * tiny.tokens_per_image
                assert inputs["pixel_values"].shape[1:] == (tiny.encoder.patches_per_image, tiny.encoder.patch_dim)
            pad = inputs["input"] == PAD_TOKEN_ID
            assert (labels[pad] == IGNORE_INDEX).all()
            n += int((~pad).sum())
        assert n == work.real_tokens and work.padding_tokens == 3 * SEQ - n


def test_streamed_rows_hold_each_batch_of_pipetunes_stream_once_in_order(datamix2_dir, tiny):
    """Rows one at a time: after the rows of the first B global batches, the real tokens are
    exactly those B batches' (as pipetune's own loader builds them), for B = 1, 2, 3."""
    pipetune = DataLoaderConfig(data=datamix2_dir, gbs=8, max_seq_len=SEQ, packing=PackingConfig(max_seq_len=SEQ), max_steps=3).build(tiny)
    want = [torch.cat([mb.tokens for mb in batch.micro_batches]) for batch in pipetune]
    rows = iter(_loader(datamix2_dir, tiny, rows_per_step=1))
    got: list[int] = []
    for b in range(3):
        expected = sorted(torch.cat(want[:b + 1]).tolist())
        while len(got) < len(expected):
            tokens = next(rows)[0]["input"][0]
            got += tokens[tokens != PAD_TOKEN_ID].tolist()
        assert sorted(got) == expected, f"after batch {b}"


def test_padded_steps_are_pipetunes_batches_with_the_same_loss_normaliser(datamix2_dir, tiny):
    pipetune = DataLoaderConfig(data=datamix2_dir, gbs=8, max_seq_len=SEQ, packing=PackingConfig(max_seq_len=SEQ), max_steps=4).build(tiny)
    rows = max(rows_needed(pipetune, 4, SEQ))
    steps = _steps(_loader(datamix2_dir, tiny, rows_per_step=rows, pad_steps=True), rows, 4)
    for step, batch in zip(steps, pipetune):
        tokens = torch.cat([inputs["input"][0] for inputs, _ in step])
        labels = torch.cat([lab[0] for _, lab in step])
        assert int((labels != IGNORE_INDEX).sum()) == batch.num_label_tokens
        real = tokens[tokens != PAD_TOKEN_ID]
        assert sorted(real.tolist()) == sorted(torch.cat([mb.tokens for mb in batch.micro_batches]).tolist())


def test_a_batch_needing_more_rows_than_a_padded_step_holds_is_named(datamix2_dir, tiny):
    with pytest.raises(ValueError, match=r"step 0: .* more than dataloader.rows_per_step 1"):
        _steps(_loader(datamix2_dir, tiny, rows_per_step=1, pad_steps=True), 1, 1)
