"""Metadata of one global batch: which rows, and their samples after the overlong policy."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pipetune.data.images import ImageSizing
from pipetune.data.samples import Overlong, OverlongReport, SampleTable, apply_overlong_policy
from pipetune.data.stream import BatchStream


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

    def share(self, ids) -> "BatchMeta":
        """The part of this batch made of the samples ``ids`` (kept in the batch's row order): one
        data-parallel replica's share. Ids not in the batch are an error, not a silent drop."""
        want = np.asarray(list(ids), dtype=np.int64)
        idx = np.flatnonzero(np.isin(self.table.ids, want))
        if len(idx) != len(np.unique(want)):
            missing = np.setdiff1d(want, self.table.ids)[:5].tolist()
            raise ValueError(f"batch {self.step}: sample ids {missing} are not in this batch")
        return replace(self, rows=self.rows[idx], table=self.table.take(idx))


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
    rows = stream.rows(step)
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
    return BatchMeta(step=step, rows=rows, table=resolved, overlong=report)
