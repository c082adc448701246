"""The stateful dataloader that turns packings into tensors."""

from torchtitan_patches.data.loader import DataLoaderConfig, FixedPacking, PipeTuneDataLoader
from torchtitan_patches.data.micro_batch import GlobalBatch, PackedMicroBatch

__all__ = ["DataLoaderConfig", "FixedPacking", "GlobalBatch", "PackedMicroBatch", "PipeTuneDataLoader"]
