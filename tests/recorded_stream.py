"""The batches the stream drew before it became a keyed permutation (one numpy permutation per
epoch): tests whose claims were recorded on particular batches (plans pinned in a reference file,
a property shown on a chosen batch) keep exactly those batches. Epoch 0 only."""

import numpy as np


class RecordedStream:
    """``rows(step)`` as ``BatchStream(num_rows, gbs, seed)`` gave it for steps within epoch 0."""

    def __init__(self, num_rows: int, gbs: int, seed: int = 0):
        self.num_rows, self.gbs = num_rows, gbs
        self._order = np.random.default_rng([seed, 0]).permutation(num_rows)

    def rows(self, step: int) -> np.ndarray:
        assert (step + 1) * self.gbs <= self.num_rows, f"step {step} is beyond epoch 0 of {self.num_rows} rows"
        return self._order[step * self.gbs:(step + 1) * self.gbs]
