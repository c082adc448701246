"""Which data set rows make up global batch ``step``: a pure function of (seed, step).

The sample stream is the concatenation of one seeded permutation of the data set per epoch, and
batch ``step`` is the slice ``[step * gbs, (step + 1) * gbs)`` of it. Batches may straddle epochs,
so no sample is ever dropped at an epoch end, and any batch's metadata can be looked up ahead of
time (the planner needs it before tensors exist) or again after a resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, kw_only=True)
class BatchStream:
    """``rows(step)``: the data set rows of batch ``step`` for one data-parallel rank.

    The global batch of ``gbs`` samples is split round-robin over ``dp_size`` ranks, so
    ``gbs`` must be a multiple of ``dp_size``.
    """

    num_rows: int
    gbs: int
    seed: int = 0
    shuffle: bool = True
    dp_rank: int = 0
    dp_size: int = 1
    _perms: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_rows <= 0:
            raise ValueError("the data set is empty: a batch stream needs at least one row")
        if self.gbs <= 0:
            raise ValueError(f"global batch size must be > 0, got {self.gbs}")
        if self.dp_size <= 0 or not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={self.dp_rank} is not in [0, dp_size={self.dp_size})")
        if self.gbs % self.dp_size:
            raise ValueError(f"global batch size {self.gbs} is not a multiple of dp_size={self.dp_size}")

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 4:
                self._perms.pop(min(self._perms))
            rng = np.random.default_rng([self.seed, epoch])
            self._perms[epoch] = rng.permutation(self.num_rows) if self.shuffle else np.arange(self.num_rows)
        return self._perms[epoch]

    def rows(self, step: int) -> np.ndarray:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        pos = step * self.gbs + np.arange(self.dp_rank, self.gbs, self.dp_size, dtype=np.int64)
        epoch, within = np.divmod(pos, self.num_rows)
        out = np.empty(len(pos), dtype=np.int64)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = self._perm(int(e))[within[sel]]
        return out
