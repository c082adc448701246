"""Bad data inputs: each is a message naming the file, the row and the column and what to do,
never a traceback, a silent truncation or a misleading error about something else."""

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipetune.cli.main import main
from pipetune.data import make_mix, open_dataset, write_dataset

ROOT = Path(__file__).resolve().parents[2]

# (file name, content, message regex); rows are counted from 0, lines from 1
BAD_FILES = [
    ("empty.jsonl", "", r"empty\.jsonl: the file is empty; a data set needs at least one row"),
    ("blank.jsonl", "\n\n", r"blank\.jsonl: the file holds no rows"),
    (
        "missing.jsonl",
        '{"id": 1, "input_ids": [1, 2]}\n{"id": 2}\n',
        r"missing\.jsonl: row 1 \(counted from 0\), column 'input_ids': missing or null",
    ),
    (
        "missing_first.jsonl",
        '{"id": 1}\n{"id": 2, "input_ids": [1, 2]}\n',
        r"missing_first\.jsonl: row 0 \(counted from 0\), column 'input_ids': missing or null",
    ),
    ("null_text.jsonl", '{"text": "ab"}\n{"text": null}\n', r"null_text\.jsonl: row 1 .*column 'text': missing or null"),
    (
        "null_ids.jsonl",
        '{"input_ids": [1, 2]}\n{"input_ids": null}\n',
        r"null_ids\.jsonl: row 1 .*column 'input_ids': missing or null",
    ),
    (
        "null_token.jsonl",
        '{"input_ids": [1, 2]}\n{"input_ids": [3, null]}\n',
        r"null_token\.jsonl: row 1 .*column 'input_ids': holds a null",
    ),
    (
        "huge_id.jsonl",
        '{"id": 1, "text_tokens": 3}\n{"id": 99999999999999999999, "text_tokens": 3}\n',
        r"huge_id\.jsonl: row 1 .*column 'id': 1e\+20 does not fit in int64",  # JSON's reader makes it a float
    ),
    (
        "huge_token.jsonl",
        '{"input_ids": [1, 2]}\n{"input_ids": [1, 99999999999999999999]}\n',
        r"huge_token\.jsonl: row 1 .*column 'input_ids': 1e\+20 does not fit in int64",
    ),
    (
        "float_ids.jsonl",  # 0, 0.5, 1 must not become 0, 0, 1 and a "duplicate id" error
        '{"id": 0, "text_tokens": 3}\n{"id": 0.5, "text_tokens": 3}\n{"id": 1, "text_tokens": 3}\n',
        r"float_ids\.jsonl: row 1 .*column 'id': 0\.5 is not an integer; it needs whole numbers",
    ),
    (
        "float_count.jsonl",
        '{"text_tokens": 3}\n{"text_tokens": 2.5}\n',
        r"float_count\.jsonl: row 1 .*column 'text_tokens': 2\.5 is not an integer",
    ),
    (
        "float_images.jsonl",
        '{"text_tokens": 3, "num_images": 0}\n{"text_tokens": 3, "num_images": 0.5}\n',
        r"float_images\.jsonl: row 1 .*column 'num_images': 0\.5 is not an integer",
    ),
    (
        "float_token.jsonl",
        '{"input_ids": [1, 2]}\n{"input_ids": [1, 2.5]}\n',
        r"float_token\.jsonl: row 1 .*column 'input_ids': 2\.5 is not an integer",
    ),
    (
        "float_offset.jsonl",
        '{"text_tokens": 3, "num_images": 1, "image_offsets": [1.5]}\n',
        r"float_offset\.jsonl: row 0 .*column 'image_offsets': 1\.5 is not an integer",
    ),
    ("string_id.jsonl", '{"id": "a", "text_tokens": 3}\n', r"string_id\.jsonl: row 0 .*column 'id': holds the text 'a'"),
    ("one_image.jsonl", '{"text": "a<image>", "images": "x.png"}\n',
     r"one_image\.jsonl: row 0 .*column 'images': holds string values; it needs a list of image file names"),
    ("int_text.jsonl", '{"text": 5}\n', r"int_text\.jsonl: row 0 .*column 'text': holds int64 values; it needs strings"),
    ("null_source.jsonl", '{"text_tokens": 3, "source": "a"}\n{"text_tokens": 3, "source": null}\n',
     r"null_source\.jsonl: row 1 .*column 'source': missing or null"),
    (
        "broken.jsonl",
        '{"id": 1, "text_tokens": 3}\n{"id": 2,\n',
        r"broken\.jsonl, line 2: not valid JSON .*; write one JSON object per line",
    ),
]


@pytest.mark.parametrize("name,content,message", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_bad_rows_name_file_row_and_column(tmp_path, name, content, message):
    f = tmp_path / name
    f.write_text(content)
    with pytest.raises(ValueError, match=message):
        open_dataset(f)


def test_integral_floats_are_accepted_as_the_integers_they_are(tmp_path):
    f = tmp_path / "floats.jsonl"
    f.write_text('{"id": 0, "text_tokens": 3}\n{"id": 2.0, "text_tokens": 4.0}\n')
    t = open_dataset(f).table
    assert t.ids.tolist() == [0, 2] and t.text_tokens.tolist() == [3, 4]


def _truncate_arrow(d: Path):
    (f,) = glob.glob(str(d / "*.arrow"))
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)


def _overwrite(name: str, text: str):
    return lambda d: (d / name).write_text(text)


DAMAGED = [
    ("truncated_arrow", _truncate_arrow, r"data: cannot open the data set \(.*\); the file may be truncated or corrupt: make the data set again"),
    ("missing_arrow", lambda d: Path(glob.glob(str(d / "*.arrow"))[0]).unlink(), r"data: cannot open the data set \(FileNotFoundError"),
    ("bad_state", _overwrite("state.json", "{"), r"data: cannot open the data set \(JSONDecodeError"),
    ("bad_info", _overwrite("pipetune.json", "{"), r"data/pipetune\.json: not valid JSON"),
]


@pytest.mark.parametrize("damage,message", [d[1:] for d in DAMAGED], ids=[d[0] for d in DAMAGED])
def test_a_damaged_data_directory_is_named(tmp_path, damage, message):
    write_dataset(make_mix("datamix2", 2000, seed=0), tmp_path / "data", {"seed": 0})
    damage(tmp_path / "data")
    with pytest.raises(ValueError, match=message):
        open_dataset(tmp_path / "data")


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    import datasets

    def fail_halfway(self, path, **kw):
        Path(path).mkdir()
        (Path(path) / "data-00000-of-00001.arrow").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", fail_halfway)
    with pytest.raises(OSError, match="disk full"):
        write_dataset(make_mix("datamix2", 50, seed=0), tmp_path / "data", {"seed": 0})
    assert list(tmp_path.iterdir()) == []


def run_cli(*argv, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    return subprocess.run([sys.executable, "-m", "pipetune", *argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def test_data_make_refuses_an_existing_file_without_a_traceback(tmp_path):
    (tmp_path / "taken").write_text("keep me")
    res = run_cli("data", "make", "--samples", "10", "--out", "taken", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--out taken is an existing file; give a directory path that does not exist yet" in res.stderr
    assert (tmp_path / "taken").read_text() == "keep me"


def test_pack_on_a_bad_file_is_a_message_without_a_traceback(tmp_path):
    (tmp_path / "ids.jsonl").write_text('{"id": 0, "text_tokens": 3}\n{"id": 0.5, "text_tokens": 3}\n')
    res = run_cli("pack", "--data", "ids.jsonl", "--model", "tiny", "--gbs", "2", "--max-seq-len", "64", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "ids.jsonl: row 1 (counted from 0), column 'id': 0.5 is not an integer" in res.stderr


@pytest.mark.parametrize(
    "argv,setup,message",
    [
        (["data", "make", "--samples", "10", "--out", "{tmp}/full"], "full_dir", "is a directory that is not empty; choose a new directory"),
        (["pack", "--data", "{tmp}/empty.jsonl", "--model", "tiny"], "empty_file", "empty.jsonl: the file is empty"),
        (["pack", "--data", "{tmp}/two.jsonl", "--model", "tiny", "--gbs", "4", "--max-seq-len", "64"], "two_rows",
         "global batch size 4 is larger than the data set (2 rows)"),
    ],
)
def test_cli_data_errors_are_one_line_messages(tmp_path, capsys, argv, setup, message):
    if setup == "full_dir":
        (tmp_path / "full").mkdir()
        (tmp_path / "full" / "x").write_text("")
    elif setup == "empty_file":
        (tmp_path / "empty.jsonl").write_text("")
    else:
        (tmp_path / "two.jsonl").write_text('{"text_tokens": 3}\n{"text_tokens": 4}\n')
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("pipetune: error: ")


@pytest.mark.parametrize("ids,bad", [([1, 2, 3], None), ([4, -1], -1), ([5, 512], 512)])
def test_token_ids_outside_the_vocabulary_are_named_before_any_worker_starts(tmp_path, tiny, ids, bad):
    from pipetune.packing import PackingConfig
    from torchtitan_patches.data import DataLoaderConfig

    (tmp_path / "d.jsonl").write_text('{"input_ids": [7, 8]}\n{"input_ids": [9, 10, 11]}\n' + f'{{"input_ids": {ids}}}\n')
    cfg = DataLoaderConfig(data=tmp_path / "d.jsonl", gbs=3, max_seq_len=64, packing=PackingConfig(mbs=1, max_seq_len=64),
                           num_workers=2)
    if bad is None:
        cfg.build(tiny)
        return
    with pytest.raises(ValueError, match=rf"d\.jsonl: row 2 \(counted from 0\), column 'input_ids': sample id=2 has token id {bad} outside the vocabulary of 512"):
        cfg.build(tiny)


# ---------------------------------------------------------------- both paths: with an index and without
# Each bad input is refused (or handled by its policy) alike by `pipetune pack --data DATA` (the data
# set read as it is) and `pipetune data index DATA` (read in place by the index's readers).

PACK = ["pack", "--model", "tiny", "--gbs", "2", "--max-seq-len", "64", "--iters", "1", "--data"]
GOOD = [{"text": "a picture <image> of a cat", "images": ["ok.png"]}] * 3


def _png_header(width: int, height: int) -> bytes:
    """A PNG that is only its header: all Pillow reads to learn an image's size."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


def _jsonl(path: Path, rows) -> Path:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, columns: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


def _shard(path: Path, pairs: int) -> list[int]:
    """A webdataset shard of ``pairs`` image-caption pairs; returns where each member's data ends."""
    import io
    import tarfile

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, "PNG")
    ends = []
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(pairs):
            for field, data in (("png", buf.getvalue()), ("txt", f"caption {i}".encode())):
                info = tarfile.TarInfo(f"{i:04d}.{field}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                ends.append(tar.offset)
    return ends


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Every bad input of the tests below, written once."""
    import pyarrow as pa
    from PIL import Image

    d = tmp_path_factory.mktemp("corpus")
    Image.new("RGB", (16, 16)).save(d / "ok.png")
    (d / "bomb.png").write_bytes(_png_header(30000, 30000))  # 9e8 pixels: over Pillow's decompression-bomb limit
    _jsonl(d / "bomb.jsonl", GOOD + [{"text": "a bomb <image>", "images": ["bomb.png"]}])
    _jsonl(d / "url.jsonl", GOOD + [{"text": "a remote <image>", "images": ["https://example.com/cat.png"]}])
    _parquet(d / "empty_parquet" / "a.parquet", {"text": ["hello", "world"]})
    _parquet(d / "empty_parquet" / "b.parquet", {"text": pa.array([], pa.string())})
    _parquet(d / "parquet_columns" / "a.parquet", {"text": ["hello", "world"]})
    _parquet(d / "parquet_columns" / "b.parquet", {"text": ["hello", "world"], "source": ["x", "y"]})
    _jsonl(d / "jsonl_columns" / "a.jsonl", [{"text": "hello", "source": "x"}, {"text": "world", "source": "y"}])
    _jsonl(d / "jsonl_columns" / "b.jsonl", [{"text": "hello"}, {"text": "world"}])
    _jsonl(d / "blank_lines" / "a.jsonl", [{"text": "hello"}])
    (d / "blank_lines" / "b.jsonl").write_text('{"text": "hello"}\n\n{"text": "world"}\n\n  \n\n')
    (d / "row3.jsonl").write_text('{"text_tokens": 3}\n{"text_tokens": 4}\n\n{"text_tokens": 5}\n{"text_tokens": "many"}\n')
    _jsonl(d / "row3_list.jsonl", [{"input_ids": [1]}, {"input_ids": [2, 3]}, {"input_ids": []}, {"input_ids": [4, 2.5]}])
    (d / "row3_text.jsonl").write_text("".join(f'{{"id": "{i}", "text_tokens": 3}}\n' for i in ("0", "1", "2", "x")))
    ends = _shard(d / "cut" / "shard-0.tar", 50)
    with open(d / "cut" / "shard-0.tar", "r+b") as fh:
        fh.truncate(ends[19])  # right after member 20's data: 10 whole pairs and no end-of-archive blocks
    _shard(d / "whole" / "shard-0.tar", 50)
    textless = [{"input_ids": [], "images": ["ok.png"]}, {"input_ids": [], "images": ["ok.png", "ok.png"]}]
    _jsonl(d / "textless.jsonl", [{"input_ids": [1, 2, 3], "images": ["ok.png"]}, textless[0], {"input_ids": [4, 5], "images": []},
                                  textless[1]])
    _jsonl(d / "all_textless.jsonl", textless)
    return d


def _cli_error(capsys, *argv) -> str:
    """The error of a CLI run that must fail: exit code 2, no traceback, one line (after any
    progress bars), the last output."""
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("pipetune: error: ") == 1, err
    message = err.split("pipetune: error: ", 1)[1]
    assert message.count("\n") == 1 and message.endswith("\n"), err
    return message


def _cli_output(capsys, *argv) -> str:
    assert main([str(a) for a in argv]) == 0
    return capsys.readouterr().out


def _both_refuse(capsys, data: Path, out: Path, *expected: str) -> None:
    for argv in (PACK + [data], ["data", "index", data, "--out", out]):
        message = _cli_error(capsys, *argv)
        assert all(e in message for e in expected), (argv[0], message)


@pytest.mark.parametrize("name,image,why", [
    ("bomb", "bomb.png", "Shrink the image, or raise PIL.Image.MAX_IMAGE_PIXELS"),  # today: a traceback, under skip too
    ("url", "https://example.com/cat.png", "remote images are not read; download them"),
])
def test_an_image_that_is_not_read_is_named_or_left_out_by_the_policy(corpus, tmp_path, capsys, name, image, why):
    data = corpus / f"{name}.jsonl"
    _both_refuse(capsys, data, tmp_path / "index", f"{name}.jsonl: row 3 (counted from 0), column 'images': sample id=3: ", image, why,
                 "(bad_images=skip)")
    store = open_dataset(data, bad_images="skip")
    ((row, reason),) = store.skipped
    assert len(store) == 3 and row == 3 and image in reason and why in reason
    out = _cli_output(capsys, "data", "index", data, "--out", tmp_path / "skipping", "--bad-images", "skip")
    assert "indexed 3 samples" in out and "1 rows left out (listed in skipped.jsonl)" in out
    ((where, reason),) = open_dataset(tmp_path / "skipping", bad_images="skip").skipped
    assert where.endswith(", row 3") and image in reason and why in reason


@pytest.mark.parametrize("name,expected", [
    ("empty_parquet", ["empty_parquet/b.parquet: the file holds no rows; remove it from the data set"]),
    ("parquet_columns", ["parquet_columns/b.parquet: has columns ['source', 'text']",
                         "a.parquet has ['text']; every file of a data set needs the same columns"]),
    ("jsonl_columns", ["jsonl_columns/b.jsonl: has columns ['text']",
                       "a.jsonl has ['source', 'text']; every file of a data set needs the same columns"]),
    ("row3.jsonl", ["row3.jsonl, line 5, column 'text_tokens': holds a str where line 1 holds a number"]),  # line 3 is blank
    ("row3_text.jsonl", ["row3_text.jsonl: row 3 (counted from 0), column 'id': holds the text 'x'"]),
    ("row3_list.jsonl", ["row3_list.jsonl: row 3 (counted from 0), column 'input_ids': 2.5 is not an integer"]),
    ("cut", ["cut/shard-0.tar: the shard ends at byte", "without tar's end-of-archive blocks: it was cut short"]),
    ("all_textless.jsonl", ["all_textless.jsonl", "sample id=0 has no text token: nothing to train on"]),
])
def test_bad_files_are_named_alike_with_and_without_an_index(corpus, tmp_path, capsys, name, expected):
    _both_refuse(capsys, corpus / name, tmp_path / "index", *expected)


@pytest.mark.parametrize("name,rows", [("blank_lines", 3), ("whole", 50)])
def test_blank_lines_and_whole_shards_are_read_alike_with_and_without_an_index(corpus, tmp_path, capsys, name, rows):
    assert len(open_dataset(corpus / name)) == rows
    assert f"indexed {rows} samples" in _cli_output(capsys, "data", "index", corpus / name, "--out", tmp_path / "index")


def test_rows_without_text_are_left_out_and_counted(corpus, tmp_path, capsys):
    data = corpus / "textless.jsonl"
    store = open_dataset(data)
    assert store.table.ids.tolist() == [0, 2] and [r for r, _ in store.skipped] == [1, 3]
    assert "no text token" in store.skipped[0][1] and "samples_in_data=2" in _cli_output(capsys, *PACK, data)
    out = _cli_output(capsys, "data", "index", data, "--out", tmp_path / "index")
    assert "indexed 2 samples" in out and "2 rows left out (listed in skipped.jsonl)" in out
    assert open_dataset(tmp_path / "index").table.take([0, 1]).ids.tolist() == [0, 2]


def test_a_bad_token_id_after_a_left_out_row_is_named_at_its_own_row(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": []}, {"input_ids": [1, 2]}, {"input_ids": [3, 999]}])
    with pytest.raises(ValueError, match=r"d\.jsonl: row 2 \(counted from 0\), column 'input_ids': sample id=2 has token id 999"):
        open_dataset(data).check_token_ids(512)


def test_the_layout_search_samples_rows_under_the_jobs_bad_image_policy(corpus, tiny, monkeypatch):
    from types import SimpleNamespace

    from torchtitan_patches.titan import model_parts
    from torchtitan_patches.titan.dataloader import PipeTuneTitanDataLoader

    monkeypatch.setattr(model_parts, "replicas_of", lambda config: 1)
    config = SimpleNamespace(training=SimpleNamespace(seq_len=64), tokenizer=SimpleNamespace(build=lambda tokenizer_path: None),
                             hf_assets_path=None)
    config.dataloader = PipeTuneTitanDataLoader.Config(dataset_path=str(corpus / "bomb.jsonl"), gbs=2, bad_images="skip")
    assert {i for b in model_parts.sample_job_batches(config, tiny) for i in b.table.ids.tolist()} <= {0, 1, 2}
    config.dataloader.bad_images = "error"
    with pytest.raises(ValueError, match=r"bomb\.jsonl: row 3 .*bomb\.png: .*MAX_IMAGE_PIXELS"):
        model_parts.sample_job_batches(config, tiny)


def test_the_titan_loader_checks_gbs_against_the_data_set_before_the_model_and_opens_it_once(corpus, tiny):
    from torchtitan_patches.titan.dataloader import PipeTuneTitanDataLoader

    config = PipeTuneTitanDataLoader.Config(dataset_path=str(corpus / "textless.jsonl"), gbs=3, num_workers=0)
    with pytest.raises(ValueError, match=r"dataloader\.gbs 3 is larger than the data set .*textless\.jsonl \(2 rows to train on; "
                                         r"2 more are left out\).*use dataloader\.gbs <= 2"):
        config.build(seq_len=64)
    config.gbs = 2
    loader = config.build(seq_len=64)
    assert loader.bind(tiny, packing_source=None).store is loader.store
