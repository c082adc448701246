"""Which data set rows make up global batch ``step``: a pure function of (seed, step).

The sample stream is a sequence of positions; epoch ``e`` is positions ``[e * N, (e + 1) * N)``
of it (``N`` = rows) and holds every row exactly once, in the order ``order(e)``. Batch ``step``
is positions ``[step * gbs, (step + 1) * gbs)``, so no row is dropped at an epoch end and a batch
may straddle two epochs (never three: ``gbs <= N`` is required, since a batch is a set of
distinct samples). A straddling batch holds the last ``r`` rows of epoch ``e`` and the first
``gbs - r`` of epoch ``e + 1``; to keep them distinct, ``order(e + 1)`` is a fresh seeded
permutation in which each of those first ``gbs - r`` positions that holds one of the ``r`` rows is
swapped with the earliest later position holding another row. The first ``gbs - r`` rows of epoch
``e + 1`` are thus a uniform random choice among the rows not in the straddling tail, and every
row still appears once per epoch.

Cost: one O(N) permutation per epoch (cached), so O(gbs) per step amortised; nothing spans all
epochs. The swaps leave the tail of ``order(e)`` as drawn when ``N - gbs >= r``, so the fix of
epoch ``e + 1`` needs only the raw permutation of ``e``; on smaller data sets it walks back to the
last epoch that ends on a batch boundary (at most ``gbs / gcd(N, gbs)`` epochs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, kw_only=True)
class BatchStream:
    """``rows(step)``: the data set rows of batch ``step`` for one data-parallel rank.

    The global batch of ``gbs`` samples is split round-robin over ``dp_size`` ranks, so
    ``gbs`` must be a multiple of ``dp_size`` and ranks' shares are disjoint.
    """

    num_rows: int
    gbs: int
    seed: int = 0
    shuffle: bool = True
    dp_rank: int = 0
    dp_size: int = 1
    _orders: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_rows <= 0:
            raise ValueError("the data set is empty: a batch stream needs at least one row")
        if self.gbs <= 0:
            raise ValueError(f"global batch size must be > 0, got {self.gbs}")
        if self.gbs > self.num_rows:
            raise ValueError(
                f"global batch size {self.gbs} is larger than the data set ({self.num_rows} rows): a batch is a set of "
                f"distinct samples; use gbs <= {self.num_rows} or a larger data set"
            )
        if self.dp_size <= 0 or not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={self.dp_rank} is not in [0, dp_size={self.dp_size})")
        if self.gbs % self.dp_size:
            raise ValueError(f"global batch size {self.gbs} is not a multiple of dp_size={self.dp_size}")

    def tail_len(self, epoch: int) -> int:
        """Rows of epoch ``epoch`` that go into the batch straddling it and the next (0: none)."""
        return ((epoch + 1) * self.num_rows) % self.gbs

    def _raw(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def _tail_is_raw(self, epoch: int) -> bool:
        """The swaps of ``order(epoch)`` cannot reach its tail (see module doc)."""
        return epoch == 0 or self.num_rows - self.gbs >= self.tail_len(epoch)

    def order(self, epoch: int) -> np.ndarray:
        """Row order of epoch ``epoch``: a permutation of all rows (see module doc)."""
        if epoch in self._orders:
            return self._orders[epoch]
        first = epoch
        while first > 0 and self.tail_len(first - 1) and not self._tail_is_raw(first - 1) and first - 1 not in self._orders:
            first -= 1
        prev = self._orders.get(first - 1)
        for e in range(first, epoch + 1):
            prev = out = self._fix_head(e, prev)
        if len(self._orders) >= 4:
            self._orders.pop(min(self._orders))
        self._orders[epoch] = out
        return out

    def _fix_head(self, epoch: int, prev: np.ndarray | None) -> np.ndarray:
        """``order(epoch)`` given ``order(epoch - 1)`` (``None``: its tail is the raw one)."""
        out = self._raw(epoch)
        r = self.tail_len(epoch - 1) if epoch > 0 else 0
        if r == 0:
            return out
        before = prev if prev is not None else self._raw(epoch - 1)
        taken = np.zeros(self.num_rows, dtype=bool)
        taken[before[self.num_rows - r :]] = True
        head = self.gbs - r
        clash = taken[out]
        bad = np.flatnonzero(clash[:head])
        if len(bad):
            free = head + np.flatnonzero(~clash[head:])[: len(bad)]
            out[bad], out[free] = out[free], out[bad].copy()
        return out

    def positions(self, step: int) -> np.ndarray:
        """Stream positions of this rank's share of batch ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return step * self.gbs + np.arange(self.dp_rank, self.gbs, self.dp_size, dtype=np.int64)

    def rows(self, step: int) -> np.ndarray:
        pos = self.positions(step)
        epoch, within = np.divmod(pos, self.num_rows)
        out = np.empty(len(pos), dtype=np.int64)
        for e in np.unique(epoch).tolist():
            sel = epoch == e
            out[sel] = self.order(e)[within[sel]]
        return out
