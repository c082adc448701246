import json

import numpy as np
import pytest

from pipetune.data import make_mix, open_dataset, write_dataset
from pipetune.data.text import BYTE_OFFSET


def test_generated_dataset_round_trips(tmp_path):
    t = make_mix("datamix3", 500, seed=2)
    write_dataset(t, tmp_path / "d", {"seed": 2})
    store = open_dataset(tmp_path / "d")
    assert store.content_seed == 2 and not store.has_token_ids
    for col in ("ids", "text_tokens", "num_images", "image_offsets", "image_ptr"):
        assert np.array_equal(getattr(store.table, col), getattr(t, col))
    assert [store.table.source_names[c] for c in store.table.source] == [t.source_names[c] for c in t.source]


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_user_jsonl_with_token_ids_and_image_files(tmp_path):
    from PIL import Image

    Image.new("RGB", (30, 20)).save(tmp_path / "a.png")
    f = _write_jsonl(tmp_path / "d.jsonl", [
        {"id": 7, "source": "mine", "input_ids": [5, 6, 7, 8], "images": ["a.png"], "image_offsets": [2]},
        {"id": 9, "source": "mine", "input_ids": [1, 2], "images": [], "image_offsets": []},
    ])
    store = open_dataset(f)
    assert store.table.ids.tolist() == [7, 9]
    assert store.table.text_tokens.tolist() == [4, 2] and store.table.num_images.tolist() == [1, 0]
    assert store.table.offsets_of(0).tolist() == [2] and store.table.image_sizes.tolist() == [[20, 30]]
    assert store.has_token_ids and store.has_image_files
    assert store.rows([1])[0]["input_ids"] == [1, 2]


def test_user_text_with_image_placeholders(tmp_path):
    f = _write_jsonl(tmp_path / "t.jsonl", [{"text": "ab<image>cde<image>"}, {"text": "héllo"}])
    t = open_dataset(f).table
    assert t.text_tokens.tolist() == [5, 6]  # 'é' is two UTF-8 bytes
    assert t.num_images.tolist() == [2, 0] and t.offsets_of(0).tolist() == [2, 5]
    assert t.ids.tolist() == [0, 1] and t.source_names == ("user",)


def test_parquet_directory_loads_through_the_same_path(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text_tokens": [3, 4], "num_images": [1, 0]}).to_parquet(str(tmp_path / "part0.parquet"))
    t = open_dataset(tmp_path).table
    assert t.text_tokens.tolist() == [3, 4] and t.offsets_of(0).tolist() == [0]


@pytest.mark.parametrize(
    "rows,message",
    [
        ([{"caption": "x"}], "rows need one of the columns"),
        ([{"id": 1, "text_tokens": 3}, {"id": 1, "text_tokens": 4}], "sample id 1 appears more than once"),
        ([{"text": "a<image>b", "num_images": 2}], "sample id=0 has 1 <image> placeholders but 2 images"),
        # a row without text is left out (test_bad_data_inputs); a data set of only such rows has nothing to train on
        ([{"id": 4, "input_ids": []}], r"no row is left: all 1 are left out \(row 0: sample id=4 has no text token"),
        ([{"text_tokens": 3, "num_images": 2, "image_offsets": [0]}], "sample id=0 has 1 image_offsets but 2 images"),
    ],
)
def test_bad_user_rows_are_named(tmp_path, rows, message):
    with pytest.raises(ValueError, match=message):
        open_dataset(_write_jsonl(tmp_path / "bad.jsonl", rows))


def test_missing_and_empty_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_dataset(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no HF data set, .jsonl, .json, .parquet or webdataset .tar files"):
        open_dataset(tmp_path / "empty")


def test_byte_tokenizer_offsets():
    from pipetune.data.text import BYTE_TOKENIZER

    p = BYTE_TOKENIZER.split("A<image>")
    assert p.token_ids == [ord("A") + BYTE_OFFSET] and p.image_offsets == [1]


def test_metadata_is_computed_once_per_data_set_and_again_when_it_changes(tmp_path, monkeypatch):
    from pipetune.data import storage

    monkeypatch.setenv("PIPETUNE_CACHE", str(tmp_path / "cache"))
    f = _write_jsonl(tmp_path / "d.jsonl", [{"text": "ab<image>c", "num_images": 1}, {"text": "hello", "num_images": 0}])
    first = open_dataset(f).table
    computed = []
    real = storage.row_metadata
    monkeypatch.setattr(storage, "row_metadata", lambda *a, **kw: computed.append(1) or real(*a, **kw))
    again = open_dataset(f).table
    assert not computed and again.digest() == first.digest() and np.array_equal(again.image_offsets, first.image_offsets)
    _write_jsonl(f, [{"text": "abc<image>de", "num_images": 1}, {"text": "hello", "num_images": 0}])  # changed in place
    changed = open_dataset(f).table
    assert computed and changed.text_tokens.tolist() == [5, 5] and changed.offsets_of(0).tolist() == [3]
    from PIL import Image

    Image.new("RGB", (8, 6)).save(tmp_path / "a.png")
    named = _write_jsonl(tmp_path / "n.jsonl", [{"text": "x", "images": ["a.png"]}])
    computed.clear()
    open_dataset(named), open_dataset(named)
    assert len(computed) == 2  # rows that name image files: their sizes may change unseen, never cached
