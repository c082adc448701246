"""Sample metadata as a struct of numpy arrays, and the policy for samples that do not fit.

A sample is (id, source, text tokens, images). Its packed sequence is its text with each image's
tokens inserted at a text offset (``image_offsets``, ascending), each image bracketed by
``image_markers`` vision start/end tokens (raw text tokenized with a tokenizer that has them), so
its length is ``text_tokens + sum(image_tokens) + num_images * image_markers``. An image's token
count follows from its pixel size and the model's encoder (``pipetune.data.images``), so it is set
when a batch is bound to a model (``with_image_tokens``).
Everything downstream (packing, cost, planning) sees only these arrays; tensors are built from
them later, by the runtime.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum

import numpy as np


class Overlong(str, Enum):
    """What to do with a sample longer than ``max_seq_len`` (always counted in reports).

    - ``truncate``: keep the longest prefix that fits; an image that would straddle the cut is
      dropped together with everything after it. A sample left without any text token is an error.
    - ``reject``: leave the sample out of its batch.
    - ``error``: raise, naming the sample.
    """

    TRUNCATE = "truncate"
    REJECT = "reject"
    ERROR = "error"


@dataclass(frozen=True)
class SampleTable:
    """Metadata of a set of samples; row ``i`` is one sample.

    Per-image columns are stored flat with ``image_ptr`` (CSR): sample ``i``'s images are
    ``image_ptr[i]:image_ptr[i + 1]`` (``num_images[i]`` of them), with their text offsets
    (``image_offsets``), pixel sizes ``(height, width)`` (``image_sizes``; 0 where unknown: the
    pixels are synthesized at the model's standard size) and sequence tokens (``image_tokens``).
    ``image_markers`` (0 or 2) are the positions each image takes besides its tokens (its vision
    start/end): neither label targets nor image tokens.
    """

    ids: np.ndarray
    source: np.ndarray
    source_names: tuple[str, ...]
    text_tokens: np.ndarray
    num_images: np.ndarray
    image_offsets: np.ndarray
    image_ptr: np.ndarray
    image_sizes: np.ndarray
    image_tokens: np.ndarray
    image_markers: int = 0

    @classmethod
    def build(
        cls,
        *,
        ids,
        source,
        source_names,
        text_tokens,
        num_images,
        image_offsets=None,
        tokens_per_image: int | np.ndarray = 0,
        image_sizes=None,
        image_tokens=None,
        image_markers: int = 0,
    ) -> "SampleTable":
        """Build from per-sample lists. ``image_offsets`` defaults to every image before the text;
        ``image_tokens`` (flat, per image) to ``tokens_per_image`` (one per sample, or for all)."""
        ids = np.asarray(ids, dtype=np.int64)
        n = len(ids)
        num_images = np.asarray(num_images, dtype=np.int64)
        if (num_images < 0).any():
            i = int(np.argmax(num_images < 0))
            raise ValueError(f"sample id={ids[i]} has a negative image count ({num_images[i]})")
        if image_offsets is None:
            flat = np.zeros(int(num_images.sum()), dtype=np.int64)
        else:
            flat = np.concatenate([np.asarray(o, dtype=np.int64) for o in image_offsets]) if n else np.zeros(0, np.int64)
        ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_images, out=ptr[1:])
        if image_tokens is None:
            image_tokens = np.repeat(np.broadcast_to(np.asarray(tokens_per_image, dtype=np.int64), (n,)), num_images)
        sizes = np.zeros((ptr[-1], 2), np.int64) if image_sizes is None else np.asarray(image_sizes, np.int64).reshape(-1, 2)
        table = cls(
            ids=ids,
            source=np.asarray(source, dtype=np.int16),
            source_names=tuple(source_names),
            text_tokens=np.asarray(text_tokens, dtype=np.int64),
            num_images=num_images,
            image_offsets=flat,
            image_ptr=ptr,
            image_sizes=sizes,
            image_tokens=np.asarray(image_tokens, dtype=np.int64),
            image_markers=image_markers,
        )
        table.validate()
        return table

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def image_owner(self) -> np.ndarray:
        """The sample (row) of every image."""
        return np.repeat(np.arange(len(self)), self.num_images)

    @property
    def sample_image_tokens(self) -> np.ndarray:
        """Image tokens of each sample (without markers)."""
        return np.bincount(self.image_owner, weights=self.image_tokens, minlength=len(self)).astype(np.int64)

    @property
    def lengths(self) -> np.ndarray:
        """Packed sequence length of each sample (text + image tokens and their markers)."""
        return self.text_tokens + self.sample_image_tokens + self.num_images * self.image_markers

    @property
    def label_tokens(self) -> np.ndarray:
        """Next-token targets of each sample: every text token but one that opens the sequence."""
        has_img = self.num_images > 0
        opens_with_image = np.zeros(len(self), dtype=bool)
        opens_with_image[has_img] = self.image_offsets[self.image_ptr[:-1][has_img]] == 0
        return self.text_tokens - (~opens_with_image).astype(np.int64)

    def offsets_of(self, i: int) -> np.ndarray:
        return self.image_offsets[self.image_ptr[i] : self.image_ptr[i + 1]]

    def validate(self) -> None:
        """Reject degenerate rows with a message naming the first bad sample."""
        n = len(self.ids)
        for name in ("source", "text_tokens", "num_images"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"sample table: column {name} has {len(getattr(self, name))} rows, ids has {n}")
        for name in ("image_offsets", "image_sizes", "image_tokens"):
            if len(getattr(self, name)) != self.image_ptr[-1]:
                raise ValueError(f"sample table: {name} has {len(getattr(self, name))} entries for {self.image_ptr[-1]} images")
        checks = [
            (self.text_tokens <= 0, "has no text tokens (text_tokens={v}); every sample needs text to train on", self.text_tokens),
        ]
        for bad, msg, col in checks:
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"sample id={self.ids[i]} {msg.format(v=col[i])}")
        if len(self.image_offsets):
            owner = np.repeat(np.arange(n), self.num_images)
            bad = (self.image_offsets < 0) | (self.image_offsets > self.text_tokens[owner])
            if bad.any():
                i = int(owner[np.argmax(bad)])
                raise ValueError(
                    f"sample id={self.ids[i]} has image offsets {self.offsets_of(i).tolist()} outside its "
                    f"text of {self.text_tokens[i]} tokens"
                )
            step_back = np.diff(self.image_offsets) < 0
            same_owner = owner[1:] == owner[:-1]
            if (step_back & same_owner).any():
                i = int(owner[1:][np.argmax(step_back & same_owner)])
                raise ValueError(f"sample id={self.ids[i]} has image offsets not in ascending order: {self.offsets_of(i).tolist()}")

    def digest(self) -> str:
        """SHA-256 of everything the batch stream and packing read from the rows (ids, sources, lengths, images)."""
        h = hashlib.sha256()
        h.update("\0".join(self.source_names).encode())
        for a in (self.ids, self.source, self.text_tokens, self.num_images, self.image_offsets, self.image_sizes):
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
            h.update(b"|")
        if self.image_markers:
            h.update(f"markers={self.image_markers}".encode())
        return h.hexdigest()

    def take(self, idx: np.ndarray) -> "SampleTable":
        idx = np.asarray(idx, dtype=np.int64)
        counts = self.num_images[idx]
        ptr = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(counts, out=ptr[1:])
        starts = self.image_ptr[idx]
        gather = np.repeat(starts - ptr[:-1], counts) + np.arange(ptr[-1])
        return SampleTable(
            ids=self.ids[idx],
            source=self.source[idx],
            source_names=self.source_names,
            text_tokens=self.text_tokens[idx],
            num_images=counts,
            image_offsets=self.image_offsets[gather],
            image_ptr=ptr,
            image_sizes=self.image_sizes[gather],
            image_tokens=self.image_tokens[gather],
            image_markers=self.image_markers,
        )

    def with_image_tokens(self, image_tokens: np.ndarray) -> "SampleTable":
        """The table with every image's sequence tokens set (the model's encoder decides them)."""
        image_tokens = np.asarray(image_tokens, dtype=np.int64)
        if len(image_tokens) != len(self.image_offsets):
            raise ValueError(f"sample table: {len(image_tokens)} image token counts for {len(self.image_offsets)} images")
        return SampleTable(**{**self.__dict__, "image_tokens": image_tokens})


@dataclass(frozen=True)
class OverlongReport:
    """How many samples of a batch exceeded ``max_seq_len`` and what was done with them.

    ``samples`` and ``tokens`` are the batch's totals before the policy, the base of the shares.
    """

    policy: Overlong
    truncated_ids: tuple[int, ...] = ()
    rejected_ids: tuple[int, ...] = ()
    tokens_cut: int = 0
    samples: int = 0
    tokens: int = 0

    def to_dict(self) -> dict:
        return {
            "policy": self.policy.value,
            "truncated": len(self.truncated_ids),
            "rejected": len(self.rejected_ids),
            "tokens_cut": self.tokens_cut,
        }


@dataclass(frozen=True)
class OverlongTotals:
    """``OverlongReport`` counts summed over batches (what a run prints and checkpoints)."""

    policy: Overlong
    samples: int = 0
    tokens: int = 0
    truncated: int = 0
    rejected: int = 0
    tokens_cut: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", Overlong(self.policy))

    def __add__(self, report: OverlongReport) -> "OverlongTotals":
        return OverlongTotals(
            self.policy,
            self.samples + report.samples,
            self.tokens + report.tokens,
            self.truncated + len(report.truncated_ids),
            self.rejected + len(report.rejected_ids),
            self.tokens_cut + report.tokens_cut,
        )

    def to_dict(self) -> dict:
        return {**self.__dict__, "policy": self.policy.value}

    def describe(self) -> str:
        """One line such as ``overlong (truncate): 13 of 100 samples truncated (13.0 %), ...``."""

        def share(a: int, b: int) -> str:
            return f"{100.0 * a / b:.1f} %" if b else "-"

        if self.policy is Overlong.TRUNCATE:
            done = f"{self.truncated} of {self.samples} samples truncated ({share(self.truncated, self.samples)})"
            if self.rejected:
                done += f", {self.rejected} rejected (no text token fits after their leading images)"
        else:
            done = f"{self.rejected} of {self.samples} samples rejected ({share(self.rejected, self.samples)})"
        return f"overlong ({self.policy.value}): {done}, {self.tokens_cut} of {self.tokens} tokens cut ({share(self.tokens_cut, self.tokens)})"


def apply_overlong_policy(table: SampleTable, max_seq_len: int, policy: Overlong | str) -> tuple[SampleTable, OverlongReport]:
    """Make every sample fit in ``max_seq_len`` tokens according to ``policy``."""
    policy = Overlong(policy)
    if max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be > 0, got {max_seq_len}")
    lengths = table.lengths
    over = np.flatnonzero(lengths > max_seq_len)
    base = dict(samples=len(table), tokens=int(lengths.sum()))
    if len(over) == 0:
        return table, OverlongReport(policy, **base)
    if policy is Overlong.ERROR:
        i = over[0]
        raise ValueError(
            f"sample id={table.ids[i]} is {lengths[i]} tokens ({table.text_tokens[i]} text + {table.num_images[i]} images of "
            f"{lengths[i] - table.text_tokens[i]} tokens), longer than max_seq_len={max_seq_len} "
            f"({len(over)} such samples in this batch; set the overlong policy to truncate or reject)"
        )
    if policy is Overlong.REJECT:
        keep = np.setdiff1d(np.arange(len(table)), over)
        return table.take(keep), OverlongReport(
            policy, rejected_ids=tuple(int(x) for x in table.ids[over]), tokens_cut=int(lengths[over].sum()), **base
        )
    text = table.text_tokens.copy()
    nimg = table.num_images.copy()
    for i in over:
        text[i], nimg[i] = _truncate_one(table, int(i), max_seq_len)
    # No text token fits (frames or images first fill max_seq_len): nothing to learn from, rejected.
    textless = over[text[over] == 0]
    keep = np.setdiff1d(np.arange(len(table)), textless)
    kept_images = np.concatenate([np.arange(table.image_ptr[i], table.image_ptr[i] + nimg[i]) for i in keep] + [np.zeros(0, np.int64)])
    out = SampleTable.build(
        ids=table.ids[keep],
        source=table.source[keep],
        source_names=table.source_names,
        text_tokens=text[keep],
        num_images=nimg[keep],
        image_offsets=[table.offsets_of(i)[: nimg[i]] for i in keep],
        image_sizes=table.image_sizes[kept_images],
        image_tokens=table.image_tokens[kept_images],
        image_markers=table.image_markers,
    )
    cut = int(lengths.sum() - out.lengths.sum())
    return out, OverlongReport(
        policy,
        truncated_ids=tuple(int(x) for x in table.ids[np.setdiff1d(over, textless)]),
        rejected_ids=tuple(int(x) for x in table.ids[textless]),
        tokens_cut=cut,
        **base,
    )


def _truncate_one(table: SampleTable, i: int, max_seq_len: int) -> tuple[int, int]:
    """Longest prefix of sample ``i`` within ``max_seq_len``, never splitting an image: (text tokens
    kept, images kept); 0 text tokens when the images before its first text token fill the budget."""
    sizes = table.image_tokens[table.image_ptr[i] : table.image_ptr[i + 1]] + table.image_markers
    offsets = table.offsets_of(i).tolist()
    room, prev = max_seq_len, 0
    for j, off in enumerate(offsets):
        if off - prev >= room:
            kept = (prev + room, j)
            break
        room -= off - prev
        if sizes[j] > room:
            kept = (off, j)
            break
        room -= int(sizes[j])
        prev = off
    else:
        kept = (prev + min(int(table.text_tokens[i]) - prev, room), len(offsets))
    return kept
