import gc
import os
import tempfile

os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PIPETUNE_CACHE", tempfile.mkdtemp(prefix="pipetune-test-cache-"))  # data set metadata: per test run

import pytest

# The unit run spent about 16 s in the cycle collector, mostly in full collections that walk the
# ~600k objects of the imported modules (torch, scipy, the planning core) again and again. It now
# runs every 7000 allocations instead of 700, and ``pytest_collection_finish`` moves those objects
# out of its reach: it walks what the tests make.
gc.set_threshold(7000, 10, 10)

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


def pytest_collection_finish(session):
    """Every test module is imported now: what survives a collection is frozen (``gc.freeze``)."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    """Unfrozen, what is still alive is collected at exit, before extension modules (triton's)
    report what of theirs is left as leaked."""
    gc.unfreeze()
