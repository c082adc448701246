"""``PipeTuneDataLoader``: a torchdata ``StatefulDataLoader`` yielding packed global batches.

Flow per step: the batch sampler (main process) looks up the step's metadata, asks the packing
source (a fixed packer, or the planner) which samples share a micro-batch, and hands that spec to a
worker, which builds the tensors. The loader never re-decides a packing it was given.

Checkpointing: the sampler's whole state is the next step number, because batch ``s`` is a pure
function of (seed, s) (see ``pipetune.data.stream``). Resumed runs see the same sample ids; they see
the same tensors as long as the packing source is deterministic (the fixed packers are; the
planner is unless its time budget runs out, in which case it falls back to the balanced packing).
A state also records the configuration that decides the stream (``fingerprint``) and the overlong
totals so far; loading it into a loader of another configuration is refused, field by field,
since the step number alone would then repeat or skip samples. The data-parallel share is not part
of the stream: a state resumes at another degree or rank (the share comes from the packing
source), and only the overlong totals, which count the saved share's samples, restart at zero.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Protocol, runtime_checkable

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from pipetune.config.model import ModelConfig
from pipetune.data.batch import BatchMeta, BatchReader
from pipetune.data.image_files import BadImages
from pipetune.data.images import ImageSizing
from pipetune.data.samples import Overlong, OverlongTotals
from pipetune.data.storage import SampleStore, open_dataset
from pipetune.data.stream import BatchStream
from pipetune.data.text import BYTE_TOKENIZER, TextTokenizer
from pipetune.packing.config import PackingConfig
from torchtitan_patches.data.micro_batch import ContentSpec, GlobalBatch, build_micro_batch, sample_content


class PackingSource(Protocol):
    """Decides a batch's micro-batches: a list of sample-id lists, one per micro-batch."""

    def __call__(self, meta: BatchMeta) -> list[list[int]]: ...


@runtime_checkable
class ShareSource(Protocol):
    """Decides this data-parallel replica's share of batch ``step`` and its micro-batches, reading
    only the share's metadata with ``reader`` (``runtime.plan_channel.PlanChannel``): a rank then
    never reads the global batch."""

    def share(self, step: int, reader: BatchReader) -> tuple[BatchMeta, list[list[int]]]: ...


@dataclass(frozen=True)
class FixedPacking:
    """Packing source for a fixed packer and micro-batch size (the baselines, and the fallback)."""

    config: PackingConfig
    model: ModelConfig

    def __call__(self, meta: BatchMeta) -> list[list[int]]:
        packing = self.config.build(self.model)(meta.table.lengths, meta.step)
        return [meta.table.ids[g].tolist() for g in packing.groups()]


@dataclass(frozen=True)
class BatchSpec:
    """What a worker needs to build one global batch (or one data-parallel replica's share of it):
    metadata, micro-batch row groups and the label tokens of the whole global batch."""

    meta: BatchMeta
    groups: list[np.ndarray]
    global_label_tokens: int


def groups_from_ids(meta: BatchMeta, id_groups: list[list[int]]) -> list[np.ndarray]:
    """Map sample-id groups to row positions, checking that they cover the batch exactly once."""
    pos = {int(sid): k for k, sid in enumerate(meta.table.ids.tolist())}
    seen = np.zeros(len(pos), dtype=np.int64)
    groups = []
    for j, ids in enumerate(id_groups):
        if len(ids) == 0:
            raise ValueError(f"step {meta.step}: micro-batch {j} of the packing is empty")
        try:
            g = np.fromiter((pos[int(s)] for s in ids), np.int64, len(ids))
        except KeyError as e:
            raise ValueError(f"step {meta.step}: packing names sample id={e.args[0]}, which is not in this batch") from None
        seen[g] += 1
        groups.append(g)
    if (seen != 1).any():
        k = int(np.argmax(seen != 1))
        what = "misses" if seen[k] == 0 else "repeats"
        raise ValueError(f"step {meta.step}: packing {what} sample id={int(meta.table.ids[k])}")
    return groups


class _StepSampler:
    """Batch sampler yielding one ``BatchSpec`` per step; stateful through the step counter.

    A ``ShareSource`` gives this replica's share and its packing directly; a ``PackingSource``
    packs the global batch's metadata, or with ``replicas > 1`` this replica's share of it (the
    samples it names)."""

    def __init__(self, reader: Callable[[], BatchReader], source: Callable[[], PackingSource | ShareSource], max_steps: int | None,
                 replicas: int = 1):
        self._reader = reader
        self._source = source
        self._max_steps = max_steps
        self._replicas = replicas
        self.next_step = 0

    def __iter__(self):
        return self

    def __next__(self) -> BatchSpec:
        if self._max_steps is not None and self.next_step >= self._max_steps:
            raise StopIteration
        source, reader, step = self._source(), self._reader(), self.next_step
        if isinstance(source, ShareSource):
            share, id_groups = source.share(step, reader)
        else:
            meta = reader(step)
            id_groups = source(meta)
            share = meta.share(s for g in id_groups for s in g) if self._replicas > 1 else meta
        totals = share.totals
        if not totals.label_tokens:
            raise ValueError(
                f"step {step}: none of the batch's {totals.samples} samples has a token to predict (each has at "
                f"most one text token, e.g. sample ids {share.table.ids[:5].tolist()}), so its loss would be 0/0; "
                "remove samples with fewer than 2 text tokens from the data set"
            )
        spec = BatchSpec(share, groups_from_ids(share, id_groups), totals.label_tokens)
        self.next_step += 1
        return spec

    def state_dict(self) -> dict:
        return {"next_step": self.next_step}

    def load_state_dict(self, state: dict) -> None:
        self.next_step = int(state["next_step"])


class _PackedBatches(torch.utils.data.Dataset):
    """Builds the tensors of a ``BatchSpec`` (runs in the worker processes)."""

    def __init__(self, store: SampleStore, content: ContentSpec):
        self._store = store
        self._content = content

    def __len__(self) -> int:
        return len(self._store)

    def __getitem__(self, index):
        raise TypeError("PipeTuneDataLoader fetches whole batches; use __getitems__")

    def __getitems__(self, spec: BatchSpec) -> GlobalBatch:
        table = spec.meta.table
        rows = self._store.rows(spec.meta.rows, images=self._content.pixels)
        grids = self._content.sizing.grids(table.image_sizes) if self._content.sizing else np.zeros((0, 2), np.int64)
        contents = [sample_content(table, k, rows[k], self._content, grids) for k in range(len(table))]
        mbs = [build_micro_batch(table, g, [contents[k][:2] for k in g.tolist()], self._content, grids) for g in spec.groups]
        built = sum(m.num_label_tokens for m in mbs), sum(int(m.cu_seqlens[len(g)]) for m, g in zip(mbs, spec.groups))
        planned = int(table.label_tokens.sum()), int(table.lengths.sum())
        if built != planned:
            raise ValueError(f"step {spec.meta.step}: the built micro-batches hold {built[0]} label tokens in {built[1]} tokens, the "
                             f"metadata says {planned[0]} in {planned[1]}; the data set's text_tokens do not match its content "
                             f"(rows {spec.meta.rows[:5].tolist()} ...)")
        return GlobalBatch(step=spec.meta.step, micro_batches=mbs, num_label_tokens=spec.global_label_tokens, overlong=spec.meta.overlong,
                           damaged_images=sum(c[2] for c in contents))


def _unwrap(batch):
    return batch


@dataclass(frozen=True, kw_only=True)
class DataLoaderConfig:
    """Settings of ``PipeTuneDataLoader`` (``build`` makes one).

    ``data`` is any accepted data set path (see ``pipetune.data.storage``). ``packing`` is the
    fixed packing used when no planner supplies one. ``overlong`` is the policy for samples longer
    than ``max_seq_len`` (as in ``pipetune pack``); the loader counts them in ``truncation``.
    Images are resized into ``[min_pixels, max_pixels]`` keeping their aspect ratio (default: one
    merged patch to the encoder's standard image; ``keep_aspect=False``: every image to the standard
    square), see ``pipetune.data.images``; ``bad_images`` says what happens to unreadable ones
    (``pipetune.data.image_files``).
    Limits: one global batch per step. With ``dp_size > 1`` every data-parallel rank reads the
    same global batch and yields the share its packing source names (the planner's split, see
    ``pipetune.plan.data_parallel.replicas``); the loss normaliser stays the global batch's label tokens.
    """

    data: str | Path
    gbs: int
    max_seq_len: int
    packing: PackingConfig = field(default_factory=PackingConfig)
    overlong: Overlong = Overlong.TRUNCATE
    seed: int = 0
    shuffle: bool = True
    num_workers: int = 0
    prefetch_factor: int | None = None
    max_steps: int | None = None
    seq_multiple: int = 1
    """Micro-batch lengths are padded to a multiple of this (``ContentSpec.seq_multiple``)."""
    min_pixels: int | None = None
    max_pixels: int | None = None
    keep_aspect: bool = True
    bad_images: BadImages = BadImages.ERROR

    def __post_init__(self) -> None:
        object.__setattr__(self, "overlong", Overlong(self.overlong))
        object.__setattr__(self, "bad_images", BadImages(self.bad_images))
        if self.seq_multiple < 1:
            raise ValueError(f"seq_multiple must be >= 1, got {self.seq_multiple}")

    def build(
        self,
        model: ModelConfig,
        *,
        packing_source: PackingSource | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        tokenizer: TextTokenizer = BYTE_TOKENIZER,
        pixels: bool = True,
        store: SampleStore | None = None,
    ) -> "PipeTuneDataLoader":
        """``tokenizer`` tokenizes raw ``text`` rows and gives the image and padding ids;
        ``pixels=False`` for a rank that runs no encoder chunk (its batches carry no pixels);
        ``store``: ``data`` already opened with ``tokenizer`` and ``bad_images`` (opening derives
        every row's metadata: a caller that checked the data set before the model existed reuses it)."""
        store = open_dataset(self.data, tokenizer=tokenizer, bad_images=self.bad_images) if store is None else store
        return PipeTuneDataLoader(self, model, store, packing_source, dp_rank, dp_size, pixels=pixels)

    def sizing(self, model: ModelConfig) -> ImageSizing | None:
        """How ``model``'s encoder sees this loader's images (None without an encoder)."""
        if model.encoder is None:
            return None
        return ImageSizing.of(model.encoder, min_pixels=self.min_pixels, max_pixels=self.max_pixels, keep_aspect=self.keep_aspect)


class PipeTuneDataLoader(StatefulDataLoader):
    """Yields ``GlobalBatch`` objects (with ``dp_size > 1``: this replica's share of each, see
    ``DataLoaderConfig``); ``upcoming(k)`` gives the next ``k`` global batches' metadata.

    ``packing_source`` may be replaced before iterating (a planner built on ``meta`` needs the
    loader first). ``truncation`` sums the overlong reports of the batches yielded so far
    (``truncation.describe()`` is the line to print; through a ``ShareSource``, of this
    replica's shares).
    """

    def __init__(
        self,
        config: DataLoaderConfig,
        model: ModelConfig,
        store: SampleStore,
        packing_source: PackingSource | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        *,
        pixels: bool = True,
    ):
        if config.packing.max_seq_len != config.max_seq_len:
            raise ValueError(
                f"packing.max_seq_len={config.packing.max_seq_len} differs from the loader's max_seq_len={config.max_seq_len}"
            )
        if model.encoder is None and store.has_images:
            raise ValueError(f"{store.path}: the data set has images but model {model.name!r} has no vision encoder")
        store.check_token_ids(model.backbone.vocab_size)
        self.config = config
        self.model = model
        self.store = store
        self.stream = BatchStream(
            num_rows=len(store), gbs=config.gbs, seed=config.seed, shuffle=config.shuffle
        )
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.packing_source = packing_source or FixedPacking(config.packing, model)
        enc = model.encoder
        self.sizing = config.sizing(model)
        content = ContentSpec(
            vocab_size=model.backbone.vocab_size,
            sizing=self.sizing,
            channels=enc.channels if enc else 1,
            patch_temporal=enc.patch_temporal if enc else 1,
            content_seed=store.content_seed,
            data_dir=store.path,
            tokenizer=store.tokenizer,
            seq_multiple=config.seq_multiple,
            pixels=pixels,
            bad_images=config.bad_images,
        )
        self._sampler = _StepSampler(lambda: self.reader, lambda: self.packing_source, config.max_steps, replicas=dp_size)
        self._next_step = 0
        self.truncation = OverlongTotals(config.overlong)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 calls a deprecated torch API
            super().__init__(
                _PackedBatches(store, content),
                batch_sampler=self._sampler,
                collate_fn=_unwrap,
                num_workers=config.num_workers,
                prefetch_factor=config.prefetch_factor if config.num_workers else None,
                snapshot_every_n_steps=1,
            )

    @property
    def reader(self) -> BatchReader:
        """This loader's metadata lookups, as a picklable object (of its current ``stream``)."""
        return BatchReader(self.store.table, self.stream, self.sizing, self.config.max_seq_len, self.config.overlong)

    def meta(self, step: int) -> BatchMeta:
        """Metadata of batch ``step`` (pure function of the seed and the step)."""
        return self.reader(step)

    def pack(self, meta: BatchMeta, id_groups: list[list[int]]) -> GlobalBatch:
        """The batch of ``meta`` (from ``meta(step)``) packed as ``id_groups`` (checked to cover it
        exactly once), built in this process: the same batch under another plan, outside the
        stream (it moves no state)."""
        return self.dataset.__getitems__(BatchSpec(meta, groups_from_ids(meta, id_groups), int(meta.table.label_tokens.sum())))

    def upcoming(self, k: int) -> list[BatchMeta]:
        """Metadata of the next ``k`` batches this loader will yield, before their tensors exist."""
        return [self.meta(s) for s in range(self._next_step, self._next_step + k)]

    def __iter__(self) -> Iterator[GlobalBatch]:
        for batch in super().__iter__():
            self._next_step = batch.step + 1
            self.truncation = self.truncation + batch.overlong
            yield batch

    def fingerprint(self) -> dict:
        """Everything that decides which samples and tensors step ``s`` holds (saved with the state)."""
        cfg, packing = self.config, self.config.packing
        return {
            "data": str(self.store.origin),
            "rows": len(self.store),
            "data_digest": self.store.digest,
            "gbs": cfg.gbs,
            "seed": cfg.seed,
            "shuffle": cfg.shuffle,
            "max_seq_len": cfg.max_seq_len,
            "overlong": cfg.overlong.value,
            "packer": packing.packer.value,
            "mbs": packing.mbs,
            "packing_seed": packing.seed,
            "image_sizing": repr(self.sizing),
        }

    def state_dict(self) -> dict:
        return {
            "loader": super().state_dict(),
            "next_step": self._next_step,
            "fingerprint": self.fingerprint(),
            "share": [self.dp_rank, self.dp_size],
            "truncation": self.truncation.to_dict(),
        }

    def load_state_dict(self, state: dict, *, names: dict[str, str] | None = None) -> None:
        """Resume at ``state``'s step; refused, naming each field that differs (as ``names`` calls
        it, e.g. the job option), if the stream it was saved for is another."""
        saved, now, names = state.get("fingerprint"), self.fingerprint(), names or {}
        if saved is None:
            raise ValueError(
                "dataloader state has no record of the configuration it was saved for (an older pipetune wrote it); "
                "start the data stream afresh instead of loading it"
            )
        diff = [f"{k}{f' ({names[k]})' if k in names else ''}: saved {saved.get(k)!r}, now {now[k]!r}" for k in now if saved.get(k) != now[k]]
        if diff:
            raise ValueError(
                f"dataloader state (next step {state['next_step']}) was saved for another configuration: " + "; ".join(diff)
                + ". Resuming would repeat or skip samples: resume with the saved values, or start this one from step 0 without loading the state"
            )
        super().load_state_dict(state["loader"])
        self._next_step = int(state["next_step"])
        same_share = state.get("share") == [self.dp_rank, self.dp_size] and "truncation" in state
        self.truncation = OverlongTotals(**state["truncation"]) if same_share else OverlongTotals(self.config.overlong)
