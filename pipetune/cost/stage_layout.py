"""How the model's layers are cut into chunks and placed on ranks: the job's layout."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetune.schedule.table import ChunkStyle, Placement


def _contiguous(r) -> bool:
    return bool(r) and r[0][0] == 0 and all(a[1] == b[0] for a, b in zip(r, r[1:])) and all(hi > lo for lo, hi in r)


@dataclass(frozen=True)
class StageLayout:
    """Backbone: contiguous layer ranges, one per pipeline stage (backbone chunk ``s`` on rank
    ``s``); stage 0 also holds the embeddings and the projector, the last stage the norm and
    output head.

    Encoder: *co-located* (PipeTune; ``encoder_chunks`` empty): the whole encoder as one chunk on
    rank 0, one sub-microbatch per micro-batch. *Separated* (DIP): ``encoder_chunks`` layer ranges,
    a multiple ``K`` of the stage count, chunk ``k`` on rank ``k mod P``, and each micro-batch's
    images split into sub-microbatches of ``image_sub_batch`` images
    (``pipetune.packing.sub_batches``).

    Virtual stages (``chunks_per_rank`` V >= 2, co-located only): the layer ranges are V x P
    chunks, in ``style``: chunk ``c`` on rank ``c mod P`` (``Placement.interleaved``), or V-shaped
    (two per rank, chunks ``c`` and ``2P - 1 - c`` on rank ``c``, ``Placement.v_shaped``).
    """

    layer_ranges: tuple[tuple[int, int], ...]
    encoder_chunks: tuple[tuple[int, int], ...] = ()
    image_sub_batch: int = 0
    chunks_per_rank: int = 1
    style: ChunkStyle = ChunkStyle.LOOP

    def __post_init__(self) -> None:
        r, e = self.layer_ranges, self.encoder_chunks
        if not _contiguous(r):
            raise ValueError(f"layer ranges {list(r)} are not contiguous, non-empty and starting at layer 0")
        if e and (not _contiguous(e) or len(e) % len(r)):
            raise ValueError(f"encoder chunks {list(e)} must be contiguous, non-empty layer ranges from layer 0, "
                             f"a multiple of the {len(r)} stages")
        if bool(e) != (self.image_sub_batch > 0):
            raise ValueError("a separated layout needs both encoder chunks and an image sub-microbatch size >= 1")
        if self.chunks_per_rank < 1 or len(r) % self.chunks_per_rank or (e and self.chunks_per_rank > 1):
            raise ValueError(f"{self.chunks_per_rank} chunks per rank: needs a co-located layout whose {len(r)} backbone chunks "
                             "are a multiple of it")
        if self.style is ChunkStyle.V and self.chunks_per_rank != 2:
            raise ValueError(f"a V-shaped layout holds two backbone chunks per rank, not {self.chunks_per_rank}")

    @classmethod
    def even(cls, n_layers: int, num_stages: int, *, chunks_per_rank: int = 1, style: ChunkStyle = ChunkStyle.LOOP) -> "StageLayout":
        """Equal split; when it does not divide, the middle stages take the extra layers, since the
        first stage carries the embeddings and encoder and the last the output head. With
        ``chunks_per_rank``, ``num_stages`` counts the backbone chunks (as in ``from_sizes`` and ``parse``)."""
        if not 1 <= num_stages <= n_layers:
            raise ValueError(f"cannot split {n_layers} layers into {num_stages} pipeline stages")
        base, extra = divmod(n_layers, num_stages)
        order = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), s))
        return cls.from_sizes([base + (1 if s in order[:extra] else 0) for s in range(num_stages)], chunks_per_rank=chunks_per_rank,
                              style=style)

    @classmethod
    def from_sizes(cls, sizes, *, chunks_per_rank: int = 1, style: ChunkStyle = ChunkStyle.LOOP) -> "StageLayout":
        """Layers per stage (per backbone chunk with ``chunks_per_rank`` >= 2), in order (``[7, 9, 8, 8]``)."""
        sizes = [int(n) for n in sizes]
        if any(n < 1 for n in sizes):
            raise ValueError(f"every pipeline stage needs at least one layer, got layers per stage {sizes}")
        return cls(_ranges(sizes), chunks_per_rank=chunks_per_rank, style=style)

    @classmethod
    def parse(cls, spec: str, n_layers: int, num_stages: int, *, chunks_per_rank: int = 1,
              style: ChunkStyle = ChunkStyle.LOOP) -> "StageLayout":
        """``even`` or comma-separated layers per stage (``7,9,8,8``), checked against the model."""
        if spec == "even":
            return cls.even(n_layers, num_stages, chunks_per_rank=chunks_per_rank, style=style)
        if spec == "separated":
            raise ValueError("the separated layout's chunks and sub-microbatch size come from the partitioner "
                             "(pipetune.plan.layout.layout_search.LayoutSearch.partition), not from a layer list")
        try:
            sizes = [int(x) for x in spec.split(",")]
        except ValueError:
            raise ValueError(f"--layout {spec!r}: expected auto, even, separated or layers per stage such as 7,9,8,8") from None
        if len(sizes) != num_stages or sum(sizes) != n_layers:
            raise ValueError(
                f"--layout {spec!r}: needs {num_stages} stages summing to the model's {n_layers} layers, "
                f"got {len(sizes)} stages summing to {sum(sizes)}"
            )
        return cls.from_sizes(sizes, chunks_per_rank=chunks_per_rank, style=style)

    @classmethod
    def balanced(cls, fixed, layer_seconds) -> "StageLayout":
        """The contiguous split, at least one layer per stage, whose stage busy times (``fixed[s]``
        plus the ``layer_seconds`` of the layers it holds) have the least sum of squares: as even as
        the layers allow, a stage holding costlier layers (full attention beside linear attention)
        taking fewer of them."""
        fixed = np.asarray(fixed, dtype=np.float64)
        cum = np.concatenate([[0.0], np.cumsum(np.asarray(layer_seconds, dtype=np.float64))])
        S, n = len(fixed), len(cum) - 1
        if not 1 <= S <= n:
            raise ValueError(f"cannot split {n} layers into {S} pipeline stages")
        best = (fixed[0] + cum) ** 2  # best[j]: stages 0..s over layers 0..j-1
        best[0] = np.inf
        cut = np.zeros((S, n + 1), dtype=np.int64)
        for s in range(1, S):
            nxt = np.full(n + 1, np.inf)
            for j in range(s + 1, n + 1):
                i = np.arange(s, j)
                total = best[i] + (fixed[s] + cum[j] - cum[i]) ** 2
                k = int(np.argmin(total))
                nxt[j], cut[s, j] = total[k], i[k]
            best = nxt
        ends = [n]
        for s in range(S - 1, 0, -1):
            ends.append(int(cut[s, ends[-1]]))
        ends = ends[::-1]
        return cls.from_sizes(np.diff([0, *ends]))

    def separated(self, encoder_layers: int, segments: int, image_sub_batch: int) -> "StageLayout":
        """This backbone split with the encoder's ``encoder_layers`` layers cut into
        ``segments * num_stages`` chunks as even as possible (earlier chunks take the extra layers)."""
        n = segments * self.num_stages
        if not 1 <= n <= encoder_layers:
            raise ValueError(f"cannot cut the encoder's {encoder_layers} layers into {n} chunks ({segments} segments of {self.num_stages})")
        base, extra = divmod(encoder_layers, n)
        return StageLayout(self.layer_ranges, _ranges([base + (k < extra) for k in range(n)]), image_sub_batch)

    @property
    def num_stages(self) -> int:
        return len(self.layer_ranges)

    @property
    def num_layers(self) -> int:
        return self.layer_ranges[-1][1]

    @property
    def is_separated(self) -> bool:
        return bool(self.encoder_chunks)

    def layers_per_stage(self) -> list[int]:
        return [hi - lo for lo, hi in self.layer_ranges]

    def layers_among(self, layers) -> list[int]:
        """How many of the layers ``layers`` (indices, such as the linear-attention ones) each stage holds."""
        return [sum(lo <= i < hi for i in layers) for lo, hi in self.layer_ranges]

    def placement(self, *, encoder: bool, encoder_trained: bool) -> Placement:
        """Where this layout's chunks run (``encoder``: the model has one)."""
        if self.is_separated and encoder:
            return Placement.separated(self.num_stages, len(self.encoder_chunks), encoder_trained=encoder_trained)
        if self.chunks_per_rank > 1:
            return Placement.virtual(self.num_stages // self.chunks_per_rank, self.chunks_per_rank, self.style, encoder=encoder,
                                     encoder_trained=encoder_trained)
        return Placement.colocated(self.num_stages, encoder=encoder, encoder_trained=encoder_trained)


def _ranges(sizes) -> tuple[tuple[int, int], ...]:
    ends = np.cumsum(sizes)
    return tuple((int(e - n), int(e)) for n, e in zip(sizes, ends))
