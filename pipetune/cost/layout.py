"""How the backbone's layers are split over pipeline stages."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StageLayout:
    """Contiguous layer ranges, one per pipeline stage. Stage 0 also holds the embeddings, the
    projector and (PipeTune's layout) the vision encoder; the last stage the norm and output head."""

    layer_ranges: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        r = self.layer_ranges
        if not r or r[0][0] != 0 or any(a[1] != b[0] for a, b in zip(r, r[1:])) or any(hi <= lo for lo, hi in r):
            raise ValueError(f"layer ranges {list(r)} are not contiguous, non-empty and starting at layer 0")

    @classmethod
    def even(cls, n_layers: int, num_stages: int) -> "StageLayout":
        """Equal split; when it does not divide, the middle stages take the extra layers, since the
        first stage carries the embeddings and encoder and the last the output head."""
        if not 1 <= num_stages <= n_layers:
            raise ValueError(f"cannot split {n_layers} layers into {num_stages} pipeline stages")
        base, extra = divmod(n_layers, num_stages)
        order = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), s))
        sizes = [base + (1 if s in order[:extra] else 0) for s in range(num_stages)]
        ranges, lo = [], 0
        for n in sizes:
            ranges.append((lo, lo + n))
            lo += n
        return cls(tuple(ranges))

    @classmethod
    def from_sizes(cls, sizes) -> "StageLayout":
        """Layers per stage, in stage order (``[7, 9, 8, 8]``)."""
        sizes = [int(n) for n in sizes]
        if any(n < 1 for n in sizes):
            raise ValueError(f"every pipeline stage needs at least one layer, got layers per stage {sizes}")
        ends = np.cumsum(sizes)
        return cls(tuple((int(e - n), int(e)) for n, e in zip(sizes, ends)))

    @classmethod
    def parse(cls, spec: str, n_layers: int, num_stages: int) -> "StageLayout":
        """``even`` or comma-separated layers per stage (``7,9,8,8``), checked against the model."""
        if spec == "even":
            return cls.even(n_layers, num_stages)
        try:
            sizes = [int(x) for x in spec.split(",")]
        except ValueError:
            raise ValueError(f"--layout {spec!r}: expected auto, even or layers per stage such as 7,9,8,8") from None
        if len(sizes) != num_stages or sum(sizes) != n_layers:
            raise ValueError(
                f"--layout {spec!r}: needs {num_stages} stages summing to the model's {n_layers} layers, "
                f"got {len(sizes)} stages summing to {sum(sizes)}"
            )
        return cls.from_sizes(sizes)

    @property
    def num_stages(self) -> int:
        return len(self.layer_ranges)

    @property
    def num_layers(self) -> int:
        return self.layer_ranges[-1][1]

    def layers_per_stage(self) -> list[int]:
        return [hi - lo for lo, hi in self.layer_ranges]
