"""A packing: which samples of a batch share a micro-batch, and in which order they are concatenated."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Packing:
    """Micro-batches as groups of row positions into a batch's ``SampleTable``.

    ``order[ptr[j]:ptr[j + 1]]`` are the rows of micro-batch ``j`` in sequence order; every row of
    the batch appears exactly once. ``capacity`` is the token budget of one micro-batch
    (``mbs * max_seq_len``).
    """

    order: np.ndarray
    ptr: np.ndarray
    capacity: int

    @classmethod
    def from_groups(cls, groups, capacity: int) -> "Packing":
        groups = [np.asarray(g, dtype=np.int64) for g in groups]
        ptr = np.zeros(len(groups) + 1, dtype=np.int64)
        np.cumsum([len(g) for g in groups], out=ptr[1:])
        order = np.concatenate(groups) if groups else np.zeros(0, np.int64)
        return cls(order=order, ptr=ptr, capacity=capacity)

    @property
    def num_micro_batches(self) -> int:
        return len(self.ptr) - 1

    def groups(self) -> list[np.ndarray]:
        return [self.order[a:b] for a, b in zip(self.ptr[:-1], self.ptr[1:])]

    def per_micro_batch(self, values: np.ndarray) -> np.ndarray:
        """Sum a per-row quantity (tokens, FLOPs, images) over each micro-batch."""
        return np.add.reduceat(values[self.order], self.ptr[:-1]) if len(self.order) else np.zeros(0)

    def validate(self, lengths: np.ndarray) -> None:
        """Every row exactly once, no empty micro-batch, none over capacity: else a clear error."""
        n = len(lengths)
        counts = np.bincount(self.order, minlength=n) if len(self.order) else np.zeros(n, np.int64)
        if len(counts) > n or (len(self.order) and self.order.min() < 0):
            raise ValueError(f"packing refers to rows outside the batch of {n} samples")
        if (counts == 0).any():
            raise ValueError(f"packing leaves out batch row {int(np.argmax(counts == 0))}")
        if (counts > 1).any():
            raise ValueError(f"packing puts batch row {int(np.argmax(counts > 1))} in more than one place")
        if (np.diff(self.ptr) <= 0).any():
            raise ValueError(f"packing has an empty micro-batch ({int(np.argmax(np.diff(self.ptr) <= 0))})")
        tokens = self.per_micro_batch(lengths)
        if (tokens > self.capacity).any():
            j = int(np.argmax(tokens > self.capacity))
            raise ValueError(f"micro-batch {j} holds {int(tokens[j])} tokens, over its capacity of {self.capacity}")
