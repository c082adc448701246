"""Model configs and their TOML presets."""

from pipetune.config.hardware import HardwareSpec
from pipetune.config.model import BackboneConfig, EncoderConfig, ModelConfig
from pipetune.config.presets import available_models, load_hardware, load_model_config

__all__ = [
    "BackboneConfig",
    "EncoderConfig",
    "HardwareSpec",
    "ModelConfig",
    "available_models",
    "load_hardware",
    "load_model_config",
]
