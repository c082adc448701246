"""Load model configs from TOML: a preset name (``13b``) or any file in the same schema.

Hardware presets (``pipetune/presets/hardware/``) hold the fields of ``HardwareSpec``.

Model schema: top-level ``name``; a ``[backbone]`` table with the fields of ``BackboneConfig``; and
``encoder`` either as a table with the fields of ``EncoderConfig`` or as the name of a file in
``pipetune/presets/encoders/``. Presets ship inside the package (so a wheel install finds them);
``PIPETUNE_CONFIG_DIR`` points the loader at another directory of the same layout.

Every problem with a file is a ``ConfigError`` naming the file and the field.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import MISSING, fields
from pathlib import Path

from pipetune.config.hardware import HardwareSpec
from pipetune.config.model import BackboneConfig, ConfigError, EncoderConfig, ModelConfig

PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"


def config_dir() -> Path:
    return Path(os.environ.get("PIPETUNE_CONFIG_DIR", PRESET_DIR))


def available_models() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "models").glob("*.toml"))


def available_hardware() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "hardware").glob("*.toml"))


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read ({e})") from None


def _checked(cls, table, where: str):
    """``cls(**table)`` with unknown, missing and mistyped keys reported against ``where``."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table of {cls.__name__} fields, got {table!r}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; allowed: {sorted(known)}")
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING and f.name not in table]
    if missing:
        raise ConfigError(f"{where}: missing keys {missing}; add them to the file")
    try:
        return cls(**table)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}; fix the file") from None


def load_encoder_config(name_or_path: str) -> EncoderConfig:
    path = _resolve(name_or_path, "encoders")
    return _checked(EncoderConfig, _read_toml(path), str(path))


def load_model_config(name_or_path: str | os.PathLike) -> ModelConfig:
    """Preset name (see ``available_models()``) or path to a TOML file."""
    path = _resolve(str(name_or_path), "models")
    raw = _read_toml(path)
    unknown = sorted(set(raw) - {"name", "backbone", "encoder"})
    if unknown:
        raise ConfigError(f"{path}: unknown top-level keys {unknown}; allowed: name, backbone, encoder")
    if "backbone" not in raw:
        raise ConfigError(f"{path}: missing [backbone] table")
    backbone = _checked(BackboneConfig, raw["backbone"], f"{path} [backbone]")
    enc = raw.get("encoder")
    if isinstance(enc, str):
        encoder = load_encoder_config(enc)
    elif isinstance(enc, dict):
        encoder = _checked(EncoderConfig, enc, f"{path} [encoder]")
    elif enc is None:
        encoder = None
    else:
        raise ConfigError(f"{path}: encoder must be a table or a preset name, got {enc!r}")
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}: name must be a non-empty string, got {name!r}")
    return ModelConfig(name=name, backbone=backbone, encoder=encoder)


def load_hardware(name_or_path: str) -> HardwareSpec:
    """Preset name (``a100``, ``h100``, ``h200``) or path to a hardware TOML file."""
    path = _resolve(name_or_path, "hardware")
    return _checked(HardwareSpec, _read_toml(path), str(path))


def _resolve(name_or_path: str, kind: str) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        return p
    preset = config_dir() / kind / f"{name_or_path}.toml"
    if not preset.is_file():
        names = sorted(q.stem for q in (config_dir() / kind).glob("*.toml"))
        raise ConfigError(f"unknown {kind.rstrip('s')} preset {name_or_path!r}; presets: {names}, or pass a .toml path")
    return preset
