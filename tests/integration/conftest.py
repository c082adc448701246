import pytest

from pipetune_configs import config_registry
from pipetune.data import make_mix, write_dataset
from pipetune.data.fixture import write_fixture
from pipetune.data.mixes import parse_mix
from torchtitan_patches.models.model_spec import planning_model_config


@pytest.fixture(scope="session")
def job(tmp_path_factory):
    """A small generated data set, a small corpus of real files with the job's tokenizer, and a
    coarse latency table of the TorchTitan job's planning shapes."""
    d = tmp_path_factory.mktemp("titan_job")
    write_dataset(make_mix(parse_mix("datamix2"), 300, 0), d / "data", {"mix": "datamix2"})
    write_fixture(d / "fixture", pairs=24, documents=4, text_only=4)  # real files and text, and the job's tokenizer
    _profile_tables(config_registry.muse_glimmer_mm(), d, ((True, 1, "table.json"), (False, 1, "table_trained.json"), (True, 2, "table_tp2.json")),
                    max_tokens=2048, max_images=8, points=3, warmup=1)
    return d


@pytest.fixture(scope="session")
def qwen_job(tmp_path_factory):
    """A small generated data set and coarse latency tables of the ``qwen3_5_debug`` job's planning
    shapes: ViT frozen or trained (its table also times its backward), on one rank or one TP 2
    rank's shards."""
    d = tmp_path_factory.mktemp("qwen_job")
    write_dataset(make_mix(parse_mix("datamix2"), 100, 0), d / "data", {"mix": "datamix2"})
    _profile_tables(config_registry.qwen3_5_debug(), d, ((True, 1, "table.json"), (False, 1, "table_trained.json"),
                                                         (False, 2, "table_tp2_trained.json")),
                    max_tokens=1024, max_images=4, points=2, warmup=0)
    return d


def _profile_tables(config, d, tables, **sizes) -> None:
    """Coarse latency tables of ``config``'s planning shapes, one per ``(encoder frozen, tp, file
    name)`` in ``tables``: a trained ViT's table also times its backward, a TP 2 table one rank's
    shards; ``sizes``: the ``ProfileConfig`` grid."""
    from profiling.profile_layers import ProfileConfig, run_profile

    for frozen, tp, name in tables:
        model = planning_model_config(config.model_spec, image_grid=config.pipetune.image_grid, encoder_frozen=frozen)
        run_profile(model, ProfileConfig(max_seq_len=512, repeats=1, p2p=False, tp=tp, **sizes), d / name, progress=False)
