"""A metadata index of a corpus, built once and shared: ``pipetune data index DATA --out INDEX``.

Opening a data set without one derives every sample's metadata (tokenizing every text, reading
every image header) on every rank at every start: hours at 10^8 samples. The index holds that
metadata and each sample's location in the user's files as memory-mapped records, so opening
costs a manifest read and a ``stat`` per file, and a step reads only its batch's rows. Give the
index wherever a data set goes (``--data INDEX``, ``dataloader.dataset_path = INDEX``).
"""

from pipetune.data.index.build import build_index
from pipetune.data.index.manifest import StaleIndex
from pipetune.data.index.store import IndexedStore, IndexedTable, is_index, open_index

__all__ = ["IndexedStore", "IndexedTable", "StaleIndex", "build_index", "is_index", "open_index"]
