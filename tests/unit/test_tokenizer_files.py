"""The command line's torch-free tokenizer loader (``pipetune.data.tokenizer_files``) gives what the
job's ``text_tokenizer(HuggingFaceTokenizer(path))`` gives for the same files (so a metadata index
the CLI builds is one the job accepts), survives pickling into workers, and ``--tokenizer`` counts
raw text in the job's tokens; without it the CLI says it counts bytes."""

import json
import pickle
import shutil

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from pipetune.cli.main import main
from pipetune.data import tokenizer_files
from pipetune.data.fixture import DATA_DIR, TOKENIZER_DIR, _paragraphs, write_fixture
from pipetune.data.text import VISION_TOKENS
from pipetune.data.tokenizer_files import load_tokenizer
from torchtitan_patches.titan.tokenizer import text_tokenizer

NOTE = "note: raw text counted in UTF-8 bytes with pipetune's byte tokenizer"
WORDS = "the cat sat on a mat and dog ran".split()
TEXTS = [
    "the cat sat <image> on the mat",
    "<image><image> a dog",
    "",
    "naïve café, 中文 <|image_pad|> \t tabs",
    *(_paragraphs()[:3]),
    f"{_paragraphs()[3]} <image> {_paragraphs()[4]}",
]
IDS = ("vocab_size", "image", "pad", "vision_start", "vision_end", "bos", "eos")


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    """A tiny offline fixture: raw text in TorchTitan's formats (``data/``) and the job's tokenizer."""
    out = tmp_path_factory.mktemp("tok") / "fx"
    write_fixture(out, pairs=3, documents=1, text_only=2)
    return out


@pytest.fixture(scope="module")
def rows(fixture):
    path = fixture / "rows.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(TEXTS) if t and "<|" not in t))
    return path


def _word_level(path, *, config: dict | None, specials=()) -> None:
    """A word-level tokenizer folder; ``specials`` are in its tokenizer.json, ``config`` (if any)
    names more that only tokenizer_config.json holds."""
    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))


def _assert_same(core, runtime) -> None:
    assert [getattr(core, k) for k in IDS] == [getattr(runtime, k) for k in IDS]
    assert core.fingerprint == runtime.fingerprint
    for text in TEXTS:
        assert core.split(text) == runtime.split(text)


def test_the_fixture_tokenizer_reads_as_the_job_reads_it(fixture):
    path = fixture / TOKENIZER_DIR
    core, runtime = load_tokenizer(path), text_tokenizer(HuggingFaceTokenizer(tokenizer_path=str(path)))
    assert core.bos is not None and core.eos is not None
    _assert_same(core, runtime)


def test_special_tokens_only_the_config_names_are_added_as_the_job_adds_them(tmp_path):
    config = {"bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False},
              "eos_token": "</s>", "unk_token": "[UNK]", "add_bos_token": False,
              "added_tokens_decoder": {str(100 + k): {"content": s, "special": True, "normalized": False}
                                       for k, s in enumerate(VISION_TOKENS.values())}}
    _word_level(tmp_path / "tok", config=config)
    core = load_tokenizer(tmp_path / "tok")
    runtime = text_tokenizer(HuggingFaceTokenizer(tokenizer_path=str(tmp_path / "tok")))
    assert core.vocab_size == len(WORDS) + 1 + 2 + len(VISION_TOKENS)
    _assert_same(core, runtime)


def test_a_bare_tokenizer_json_reads_as_a_folder_holding_only_it(fixture, tmp_path):
    file = fixture / TOKENIZER_DIR / "tokenizer.json"
    with pytest.raises(OSError):  # TorchTitan takes folders only: compare with a folder of the file alone
        HuggingFaceTokenizer(tokenizer_path=str(file))
    (tmp_path / "alone").mkdir()
    shutil.copy(file, tmp_path / "alone")
    core = load_tokenizer(file)
    assert core.bos is None and core.eos is None
    _assert_same(core, text_tokenizer(HuggingFaceTokenizer(tokenizer_path=str(tmp_path / "alone"))))


def test_a_pickled_tokenizer_loads_its_files_again_in_a_fresh_process(fixture, monkeypatch):
    tok = load_tokenizer(fixture / TOKENIZER_DIR)
    blob = pickle.dumps(tok)
    monkeypatch.setattr(tokenizer_files, "_LOADED", {})  # as a spawned worker starts
    again = pickle.loads(blob)
    assert again == tok and [again.split(t) for t in TEXTS] == [tok.split(t) for t in TEXTS]


def _pack(capsys, data, *extra) -> tuple[int, str]:
    argv = ["pack", "--data", str(data), "--model", "tiny", "--gbs", "4", "--iters", "1", "--max-seq-len", "65536", "--json"]
    assert main(argv + list(extra)) == 0
    out = capsys.readouterr()
    return json.loads(out.out)["summary"]["tokens"], out.err


@pytest.mark.parametrize("data", ["rows.jsonl", DATA_DIR])  # pipetune's `text` column; TorchTitan's formats, mixed
def test_cli_counts_raw_text_with_the_jobs_tokenizer_and_says_when_it_counts_bytes(fixture, rows, capsys, data):
    tokens, err = _pack(capsys, fixture / data, "--tokenizer", str(fixture / TOKENIZER_DIR))
    assert NOTE not in err
    byte_tokens, err = _pack(capsys, fixture / data)
    assert err.count(NOTE) == 1 and "pass --tokenizer PATH" in err
    assert tokens < byte_tokens


def test_cli_says_nothing_of_bytes_for_token_ids(tmp_path, capsys):
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps({"input_ids": [5] * n}) + "\n" for n in (3, 4, 5, 6)))
    _, err = _pack(capsys, tmp_path / "ids.jsonl")
    assert NOTE not in err


def _not_a_tokenizer(tmp_path):
    (tmp_path / "garbage.json").write_text("not json")
    return tmp_path / "garbage.json"


def _no_vision_tokens(tmp_path):
    _word_level(tmp_path / "plain", config={"bos_token": "<s>"}, specials=["<s>"])
    return tmp_path / "plain"


def _bad_config(tmp_path):
    _word_level(tmp_path / "badcfg", config=None, specials=VISION_TOKENS.values())
    (tmp_path / "badcfg" / "tokenizer_config.json").write_text("{")
    return tmp_path / "badcfg"


def _empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "tokenizer_config.json").write_text("{}")
    return tmp_path / "empty"


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp / "nope", "does not exist; give the job's HuggingFace tokenizer folder"),
    (_empty_folder, "the folder has no tokenizer.json"),
    (_not_a_tokenizer, "is not a HuggingFace tokenizer.json"),
    (_no_vision_tokens, "has no <|image_pad|>, <|vision_start|>, <|vision_end|>, <|endoftext|> token(s)"),
    (_bad_config, "tokenizer_config.json is not a tokenizer config TorchTitan reads"),
])
def test_cli_refuses_a_bad_tokenizer_in_one_line(rows, tmp_path, capsys, make, message):
    path = make(tmp_path)
    assert main(["pack", "--data", str(rows), "--model", "tiny", "--tokenizer", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipetune: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert message in err and str(path) in err
