"""Samples -> micro-batches: the FLOPs model and the packers."""

from pipetune.packing.batch_packer import BatchPacker, PackerKind, PackingConfig
from pipetune.packing.flops import FlopsModel
from pipetune.packing.packers import pack_balanced, pack_original
from pipetune.packing.packing import Packing

__all__ = ["BatchPacker", "FlopsModel", "PackerKind", "Packing", "PackingConfig", "pack_balanced", "pack_original"]
