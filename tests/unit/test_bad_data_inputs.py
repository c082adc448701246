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
    ("blank.jsonl", "\n\n", r"blank\.jsonl: the file has no rows"),
    (
        "missing.jsonl",
        '{"id": 1, "input_ids": [1, 2]}\n{"id": 2}\n',
        r"missing\.jsonl, line 2: lacks column\(s\) \['input_ids'\] that line 1 has; every row needs the same columns",
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
        r"huge_id\.jsonl, line 2, column 'id': 99999999999999999999 does not fit in int64",
    ),
    (
        "huge_token.jsonl",
        '{"input_ids": [1, 2]}\n{"input_ids": [1, 99999999999999999999]}\n',
        r"huge_token\.jsonl, line 2, column 'input_ids': 99999999999999999999 does not fit in int64",
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
    ("string_id.jsonl", '{"id": "a", "text_tokens": 3}\n', r"string_id\.jsonl: row 0 .*column 'id': holds string values"),
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
