"""Metadata of one global batch, or of one data-parallel replica's share of it: which rows, and
their samples after the overlong policy.

A share's metadata is read from its rows alone (``BatchReader.rows``): every step of the policy is
per sample, so it equals the global batch's metadata cut to those rows, and a rank that handles
one replica's share never reads the global batch. What a share needs of the whole batch (its
label tokens, which normalise the loss, and the coverage checksum) travels as ``BatchTotals``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from pipetune.data.images import ImageSizing
from pipetune.data.samples import Overlong, OverlongReport, SampleTable, apply_overlong_policy
from pipetune.data.stream import BatchStream

CHECKSUM_BITS = 40
_MIX = np.uint64(0x9E3779B97F4A7C15)


def id_checksum(ids) -> tuple[int, int]:
    """``(count, sum of mixed ids mod 2**40)`` of a set of sample ids. Summed over the replicas'
    shares (mod ``2**40``) it equals the global batch's when the shares partition the batch, and
    otherwise differs but with probability ``2**-40``: replicas check coverage with one all-reduce
    of two numbers instead of exchanging their samples (40 bits: a million replicas' sums still
    fit a signed 64-bit integer)."""
    ids = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        mixed = (ids + np.uint64(1)) * _MIX
        mixed ^= mixed >> np.uint64(29)
        total = int((mixed >> np.uint64(64 - CHECKSUM_BITS)).sum(dtype=np.uint64))
    return len(ids), total % 2**CHECKSUM_BITS


@dataclass(frozen=True)
class BatchTotals:
    """What a share needs of its whole batch: sample count, label tokens, id checksum."""

    samples: int
    label_tokens: int
    checksum: int


@dataclass(frozen=True)
class BatchMeta:
    """Everything the planner may know about batch ``step`` before any tensor exists.

    ``table`` row ``k`` is data set row ``rows[k]``; samples rejected by the overlong policy are
    absent from both and listed in ``overlong``.
    """

    step: int
    rows: np.ndarray
    table: SampleTable
    overlong: OverlongReport
    whole: BatchTotals | None = None  # a share's: its whole batch's totals (None: this is the whole batch)

    @cached_property
    def totals(self) -> BatchTotals:
        """The whole batch's totals (this batch's own, unless it is a share); computed once."""
        if self.whole is not None:
            return self.whole
        count, checksum = id_checksum(self.table.ids)
        return BatchTotals(count, int(self.table.label_tokens.sum()), checksum)

    def take(self, idx: np.ndarray) -> "BatchMeta":
        """The share made of table rows ``idx`` (kept in the batch's row order)."""
        idx = np.sort(np.asarray(idx, dtype=np.int64))
        return replace(self, rows=self.rows[idx], table=self.table.take(idx), whole=self.totals)

    def share(self, ids) -> "BatchMeta":
        """The part of this batch made of the samples ``ids`` (kept in the batch's row order): one
        data-parallel replica's share. Ids not in the batch are an error, not a silent drop."""
        want = np.asarray(list(ids), dtype=np.int64)
        idx = np.flatnonzero(np.isin(self.table.ids, want))
        if len(idx) != len(np.unique(want)):
            missing = np.setdiff1d(want, self.table.ids)[:5].tolist()
            raise ValueError(f"batch {self.step}: sample ids {missing} are not in this batch")
        return self.take(idx)


def batch_meta(
    table: SampleTable,
    stream: BatchStream,
    step: int,
    *,
    images: ImageSizing | None,
    max_seq_len: int,
    overlong: Overlong | str = Overlong.TRUNCATE,
) -> BatchMeta:
    """Look up batch ``step`` of ``stream`` in the data set metadata, give its images their tokens
    (``images``: the model's sizing; None for a model without a vision encoder) and make every
    sample fit."""
    return rows_meta(table, step, stream.rows(step), images=images, max_seq_len=max_seq_len, overlong=overlong)


def rows_meta(table: SampleTable, step: int, rows: np.ndarray, *, images: ImageSizing | None, max_seq_len: int,
              overlong: Overlong | str = Overlong.TRUNCATE, whole: BatchTotals | None = None) -> BatchMeta:
    """``batch_meta`` of data set rows ``rows`` of batch ``step``: with ``whole``, the share of
    that batch (the same samples and tokens as the global batch's metadata cut to those rows)."""
    rows = np.asarray(rows, dtype=np.int64)
    raw = table.take(rows)
    if images is None:
        if raw.num_images.any():
            i = int(np.argmax(raw.num_images > 0))
            raise ValueError(f"sample id={raw.ids[i]} has {raw.num_images[i]} images but the model has no vision encoder")
    else:
        raw = raw.with_image_tokens(images.tokens(raw.image_sizes))
    resolved, report = apply_overlong_policy(raw, max_seq_len, overlong)
    if report.rejected_ids:
        rows = rows[np.isin(raw.ids, resolved.ids)]
    if len(resolved) == 0:
        raise ValueError(f"batch {step}: every sample was rejected as longer than max_seq_len={max_seq_len}")
    return BatchMeta(step=step, rows=rows, table=resolved, overlong=report, whole=whole)


@dataclass(frozen=True)
class BatchReader:
    """A loader's metadata lookups as a picklable object (a planner process reads batches with
    it): ``reader(step)`` is batch ``step``'s metadata, ``reader.rows(step, rows, whole)`` a
    share's from its rows alone."""

    table: SampleTable
    stream: BatchStream
    images: ImageSizing | None
    max_seq_len: int
    overlong: Overlong = Overlong.TRUNCATE

    def __call__(self, step: int) -> BatchMeta:
        return batch_meta(self.table, self.stream, step, images=self.images, max_seq_len=self.max_seq_len, overlong=self.overlong)

    def rows(self, step: int, rows, whole: BatchTotals) -> BatchMeta:
        return rows_meta(self.table, step, rows, images=self.images, max_seq_len=self.max_seq_len, overlong=self.overlong, whole=whole)
