"""Load model configs from TOML: a preset name (``13b``) or any file in the same schema.

Hardware presets (``configs/hardware/``) hold the fields of ``HardwareSpec``.

Model schema: top-level ``name``; a ``[backbone]`` table with the fields of ``BackboneConfig``; and
``encoder`` either as a table with the fields of ``EncoderConfig`` or as the name of a file in
``configs/encoders/``. Presets live in the source tree's ``configs/`` (``PIPETUNE_CONFIG_DIR``
overrides it), so the package is meant to be installed editable from a checkout.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import fields
from pathlib import Path

from pipetune.config.hardware import HardwareSpec
from pipetune.config.model import BackboneConfig, EncoderConfig, ModelConfig


def config_dir() -> Path:
    return Path(os.environ.get("PIPETUNE_CONFIG_DIR", Path(__file__).resolve().parents[2] / "configs"))


def available_models() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "models").glob("*.toml"))


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from e


def _checked(cls, table: dict, where: str):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {sorted(known)}")
    try:
        return cls(**table)
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from e


def load_encoder_config(name_or_path: str) -> EncoderConfig:
    path = _resolve(name_or_path, "encoders")
    return _checked(EncoderConfig, _read_toml(path), str(path))


def load_model_config(name_or_path: str | os.PathLike) -> ModelConfig:
    """Preset name (see ``available_models()``) or path to a TOML file."""
    path = _resolve(str(name_or_path), "models")
    raw = _read_toml(path)
    unknown = sorted(set(raw) - {"name", "backbone", "encoder"})
    if unknown:
        raise ValueError(f"{path}: unknown top-level keys {unknown}; allowed: name, backbone, encoder")
    if "backbone" not in raw:
        raise ValueError(f"{path}: missing [backbone] table")
    backbone = _checked(BackboneConfig, raw["backbone"], f"{path} [backbone]")
    enc = raw.get("encoder")
    if isinstance(enc, str):
        encoder = load_encoder_config(enc)
    elif isinstance(enc, dict):
        encoder = _checked(EncoderConfig, enc, f"{path} [encoder]")
    elif enc is None:
        encoder = None
    else:
        raise ValueError(f"{path}: encoder must be a table or a preset name, got {type(enc).__name__}")
    return ModelConfig(name=raw.get("name", path.stem), backbone=backbone, encoder=encoder)


def load_hardware(name_or_path: str) -> HardwareSpec:
    """Preset name (``a100``, ``h100``, ``h200``) or path to a hardware TOML file."""
    path = _resolve(name_or_path, "hardware")
    return _checked(HardwareSpec, _read_toml(path), str(path))


def _resolve(name_or_path: str, kind: str) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise FileNotFoundError(f"config file {p} does not exist")
        return p
    preset = config_dir() / kind / f"{name_or_path}.toml"
    if not preset.is_file():
        names = sorted(q.stem for q in (config_dir() / kind).glob("*.toml"))
        raise ValueError(f"unknown {kind.rstrip('s')} preset {name_or_path!r}; presets: {names}, or pass a .toml path")
    return preset
