"""Sample metadata, generated data mixes, storage on disk, metadata indexes and the deterministic batch stream."""

from pipetune.data.batch import BatchMeta, batch_meta
from pipetune.data.images import ImageSizing
from pipetune.data.mixes import MIXES, make_mix
from pipetune.data.samples import Overlong, OverlongReport, OverlongTotals, SampleTable, apply_overlong_policy
from pipetune.data.storage import SampleStore, open_dataset, write_dataset
from pipetune.data.stream import BatchStream

__all__ = [
    "MIXES",
    "BatchMeta",
    "BatchStream",
    "ImageSizing",
    "Overlong",
    "OverlongReport",
    "OverlongTotals",
    "SampleStore",
    "SampleTable",
    "apply_overlong_policy",
    "batch_meta",
    "make_mix",
    "open_dataset",
    "write_dataset",
]
