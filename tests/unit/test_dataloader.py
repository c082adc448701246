import json
import re

import numpy as np
import pytest
import torch

from pipetune.data import make_mix, write_dataset
from pipetune.packing import PackingConfig
from torchtitan_patches.data import DataLoaderConfig
from torchtitan_patches.data.micro_batch import IGNORE_INDEX, IMAGE_TOKEN_ID, PAD_TOKEN_ID, synthetic_tokens


def loader_config(data, **kw):
    base = dict(data=data, gbs=8, max_seq_len=512, packing=PackingConfig(mbs=1, max_seq_len=512))
    return DataLoaderConfig(**{**base, **kw})


def same_batch(a, b):
    return a.step == b.step and len(a.micro_batches) == len(b.micro_batches) and all(
        x.equal(y) for x, y in zip(a.micro_batches, b.micro_batches)
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_exact_over_60_steps(datamix2_dir, tiny, workers):
    cfg = loader_config(datamix2_dir, num_workers=workers, prefetch_factor=2 if workers else None, max_steps=60)
    reference = list(cfg.build(tiny))
    assert [b.step for b in reference] == list(range(60))

    first = cfg.build(tiny)
    it = iter(first)
    head = [next(it) for _ in range(23)]
    state = first.state_dict()
    resumed = cfg.build(tiny)
    resumed.load_state_dict(state)
    tail = list(resumed)
    got = head + tail
    assert len(got) == 60
    assert all(same_batch(a, b) for a, b in zip(reference, got))
    # the abandoned stream's workers stop now, freed by reference count: left to the cycle collector (the loader and its
    # iterator refer to each other), their queues are torn down before the stop reaches them and it waits 5 s a worker
    it.close()
    first._iterator = None


def test_upcoming_metadata_matches_what_is_yielded(datamix2_dir, tiny):
    dl = loader_config(datamix2_dir, max_steps=6).build(tiny)
    ahead = dl.upcoming(3)
    it = iter(dl)
    b0 = next(it)
    assert sorted(sum(b0.sample_ids, [])) == sorted(ahead[0].table.ids.tolist())
    later = dl.upcoming(2)
    assert [m.step for m in later] == [1, 2]
    assert np.array_equal(later[0].table.ids, ahead[1].table.ids)


def test_tensors_follow_the_metadata(datamix2_dir, tiny):
    dl = loader_config(datamix2_dir, max_steps=3).build(tiny)
    for batch in dl:
        meta = dl.meta(batch.step)
        by_id = {int(s): k for k, s in enumerate(meta.table.ids)}
        for mb in batch.micro_batches:
            lengths = np.diff(mb.cu_seqlens.numpy())
            assert mb.tokens.shape == mb.labels.shape == mb.positions.shape
            assert mb.num_tokens == lengths.sum() <= 512
            assert mb.image_token_index.numel() == mb.num_images * tiny.tokens_per_image
            assert (mb.tokens[mb.image_token_index] == IMAGE_TOKEN_ID).all()
            images = mb.image_token_index.view(-1, tiny.tokens_per_image)
            assert (mb.labels[images[:, :-1]] == IGNORE_INDEX).all()  # image tokens predict nothing...
            for sid, start, n in zip(mb.sample_ids.tolist(), mb.cu_seqlens[:-1].tolist(), lengths.tolist()):
                k = by_id[sid]
                assert n == meta.table.lengths[k]
                assert mb.positions[start : start + n].tolist() == list(range(n))
                doc = mb.tokens[start : start + n]
                text = np.ones(n, bool)
                idx = mb.image_token_index.numpy()
                text[idx[(idx >= start) & (idx < start + n)] - start] = False
                expect = synthetic_tokens(1, sid, int(meta.table.text_tokens[k]), tiny.backbone.vocab_size)
                assert doc.numpy()[text].tolist() == expect.tolist()
                lab = mb.labels[start : start + n].numpy()
                assert lab[-1] == IGNORE_INDEX  # nothing to predict past a document's end
                nxt = np.flatnonzero(text[1:])
                assert (lab[nxt] == doc.numpy()[nxt + 1]).all()  # ...except the next text token
                assert (lab[np.flatnonzero(~text[1:])] == IGNORE_INDEX).all()


def test_label_count_does_not_depend_on_packing(datamix2_dir, tiny):
    counts = {}
    for packer, mbs in (("balanced", 1), ("original", 2), ("balanced", 3)):
        cfg = loader_config(datamix2_dir, packing=PackingConfig(packer=packer, mbs=mbs, max_seq_len=512), max_steps=4)
        counts[(packer, mbs)] = [b.num_label_tokens for b in cfg.build(tiny)]
    assert len({tuple(v) for v in counts.values()}) == 1


@pytest.mark.parametrize("multiple", [2, 4])
def test_sequence_parallel_padding_adds_one_document_without_labels(datamix2_dir, tiny, multiple):
    """Padded to a multiple (tensor parallelism with sequence parallelism): each micro-batch is the
    unpadded one followed by one short document of reserved ids, with no labels."""
    plain = list(loader_config(datamix2_dir, max_steps=3).build(tiny))
    padded = list(loader_config(datamix2_dir, max_steps=3, seq_multiple=multiple).build(tiny))
    pads = []
    for a, b in zip(plain, padded):
        assert b.num_label_tokens == a.num_label_tokens
        for x, y in zip(a.micro_batches, b.micro_batches):
            n, pad = x.num_tokens, -x.num_tokens % multiple
            assert y.num_tokens == n + pad and y.num_tokens % multiple == 0
            assert torch.equal(y.tokens[:n], x.tokens) and torch.equal(y.labels[:n], x.labels) and torch.equal(y.positions[:n], x.positions)
            assert (y.tokens[n:] == PAD_TOKEN_ID).all() and (y.labels[n:] == IGNORE_INDEX).all()
            assert y.cu_seqlens.tolist() == x.cu_seqlens.tolist() + ([n + pad] if pad else [])
            assert torch.equal(y.pixel_values, x.pixel_values) and torch.equal(y.image_token_index, x.image_token_index)
            pads.append(pad)
    assert any(pads)


def test_an_outside_packing_is_used_as_given(datamix2_dir, tiny):
    chosen = {}

    def one_per_micro_batch_reversed(meta):
        chosen[meta.step] = [[int(s)] for s in meta.table.ids[::-1]]
        return chosen[meta.step]

    dl = loader_config(datamix2_dir, max_steps=2).build(tiny, packing_source=one_per_micro_batch_reversed)
    for batch in dl:
        assert batch.sample_ids == chosen[batch.step]


@pytest.mark.parametrize(
    "bad,message",
    [
        (lambda ids: [ids[:-1]], "packing misses sample id="),
        (lambda ids: [ids, ids[:1]], "packing repeats sample id="),
        (lambda ids: [ids, []], "micro-batch 1 of the packing is empty"),
        (lambda ids: [ids + [10**9]], "packing names sample id=1000000000, which is not in this batch"),
    ],
)
def test_a_wrong_outside_packing_is_refused(datamix2_dir, tiny, bad, message):
    dl = loader_config(datamix2_dir, max_steps=1).build(tiny, packing_source=lambda m: bad(m.table.ids.tolist()))
    with pytest.raises(ValueError, match=message):
        next(iter(dl))


def test_user_rows_with_token_ids_and_an_image_file(tmp_path, tiny):
    from PIL import Image

    Image.fromarray(np.full((40, 40, 3), 255, np.uint8)).save(tmp_path / "white.png")
    rows = [
        {"id": 1, "input_ids": [10, 11, 12, 13], "images": ["white.png"], "image_offsets": [2]},
        {"id": 2, "input_ids": [20, 21], "images": [], "image_offsets": []},
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DataLoaderConfig(data=tmp_path / "d.jsonl", gbs=2, max_seq_len=64, shuffle=False,
                           packing=PackingConfig(mbs=1, max_seq_len=64), max_steps=1)
    (batch,) = list(cfg.build(tiny))
    (mb,) = batch.micro_batches
    docs = dict(zip(mb.sample_ids.tolist(), zip(mb.cu_seqlens[:-1].tolist(), np.diff(mb.cu_seqlens.numpy()).tolist())))
    s, n = docs[1]
    assert mb.tokens[s : s + n].tolist() == [10, 11] + [IMAGE_TOKEN_ID] * 16 + [12, 13]
    assert torch.allclose(mb.pixel_values, torch.ones_like(mb.pixel_values))
    s, n = docs[2]
    assert mb.tokens[s : s + n].tolist() == [20, 21]


def test_token_ids_outside_the_vocabulary_are_named(tmp_path, tiny):
    (tmp_path / "d.jsonl").write_text(json.dumps({"id": 5, "input_ids": [1, 99999]}))
    cfg = DataLoaderConfig(data=tmp_path / "d.jsonl", gbs=1, max_seq_len=64, packing=PackingConfig(mbs=1, max_seq_len=64))
    with pytest.raises(ValueError, match="sample id=5 has token id 99999 outside the vocabulary of 512"):
        next(iter(cfg.build(tiny)))


def _state_after(cfg, model, steps=2, **build):
    loader = cfg.build(model, **build)
    it = iter(loader)
    for _ in range(steps):
        next(it)
    return loader.state_dict()


@pytest.mark.parametrize(
    "change,fields",
    [
        (dict(gbs=16), ["gbs"]),
        (dict(seed=1), ["seed"]),
        (dict(shuffle=False), ["shuffle"]),
        (dict(max_seq_len=256, packing=PackingConfig(mbs=1, max_seq_len=256)), ["max_seq_len"]),
        (dict(overlong="reject"), ["overlong"]),
        (dict(packing=PackingConfig(packer="original", mbs=1, max_seq_len=512)), ["packer"]),
        (dict(packing=PackingConfig(mbs=2, max_seq_len=512)), ["mbs"]),
        (dict(packing=PackingConfig(mbs=1, max_seq_len=512, seed=4)), ["packing_seed"]),
        ("model", ["image_sizing"]),
        ("copy", ["data"]),
        ("more_rows", ["data", "rows", "data_digest"]),
    ],
)
def test_a_state_from_another_configuration_is_refused_naming_each_field(datamix2_dir, tiny, tmp_path, change, fields):
    import dataclasses
    import shutil

    base = loader_config(datamix2_dir, max_steps=10)
    state = _state_after(base, tiny)
    model, cfg = tiny, base
    if change == "model":
        model = dataclasses.replace(tiny, encoder=dataclasses.replace(tiny.encoder, image_size=64))
    elif change == "copy":
        shutil.copytree(datamix2_dir, tmp_path / "copy")
        cfg = dataclasses.replace(base, data=tmp_path / "copy")
    elif change == "more_rows":
        write_dataset(make_mix("datamix2", 3001, seed=1), tmp_path / "more", {"seed": 1})
        cfg = dataclasses.replace(base, data=tmp_path / "more")
    else:
        cfg = dataclasses.replace(base, **change)
    other = cfg.build(model)
    with pytest.raises(ValueError, match="saved for another configuration") as err:
        other.load_state_dict(state)
    named = [k for k in state["fingerprint"] if re.search(rf"[:;] {k}: saved", str(err.value))]
    assert named == fields
    assert "start this one from step 0" in str(err.value)


def test_a_state_resumes_at_another_data_parallel_share(datamix2_dir, tiny):
    """The stream does not depend on the data-parallel degree: a state saved on one rank resumes
    at its step on another rank of another degree; its overlong totals, which counted the saved
    share's samples, restart at zero."""
    cfg = loader_config(datamix2_dir, max_steps=10)
    state = _state_after(cfg, tiny)
    other = cfg.build(tiny, dp_rank=1, dp_size=2)
    other.load_state_dict(state)
    assert other.upcoming(1)[0].step == state["next_step"] == 2
    assert state["truncation"]["samples"] > 0 and other.truncation.samples == 0


def test_a_data_set_rewritten_in_place_is_refused(tmp_path, tiny):
    import shutil

    write_dataset(make_mix("datamix2", 500, seed=1), tmp_path / "d", {"seed": 1})
    cfg = loader_config(tmp_path / "d", max_steps=4)
    state = _state_after(cfg, tiny)
    shutil.rmtree(tmp_path / "d")
    write_dataset(make_mix("datamix2", 500, seed=2), tmp_path / "d", {"seed": 2})
    with pytest.raises(ValueError, match=r"[:;] data_digest: saved '[0-9a-f]+:1', now '[0-9a-f]+:2'"):
        cfg.build(tiny).load_state_dict(state)


def test_a_state_without_its_configuration_is_refused(datamix2_dir, tiny):
    cfg = loader_config(datamix2_dir, max_steps=4)
    state = _state_after(cfg, tiny)
    del state["fingerprint"]
    with pytest.raises(ValueError, match="no record of the configuration"):
        cfg.build(tiny).load_state_dict(state)


@pytest.mark.parametrize("policy", ["truncate", "reject"])
def test_overlong_samples_are_counted_and_the_count_matches_the_tensors(datamix2_dir, tiny, policy):
    """Tokens yielded + tokens cut = the stream's samples' full lengths; samples yielded + rejected = gbs."""
    cfg = loader_config(datamix2_dir, gbs=32, max_seq_len=256, packing=PackingConfig(mbs=2, max_seq_len=256),
                        overlong=policy, max_steps=12)
    loader = cfg.build(tiny)
    full = loader.store.table.with_image_tokens(loader.sizing.tokens(loader.store.table.image_sizes))
    yielded_tokens = yielded_samples = raw_tokens = shortened = 0
    for batch in loader:
        rows = loader.stream.rows(batch.step)
        raw_tokens += int(full.lengths[rows].sum())
        length_of = dict(zip(full.ids[rows].tolist(), full.lengths[rows].tolist()))
        for mb in batch.micro_batches:
            yielded_tokens += mb.num_tokens
            yielded_samples += len(mb.sample_ids)
            doc_lens = np.diff(mb.cu_seqlens.numpy())
            shortened += int(sum(n < length_of[s] for s, n in zip(mb.sample_ids.tolist(), doc_lens.tolist())))
    t = loader.truncation
    assert t.samples == 12 * 32 and t.tokens == raw_tokens
    assert t.tokens_cut == raw_tokens - yielded_tokens > 0
    assert t.rejected == t.samples - yielded_samples
    assert t.truncated == shortened
    assert (t.truncated > 0) == (policy == "truncate") and (t.rejected > 0) == (policy == "reject")
    assert f"overlong ({policy}): {t.truncated + t.rejected} of {t.samples} samples" in t.describe()


def test_overlong_totals_survive_a_resume(datamix2_dir, tiny):
    cfg = loader_config(datamix2_dir, gbs=32, max_seq_len=256, packing=PackingConfig(mbs=2, max_seq_len=256), max_steps=10)
    whole = cfg.build(tiny)
    list(whole)
    state = _state_after(cfg, tiny, steps=4)
    resumed = cfg.build(tiny)
    resumed.load_state_dict(state)
    list(resumed)
    assert resumed.truncation == whole.truncation and whole.truncation.truncated > 0


def test_overlong_error_policy_names_the_sample(datamix2_dir, tiny):
    cfg = loader_config(datamix2_dir, gbs=32, max_seq_len=256, packing=PackingConfig(mbs=2, max_seq_len=256),
                        overlong="error", max_steps=3)
    with pytest.raises(ValueError, match=r"sample id=\d+ is \d+ tokens .* longer than max_seq_len=256"):
        list(cfg.build(tiny))


def test_metadata_label_count_matches_the_tensors(datamix2_dir, tiny):
    loader = loader_config(datamix2_dir, max_steps=6).build(tiny)
    for batch in loader:
        assert batch.num_label_tokens == int(loader.meta(batch.step).table.label_tokens.sum()) > 0


def test_a_batch_with_nothing_to_predict_is_an_error(tmp_path, tiny):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"input_ids": [7]}) for _ in range(8)))
    cfg = DataLoaderConfig(data=tmp_path / "d.jsonl", gbs=4, max_seq_len=64, packing=PackingConfig(mbs=1, max_seq_len=64))
    with pytest.raises(ValueError, match=r"step 0: none of the batch's 4 samples has a token to predict .* loss would be 0/0"):
        next(iter(cfg.build(tiny)))


def test_the_titan_loader_names_the_job_option_behind_each_refused_field(datamix2_dir, tiny, tmp_path):
    """What a resumed TorchTitan job prints: each field that differs with the option to set back
    (``PipeTuneTitanDataLoader.OPTIONS``); a state saved at data-parallel rank 1 of 2 loads at DP 1."""
    import shutil

    from torchtitan_patches.titan.dataloader import PipeTuneTitanDataLoader

    def titan_loader(seq_len=512, dp=(0, 1), **kw):
        config = PipeTuneTitanDataLoader.Config(**{"dataset_path": str(datamix2_dir), "gbs": 8, "num_workers": 0, **kw})
        loader = config.build(seq_len=seq_len, dp_rank=dp[0], dp_world_size=dp[1])
        loader.bind(tiny, packing_source=None)
        return loader

    saved = titan_loader(dp=(1, 2))
    next(iter(saved))
    state = saved.state_dict()
    shutil.copytree(datamix2_dir, tmp_path / "copy")
    for change, named in [({"seed": 1}, "seed (dataloader.seed): saved 0, now 1"), ({"gbs": 4}, "gbs (dataloader.gbs): saved 8, now 4"),
                          ({"seq_len": 256}, "max_seq_len (training.seq_len): saved 512, now 256"),
                          ({"dataset_path": str(tmp_path / "copy")}, "data (dataloader.dataset_path): saved"),
                          ({"overlong": "reject"}, "overlong (dataloader.overlong): saved 'truncate', now 'reject'")]:
        with pytest.raises(ValueError, match="saved for another configuration") as err:
            titan_loader(**change).load_state_dict(state)
        assert named in str(err.value), (change, str(err.value))
    with pytest.raises(ValueError, match=r"dataloader.overlong='drop': use one of \['truncate', 'reject', 'error'\]"):
        titan_loader(overlong="drop")
    resumed = titan_loader()
    resumed.load_state_dict(state)
    assert next(iter(resumed)).step == 1  # the step after the saved one, at DP 1
