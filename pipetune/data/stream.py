"""Which data set rows make up global batch ``step``: a pure function of (seed, step).

The sample stream is a sequence of positions; epoch ``e`` is positions ``[e * N, (e + 1) * N)``
of it (``N`` = rows) and holds every row exactly once. Batch ``step`` is positions
``[step * gbs, (step + 1) * gbs)``, so no row is dropped at an epoch end and a batch may straddle
two epochs (never three: ``gbs <= N`` is required, since a batch is a set of distinct samples).
A straddling batch holds the last ``r`` rows of epoch ``e`` and the first ``h = gbs - r`` of
epoch ``e + 1``; to keep them distinct, each of those first ``h`` positions of epoch ``e + 1``
whose freshly drawn row is one of the ``r`` is swapped with the earliest later position holding
another row. The first ``h`` rows of epoch ``e + 1`` are thus a uniform random choice among the
rows not in the straddling tail, and every row still appears once per epoch.

An epoch's order is never materialised (an O(N) permutation is gigabytes at 100M rows): the row
at a position is a keyed pseudo-random permutation of ``[0, N)`` evaluated there, a 6-round
Feistel network keyed by ``(seed, epoch)`` on the smallest ``2**b >= N`` (halves of
``ceil(b / 2)`` and ``floor(b / 2)`` bits that trade widths each round, as in NIST FF1, so the
domain is under ``2 N`` rather than ``4 N``) with cycle walking: fewer than 2 passes per position on
average. The swaps only touch positions ``< gbs`` (the ``h`` head positions hold at most
``r - c`` tail rows and the ``r`` positions after them ``r - c`` others, ``c`` = tail rows among
those ``r``), so an epoch keeps just its swaps, found with O(gbs) evaluations.

Cost: O(gbs) time and memory per step, whatever ``N`` and the step. The swaps cannot reach the
tail of an epoch when ``N - gbs >= r``, so the swaps of epoch ``e + 1`` need only the drawn tail of
``e``; on smaller data sets (``N < 2 gbs``) they walk back to the last epoch whose previous one
ends on a batch boundary: at most ``gbs / gcd(N, gbs)`` epochs of O(gbs) each, cached so that
sequential steps pay it once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

_ROUNDS = 6  # even: the halves' widths are back in place at the end
_CACHED_EPOCHS = 8
_NO_SWAPS = (np.empty(0, np.int64), np.empty(0, np.int64))
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


@lru_cache(maxsize=64)
def _round_keys(seed: int, epoch: int) -> np.ndarray:
    return np.random.SeedSequence([seed, epoch]).generate_state(_ROUNDS, np.uint64)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 in which every input bit flips about half the output bits."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def _permute(x: np.ndarray, num_rows: int, keys: np.ndarray) -> np.ndarray:
    """A keyed permutation of ``[0, num_rows)`` applied to ``x`` (int64 in range)."""
    bits = (num_rows - 1).bit_length()
    low = np.uint64(bits // 2)
    masks = (np.uint64((1 << bits - bits // 2) - 1), np.uint64((1 << bits // 2) - 1))

    def feistel(v: np.ndarray) -> np.ndarray:
        left, right = v >> low, v & masks[1]
        for i, key in enumerate(keys):  # the new right half takes the old left's width
            left, right = right, left ^ (_mix(right ^ key) & masks[i % 2])
        return (left << low) | right

    out = feistel(x.astype(np.uint64))
    # cycle walking: the Feistel permutes [0, 2**bits); re-applying it maps [0, num_rows) onto itself
    todo = np.flatnonzero(out >= num_rows)
    while len(todo):
        step = feistel(out[todo])
        out[todo] = step
        todo = todo[step >= num_rows]
    return out.astype(np.int64)


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
    _swaps: dict = field(default_factory=dict, repr=False, compare=False)

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

    def _drawn(self, epoch: int, within: np.ndarray) -> np.ndarray:
        """Rows at positions ``within`` of epoch ``epoch`` before its head swaps."""
        return _permute(within, self.num_rows, _round_keys(self.seed, epoch))

    def _tail_is_drawn(self, epoch: int) -> bool:
        """The swaps of epoch ``epoch`` (positions < gbs) cannot reach its tail."""
        return epoch == 0 or self.num_rows - self.gbs >= self.tail_len(epoch)

    def _needs_previous(self, epoch: int) -> bool:
        """The swaps of epoch ``epoch`` depend on those of ``epoch - 1`` (through its tail)."""
        return epoch > 0 and self.tail_len(epoch - 1) > 0 and not self._tail_is_drawn(epoch - 1)

    def _at(self, epoch: int, within: np.ndarray) -> np.ndarray:
        """Rows at positions ``within`` of epoch ``epoch``."""
        if not self.shuffle:
            return within.astype(np.int64)
        if (within < self.gbs).any():
            src, dst = self._epoch_swaps(epoch)
            if len(src):
                k = np.searchsorted(src, within).clip(max=len(src) - 1)
                within = np.where(src[k] == within, dst[k], within)
        return self._drawn(epoch, within)

    def _epoch_swaps(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Swapped positions of epoch ``epoch`` (sorted) and their partners; cached, walking back if needed."""
        first = epoch
        while first not in self._swaps and self._needs_previous(first):
            first -= 1
        for e in range(first, epoch + 1):
            if e not in self._swaps:
                swaps = self._fix_head(e)  # evict after: it may read epoch e - 1's swaps
                if len(self._swaps) >= _CACHED_EPOCHS:
                    self._swaps.pop(min(self._swaps))
                self._swaps[e] = swaps
        return self._swaps[epoch]

    def _fix_head(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The head swaps of epoch ``epoch`` (see module doc); those of ``epoch - 1`` are cached if needed."""
        r = self.tail_len(epoch - 1) if epoch > 0 else 0
        if r == 0:
            return _NO_SWAPS
        tail = np.arange(self.num_rows - r, self.num_rows, dtype=np.int64)
        before = self._drawn(epoch - 1, tail) if self._tail_is_drawn(epoch - 1) else self._at(epoch - 1, tail)
        clash = np.isin(self._drawn(epoch, np.arange(self.gbs, dtype=np.int64)), before)
        head = self.gbs - r
        bad = np.flatnonzero(clash[:head])
        free = head + np.flatnonzero(~clash[head:])[: len(bad)]
        src, dst = np.concatenate([bad, free]), np.concatenate([free, bad])
        order = np.argsort(src)
        return src[order], dst[order]

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
            out[sel] = self._at(e, within[sel])
        return out
