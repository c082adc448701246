"""The metadata index (``pipetune data index``): the indexed path gives the un-indexed path's samples,
batches and tensors; a build gives the same bytes however it is split, spread or interrupted; a
stale or partial index, or one of other settings, is refused naming the file and the command;
opening touches nothing per sample."""

import json
import os
import pickle
import shutil

import numpy as np
import pytest
from PIL import Image

from pipetune.cli.main import main
from pipetune.data import make_mix, write_dataset
from pipetune.data.fixture import DATA_DIR, TOKENIZER_DIR, write_fixture
from pipetune.data.index import StaleIndex, build_index, open_index
from pipetune.data.index.disk_format import RECORDS, _npy_header, write_generated
from pipetune.data.storage import open_dataset
from pipetune.data.tokenizer_files import load_tokenizer
from pipetune.packing import PackingConfig
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from torchtitan_patches.data import DataLoaderConfig
from torchtitan_patches.models.muse_glimmer.spec import muse_glimmer_spec
from torchtitan_patches.models.model_spec import planning_model_config
from torchtitan_patches.titan.tokenizer import text_tokenizer


@pytest.fixture(scope="module")
def muse():
    return planning_model_config(muse_glimmer_spec(), image_grid=4)


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    """TorchTitan's formats (webdataset pairs, parquet documents) as a directory of data sets, raw
    text under a BPE tokenizer."""
    out = tmp_path_factory.mktemp("fx") / "fx"
    write_fixture(out, pairs=40, documents=8, text_only=8)
    return out


@pytest.fixture(scope="module")
def jsonl_images(tmp_path_factory):
    """pipetune's columns over three JSON-lines files: ids, raw text with placeholders, image files
    (one PNG of its own size per image), blank lines between rows."""
    root = tmp_path_factory.mktemp("jl")
    (root / "img").mkdir()
    rng = np.random.default_rng(0)
    row = 0
    for f in range(3):
        lines = []
        for _ in range(30):
            k = int(rng.integers(0, 3))
            names = []
            for j in range(k):
                name = f"img/{row}_{j}.png"
                Image.new("RGB", (int(rng.integers(20, 90)), int(rng.integers(20, 90))), (row % 255, j, 7)).save(root / name)
                names.append(name)
            text = " ".join(["word"] * int(rng.integers(1, 30)))
            text = "<image>" * k + text if row % 2 else text + "<image>" * k
            lines.append(json.dumps({"id": 1000 + 3 * row, "text": text, "images": names}))
            row += 1
        (root / f"part-{f}.jsonl").write_text("\n\n".join(lines) + "\n\n")
    return root


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "d"
    write_dataset(make_mix("datamix2", 500, seed=2), out, {"mix": "datamix2", "seed": 4})
    return out


def _index(data, out, **kw):
    build_index(data, out, progress=False, **kw)
    return out


def _same_table(a, b) -> None:
    n = len(a)
    assert n == len(b)
    ta, tb = a.table.take(np.arange(n)), b.table.take(np.arange(n))
    for f in ("ids", "source", "text_tokens", "num_images", "image_offsets", "image_ptr", "image_sizes"):
        assert np.array_equal(getattr(ta, f), getattr(tb, f)), f
    assert (ta.source_names, ta.image_markers) == (tb.source_names, tb.image_markers)


def _batches(store_path, model, tokenizer, steps, **kw):
    config = DataLoaderConfig(data=store_path, gbs=16, max_seq_len=512, seed=3, max_steps=steps,
                              packing=PackingConfig(max_seq_len=512, mbs=2), **kw)
    return config.build(model, tokenizer=tokenizer)


@pytest.mark.parametrize("corpus", ["fixture", "jsonl_images", "one_file", "generated"])
def test_indexed_path_yields_the_same_samples_batches_and_tensors(corpus, request, tmp_path, muse):
    """Built by the command line's tokenizer, read by the job's (TorchTitan's) one."""
    data = request.getfixturevalue(corpus) if corpus != "one_file" else None
    if corpus == "fixture":
        build = {"tokenizer": load_tokenizer(data / TOKENIZER_DIR)}
        job = {"tokenizer": text_tokenizer(HuggingFaceTokenizer(tokenizer_path=str(data / TOKENIZER_DIR)))}
        data = data / DATA_DIR
    elif corpus == "one_file":
        data, build, job = request.getfixturevalue("jsonl_images") / "part-2.jsonl", {}, {}
    else:
        build = job = {}
    index = _index(data, tmp_path / "index", **build)
    plain = open_dataset(data, **job)
    _same_table(plain, open_dataset(index, **job))
    a, b = (_batches(p, muse, plain.tokenizer, 12) for p in (data, index))
    n = 0
    for x, y in zip(a, b):  # 12 steps of 16 cross every corpus's first epoch edge but the generated one's
        assert x.sample_ids == y.sample_ids
        assert all(p.equal(q) for p, q in zip(x.micro_batches, y.micro_batches)), f"step {x.step}: other tensors"
        n += 1
    assert n == 12


def test_loader_on_an_index_resumes_exactly(jsonl_images, tmp_path, muse):
    index = _index(jsonl_images, tmp_path / "index")
    tok = open_dataset(index).tokenizer
    reference = [b.sample_ids for b in _batches(index, muse, tok, 20)]
    loader = _batches(index, muse, tok, 20)
    it = iter(loader)
    for _ in range(7):
        next(it)
    state = loader.state_dict()
    resumed = _batches(index, muse, tok, 20)
    resumed.load_state_dict(state)
    assert [b.sample_ids for b in resumed] == reference[7:]


def _files(index):
    return {p.name: p.read_bytes() for p in sorted(index.iterdir()) if p.is_file()}


def test_the_same_bytes_however_the_build_is_split_spread_or_interrupted(fixture, tmp_path):
    data, tok = fixture / DATA_DIR, load_tokenizer(fixture / TOKENIZER_DIR)
    whole = _files(_index(data, tmp_path / "whole", tokenizer=tok))
    assert _files(_index(data, tmp_path / "workers", tokenizer=tok, workers=2)) == whole
    assert build_index(data, tmp_path / "parts", tokenizer=tok, part=(1, 2), progress=False) is None  # waits for part 0
    assert _files(_index(data, tmp_path / "parts", tokenizer=tok, part=(0, 2))) == whole  # the last part assembles
    # interrupted: one part file left half-written beside a finished one, then the same command again
    first = sorted((tmp_path / "whole" / "parts").iterdir())[0]
    (tmp_path / "stopped" / "parts").mkdir(parents=True)
    shutil.copy(tmp_path / "whole" / "build.json", tmp_path / "stopped")
    shutil.copy(first, tmp_path / "stopped" / "parts")
    (tmp_path / "stopped" / "parts" / ".00000001.tmp-1.npz").write_bytes(b"\0" * 10)
    assert _files(_index(data, tmp_path / "stopped", tokenizer=tok)) == whole


def _cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_stale_partial_or_foreign_indexes_are_refused_naming_the_file_and_the_command(jsonl_images, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(jsonl_images, data)
    index = _index(data, tmp_path / "index")
    open_index(index)  # fresh
    command = f"pipetune data index {data} --out {index}"

    def refused(match):
        with pytest.raises(StaleIndex, match=match):
            open_dataset(index)
        code, err = _cli(capsys, "pack", "--data", str(index), "--model", "tiny", "--iters", "1", "--gbs", "8")
        assert code == 2 and len(err.strip().splitlines()) == 1 and command in err

    part = data / "part-1.jsonl"
    original = part.read_bytes()
    os.utime(part, ns=(part.stat().st_atime_ns, part.stat().st_mtime_ns + 10**9))
    refused(r"part-1\.jsonl: its modification time changed")
    _index(data, index)  # the same command rebuilds what changed
    open_index(index)
    shutil.copy(part, data / "part-3.jsonl")
    refused(r"part-3\.jsonl: added after")
    (data / "part-3.jsonl").unlink()
    part.unlink()
    refused(r"part-1\.jsonl: indexed in .* but missing now")
    part.write_bytes(original)
    (index / "manifest.json").unlink()
    refused("a partial index")
    # another tokenizer than the one the raw text was counted with
    _index(data, index)
    fixture_tok = write_fixture(tmp_path / "fx", pairs=1, documents=1, text_only=1) and load_tokenizer(tmp_path / "fx" / TOKENIZER_DIR)
    with pytest.raises(StaleIndex, match="another fingerprint"):
        open_dataset(index, tokenizer=fixture_tok)


def test_an_index_built_with_skip_is_refused_by_a_job_that_says_error(jsonl_images, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(jsonl_images, data)
    victim = next(p for p in sorted((data / "img").iterdir()))
    victim.write_bytes(b"not an image")
    with pytest.raises(ValueError, match=f"{victim.name}: not an image"):
        build_index(data, tmp_path / "strict", progress=False)
    index = _index(data, tmp_path / "lax", bad_images="skip")
    store = open_dataset(index, bad_images="skip")
    assert len(store.skipped) == 1 and "not an image" in store.skipped[0][1] and len(store) == 89
    with pytest.raises(StaleIndex, match="left out 1 rows .* set bad_images=skip"):
        open_dataset(index)


def test_opening_touches_nothing_per_sample(tmp_path):
    """Records of two billion samples (sparse files: nothing on disk) open and serve a batch: any
    pass over the samples on the open or per-step path would read or allocate tens of GB."""
    index = tmp_path / "index"
    write_generated(index, [make_mix("datamix2", 1000, seed=0)])
    n, m = 2 * 10**9, 3 * 10**9
    for name, count in (("samples", n), ("images", m)):
        with (index / f"{name}.npy").open("wb") as fh:
            fh.write(_npy_header(RECORDS[name], (count,)))
            fh.truncate(len(_npy_header(RECORDS[name], (count,))) + count * RECORDS[name].itemsize)
    manifest = json.loads((index / "manifest.json").read_text())
    manifest.update(samples=n, images=m)
    (index / "manifest.json").write_text(json.dumps(manifest))
    store = pickle.loads(pickle.dumps(open_dataset(index)))  # as a spawned loader worker gets it: the path, not the records
    assert len(store) == n
    rows = np.array([0, 7, n // 2, n - 1])
    table = store.table.take(rows)  # zero-filled records: samples of no text and no image
    assert len(table) == 4 and table.image_ptr[-1] == 0
    assert store.rows(rows) == [{}] * 4  # generated metadata: content is synthesized


def test_data_index_cli_reports_what_it_indexed(generated, tmp_path, capsys):
    code = main(["data", "index", str(generated), "--out", str(tmp_path / "i"), "--workers", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "indexed 500 samples" in out
    with pytest.raises(SystemExit) as e:
        main(["data", "index", str(generated), "--out", str(tmp_path / "i"), "--part", "2/2"])
    assert e.value.code == 2 and "argument --part: I/N needs 0 <= I < N" in capsys.readouterr().err
