"""pipetune's data sets for TorchTitan's stock pipeline: fixed-shape micro-batches of packed rows.

TorchTitan's trainer pulls ``training.local_batch_size / pipeline_parallel_microbatch_size``
micro-batches per step, each ``(input_dict, labels)`` of ``microbatch_size`` rows of exactly
``training.seq_len`` tokens (its ``PipelineStage`` infers shapes once). ``FixedShapeDataLoader``
reads the global batches pipetune's loader gives ``PipeTuneTrainer`` (same data set, GBS, seed and
stream), packs each as TorchTitan's multimodal packer packs a flushed buffer (``MMSamplePacker``:
scan the samples in arrival order and take each that still fits, row after row) and pads every row
to ``seq_len`` with one padding document without labels. A step is ``rows_per_step`` rows (which
must equal ``training.local_batch_size``):

* streamed (default), as TorchTitan's loaders stream: the next ``rows_per_step`` rows of the
  batches in order, so steps do not keep to global batches, but every sample is trained once in
  order and only row tails are padding;
* ``pad_steps``: exactly one global batch per step, padded with all-padding rows (a batch that
  packs into more rows raises, naming the step; ``rows_needed`` says it for a run ahead). Step
  ``s`` then holds the samples of ``PipeTuneTrainer``'s step ``s`` and the same loss normaliser,
  so the two trainers' losses agree from the same weights.

Each micro-batch is TorchTitan's multimodal format: ``input``, per-document ``positions`` (from
which the trainer builds the document mask), ``pixel_values`` as padded patches ``(images,
patches, patch_dim)`` with ``grid_thw`` (None without images) and ``special_tokens`` (the image id
of the job's tokenizer, by which the model finds image positions); labels ``-100`` wherever
nothing is predicted. ``work`` holds the ``StepWork`` of each step cut (model FLOPs of its real
documents, their tokens, padding tokens) until its reader clears it. Tensors come from ``torchtitan_patches.data`` (pipetune's content path); ``StockTrainer``
binds the loader to the model's planning shapes before the first step. Checkpoints hold the
position in the stream of global batches, so only ``pad_steps`` jobs resume (a streamed step may
end inside a batch).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torchtitan.components.dataloader import BaseDataLoader

from pipetune.config.model import ModelConfig
from pipetune.data import Overlong
from pipetune.data.batch import BatchMeta
from pipetune.packing import FlopsModel
from pipetune.packing import PackingConfig
from torchtitan_patches.data.loader import DataLoaderConfig, PipeTuneDataLoader
from torchtitan_patches.data.micro_batch import IGNORE_INDEX, PackedMicroBatch
from torchtitan_patches.titan.dataloader import PipeTuneTitanDataLoader
from torchtitan_patches.titan.metrics import StepWork
from torchtitan_patches.models.image_batches import collated_images
from torchtitan_patches.titan.tokenizer import text_tokenizer


def scan_and_pick(lengths: np.ndarray, seq_len: int) -> list[list[int]]:
    """Rows of sample positions as TorchTitan's ``MMSamplePacker`` packs a flushed buffer."""
    left, rows = list(range(len(lengths))), []
    while left:
        row, used, rest = [], 0, []
        for k in left:
            if used + int(lengths[k]) <= seq_len:
                row.append(k)
                used += int(lengths[k])
            else:
                rest.append(k)
        if not row:
            raise ValueError(f"samples {left[:5]} are longer than seq_len {seq_len}")
        rows.append(row)
        left = rest
    return rows


@dataclass(frozen=True)
class ScanAndPick:
    """Packing source of the stock rows (sample ids per row)."""

    seq_len: int

    def __call__(self, meta: BatchMeta) -> list[list[int]]:
        return [meta.table.ids[row].tolist() for row in scan_and_pick(meta.table.lengths, self.seq_len)]


def rows_needed(loader: PipeTuneDataLoader, steps: int, seq_len: int) -> list[int]:
    """The rows each of the first ``steps`` global batches packs into (metadata only)."""
    return [len(scan_and_pick(loader.meta(s).table.lengths, seq_len)) for s in range(steps)]


class FixedShapeDataLoader(BaseDataLoader):
    @dataclass(kw_only=True, slots=True)
    class Config(PipeTuneTitanDataLoader.Config):
        """``PipeTuneTitanDataLoader``'s settings (the same stream of global batches), and:"""

        rows_per_step: int = 8
        """Rows of ``seq_len`` tokens per step; must equal ``training.local_batch_size``."""

        pad_steps: bool = False
        """One global batch per step, padded with all-padding rows (else rows are streamed)."""

    def __init__(self, config: Config, *, dp_world_size: int = 1, dp_rank: int = 0, tokenizer=None, seq_len: int,
                 local_batch_size: int = 1, **kwargs):
        self.loader_config = config.data_loader_config(seq_len)
        if dp_world_size != 1:
            raise ValueError(f"FixedShapeDataLoader feeds one pipeline replica; this job has {dp_world_size} data-parallel ranks")
        if config.rows_per_step % local_batch_size:
            raise ValueError(f"dataloader.rows_per_step {config.rows_per_step} is not a multiple of the micro-batch size "
                             f"{local_batch_size} (parallelism.pipeline_parallel_microbatch_size)")
        self.config, self.tokenizer, self.seq_len, self.rows_per_micro_batch = config, tokenizer, seq_len, local_batch_size
        self.inner: PipeTuneDataLoader | None = None
        self.model: ModelConfig | None = None
        self.flops: FlopsModel | None = None
        self.work: list[StepWork] = []

    def bind(self, model: ModelConfig) -> PipeTuneDataLoader:
        """Build the wrapped loader for ``model``'s planning shapes (its encoder's patches)."""
        self.model, self.flops = model, FlopsModel(model)
        self.inner = self.loader_config.build(model, packing_source=ScanAndPick(self.seq_len), tokenizer=text_tokenizer(self.tokenizer))
        return self.inner

    def _bound(self) -> PipeTuneDataLoader:
        if self.inner is None:
            raise RuntimeError("FixedShapeDataLoader is used before StockTrainer bound it to the model")
        return self.inner

    def __iter__(self):
        per_step, queue = self.config.rows_per_step, []
        for batch in self._bound():
            rows = [self._row(mb) for mb in batch.micro_batches]
            if self.config.pad_steps:
                if len(rows) > per_step:
                    raise ValueError(f"step {batch.step}: its {sum(mb.num_tokens for mb in batch.micro_batches)} tokens pack into "
                                     f"{len(rows)} rows of {self.seq_len}, more than dataloader.rows_per_step {per_step}: raise "
                                     "it and training.local_batch_size together")
                rows += [self._row(None)] * (per_step - len(rows))
            queue += rows
            while len(queue) >= per_step:
                step, queue = queue[:per_step], queue[per_step:]
                self.work.append(sum((r["work"] for r in step), StepWork()))
                for k in range(0, per_step, self.rows_per_micro_batch):
                    yield self._micro_batch(step[k:k + self.rows_per_micro_batch])

    def _row(self, mb: PackedMicroBatch | None) -> dict:
        """One row of ``seq_len`` tokens: ``mb``'s documents, then a padding document (all padding
        for ``None``)."""
        n = mb.num_tokens if mb is not None else 0
        pad = self.seq_len - n
        work = StepWork.of(self.flops, [mb] if mb is not None else [])
        tokens, labels, positions = (torch.full((self.seq_len,), self._bound().store.tokenizer.pad), torch.full((self.seq_len,), IGNORE_INDEX),
                                     torch.cat([torch.zeros(n, dtype=torch.long), torch.arange(pad)]))
        images = None
        if mb is not None:
            tokens[:n], labels[:n], positions[:n] = mb.tokens, mb.labels, mb.positions
            images = mb if mb.num_images else None
        return {"input": tokens, "labels": labels, "positions": positions, "images": images,
                "work": replace(work, padding_tokens=work.padding_tokens + pad)}

    def _micro_batch(self, rows: list[dict]) -> tuple[dict, torch.Tensor]:
        images = [r["images"] for r in rows if r["images"] is not None]
        patches = grid = None
        if images:
            pairs = [collated_images(mb) for mb in images]
            longest = max(p.shape[1] for p, _ in pairs)
            patches = torch.cat([F.pad(p, (0, 0, 0, longest - p.shape[1])) for p, _ in pairs])
            grid = torch.cat([g for _, g in pairs])
        stack = lambda key: torch.stack([r[key] for r in rows])  # noqa: E731
        return ({"input": stack("input"), "positions": stack("positions"), "pixel_values": patches, "grid_thw": grid,
                 "special_tokens": {"image_id": self._bound().store.tokenizer.image}}, stack("labels"))

    def state_dict(self) -> dict:
        if not self.config.pad_steps:
            raise ValueError("dataloader.pad_steps is off: a streamed step may end inside a global batch, which the loader state "
                             "cannot resume; checkpoint with --dataloader.pad_steps")
        return {"pipetune_fixed_shape_loader": pickle.dumps(self._bound().state_dict())}

    def load_state_dict(self, state_dict: dict) -> None:
        self._bound().load_state_dict(pickle.loads(state_dict["pipetune_fixed_shape_loader"]))
