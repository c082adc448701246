import pytest

from pipetune.config import available_models, load_model_config
from pipetune.config.model import ModelConfig


@pytest.mark.parametrize(
    "name,layers,dim,ffn,heads",
    [("3b", 24, 2560, 6912, 32), ("7b", 32, 4096, 11008, 32), ("13b", 40, 5120, 13824, 40)],
)
def test_presets_match_pipetune_table4(name, layers, dim, ffn, heads):
    m = load_model_config(name)
    b = m.backbone
    assert (b.n_layers, b.dim, b.ffn_dim, b.n_heads) == (layers, dim, ffn, heads)
    assert m.encoder.tokens_per_image == 576
    assert (m.encoder.n_layers, m.encoder.dim) == (27, 1152)


def test_all_presets_load_and_round_trip():
    assert {"3b", "7b", "13b", "tiny"} <= set(available_models())
    for name in available_models():
        m = load_model_config(name)
        assert ModelConfig.from_dict(m.to_dict()) == m
        assert m.fingerprint() == ModelConfig.from_dict(m.to_dict()).fingerprint()


def test_fingerprint_ignores_name_but_not_shapes(tmp_path):
    text = (tmp_path / "a.toml")
    text.write_text('name = "other"\n[backbone]\nn_layers=4\ndim=128\nffn_dim=384\nn_heads=4\nn_kv_heads=2\nvocab_size=512\n'
                    '[encoder]\nn_layers=2\ndim=64\nffn_dim=128\nn_heads=2\nimage_size=32\npatch_size=8\n')
    assert load_model_config(text).fingerprint() == load_model_config("tiny").fingerprint()
    text.write_text(text.read_text().replace("n_layers=4", "n_layers=5"))
    assert load_model_config(text).fingerprint() != load_model_config("tiny").fingerprint()


@pytest.mark.parametrize(
    "body,message",
    [
        ("name='x'\n", "missing \\[backbone\\]"),
        ("[backbone]\nn_layers=1\ndim=10\nffn_dim=4\nn_heads=3\nn_kv_heads=1\nvocab_size=8\n", "not divisible by n_heads"),
        ("[backbone]\nn_layers=1\ndim=12\nffn_dim=4\nn_heads=4\nn_kv_heads=3\nvocab_size=8\n", "not a multiple of n_kv_heads"),
        ("[backbone]\nn_layers=1\ndim=12\nffn_dim=4\nn_heads=4\nn_kv_heads=2\nvocab_size=8\nwidth=3\n", "unknown keys \\['width'\\]"),
        ("[backbone]\nn_layers=0\ndim=12\nffn_dim=4\nn_heads=4\nn_kv_heads=2\nvocab_size=8\n", "n_layers must be > 0"),
        ("encoder='nope'\n[backbone]\nn_layers=1\ndim=12\nffn_dim=4\nn_heads=4\nn_kv_heads=2\nvocab_size=8\n", "unknown encoder preset 'nope'"),
        ("[backbone\n", "not valid TOML"),
    ],
)
def test_bad_model_files_are_rejected_with_a_reason(tmp_path, body, message):
    f = tmp_path / "bad.toml"
    f.write_text(body)
    with pytest.raises(ValueError, match=message):
        load_model_config(f)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown model preset 'huge'.*13b"):
        load_model_config("huge")


def test_every_cli_option_shows_its_default_and_every_preset():
    """`pipetune COMMAND --help`: every option with a default says it, and --model / --hardware
    list every preset there is."""
    import argparse

    from pipetune.cli.main import _parsers, build_parser
    from pipetune.config.presets import available_hardware, available_models

    top = build_parser()
    assert "Entry point" not in top.format_help()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    for parser in _parsers(sub):
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            assert action.help, f"{parser.prog} {action.option_strings[0]} has no help"
            if action.default not in (None, [], argparse.SUPPRESS) and not isinstance(action.default, bool):
                assert "default" in " ".join((action.help or "").split()) or f"(default: {action.default})" in text, \
                    f"{parser.prog} {action.option_strings[0]} does not show its default {action.default!r}"
        if "--model" in text:
            assert all(name in text for name in available_models())
        if "--hardware" in text:
            assert all(name in text for name in available_hardware())
