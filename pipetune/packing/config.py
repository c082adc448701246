"""Pack one batch's metadata with a chosen packer at a fixed micro-batch size."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from pipetune.config.model import ModelConfig
from pipetune.packing.algorithms import pack_balanced, pack_original
from pipetune.packing.flops import FlopsModel
from pipetune.packing.groups import Packing


class PackerKind(str, Enum):
    BALANCED = "balanced"
    ORIGINAL = "original"


@dataclass(frozen=True, kw_only=True)
class PackingConfig:
    """How a batch becomes micro-batches: packer, micro-batch size and ``max_seq_len``.

    A micro-batch holds ``mbs * max_seq_len`` tokens. ``original`` shuffles with
    ``seed`` and the step number, so a step always packs the same way. ``min_micro_batches``
    (balanced packer only): spread the batch over at least that many micro-batches (at most one
    per sample), each then holding fewer tokens than it could; a batch of few tokens on a deep
    pipeline otherwise leaves most ranks idle.
    """

    packer: PackerKind = PackerKind.BALANCED
    mbs: int = 1
    max_seq_len: int = 8192
    seed: int = 0
    min_micro_batches: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "packer", PackerKind(self.packer))
        if self.mbs <= 0 or self.max_seq_len <= 0:
            raise ValueError(f"mbs and max_seq_len must be > 0, got mbs={self.mbs}, max_seq_len={self.max_seq_len}")
        if self.min_micro_batches < 1:
            raise ValueError(f"min_micro_batches must be >= 1, got {self.min_micro_batches}")
        if self.min_micro_batches > 1 and self.packer is not PackerKind.BALANCED:
            raise ValueError(f"min_micro_batches={self.min_micro_batches} needs the balanced packer; the original packer fills "
                             "micro-batches first-fit, as TorchTitan's baseline does")

    @property
    def capacity(self) -> int:
        return self.mbs * self.max_seq_len

    def build(self, model: ModelConfig) -> "BatchPacker":
        return BatchPacker(self, FlopsModel(model))


@dataclass(frozen=True)
class BatchPacker:
    config: PackingConfig
    flops: FlopsModel

    def __call__(self, lengths: np.ndarray, step: int) -> Packing:
        cfg = self.config
        if cfg.packer is PackerKind.BALANCED:
            return pack_balanced(lengths, self.flops.sequence_flops(lengths), cfg.capacity, min(cfg.min_micro_batches, len(lengths)))
        return pack_original(lengths, cfg.capacity, np.random.default_rng([cfg.seed, step]))
