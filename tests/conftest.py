import os
import tempfile

os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PIPETUNE_CACHE", tempfile.mkdtemp(prefix="pipetune-test-cache-"))  # data set metadata: per test run

import pytest

from pipetune.config import load_model_config
from pipetune.data import make_mix, write_dataset


@pytest.fixture(scope="session")
def tiny():
    return load_model_config("tiny")


@pytest.fixture(scope="session")
def model13b():
    return load_model_config("13b")


@pytest.fixture(scope="session")
def datamix2_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "datamix2"
    write_dataset(make_mix("datamix2", 3000, seed=1), out, {"mix": "datamix2", "seed": 1})
    return out
