"""Samples -> micro-batches: the FLOPs model and the packers."""

from pipetune.packing.algorithms import pack_balanced, pack_original
from pipetune.packing.config import BatchPacker, PackerKind, PackingConfig
from pipetune.packing.flops import FlopsModel
from pipetune.packing.groups import Packing

__all__ = ["BatchPacker", "FlopsModel", "PackerKind", "Packing", "PackingConfig", "pack_balanced", "pack_original"]
