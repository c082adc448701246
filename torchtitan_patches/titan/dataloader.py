"""pipetune's stateful dataloader as a TorchTitan ``BaseDataLoader``.

TorchTitan's trainer builds its dataloader from ``Trainer.Config.dataloader`` with the
data-parallel coordinates, the job's tokenizer and batch sizes. pipetune's loader also needs the
planning shapes of the model (tokens per image, vocabulary) and its packing source (the planner),
which exist only once the trainer has built the model; ``PipeTuneTitanDataLoader`` therefore opens
the data set at build time (TorchTitan builds the dataloader before the model, so a data set too
small for ``gbs`` or a bad row stops the job before any model is built) and is bound to the model
and planner by ``PipeTuneTrainer`` (``bind``) before the first step or checkpoint load.

It yields one ``GlobalBatch`` per step (every micro-batch of the step, packed as the plan says)
rather than TorchTitan's ``(input_dict, labels)`` per micro-batch: the number and length of
micro-batches change every step, which the stock trainer's fixed micro-batch count cannot express.
State (``state_dict``) is the wrapped loader's: next step, configuration fingerprint, overlong
totals; TorchTitan's ``CheckpointManager`` stores it per data-parallel rank.

Token ids come from the data set: pre-tokenized ``input_ids``, raw ``text`` through the job's
tokenizer (``titan.tokenizer.text_tokenizer``: metadata look-ahead and content use the same one,
with its BOS/EOS and its image and vision start/end ids), or
synthetic ids for generated data. The tokenizer's vocabulary must fit the model's (checked at
``bind``). With data parallelism every rank yields its replica's share of the global batch
(``gbs`` samples), as the plan channel says (``PipeTuneTrainer``).

State: the position in the global stream, which no degree decides, in one entry that every rank
writes alike (DCP keeps one copy; TorchTitan's own loaders store one per data-parallel rank and
refuse another degree). A job of any data-parallel, pipeline or tensor degree resumes it at the
saved step, each replica's share coming from the split as usual; another data set, seed, packing
or ``gbs`` is refused, naming the job option. The overlong totals (of a replica's shares, which
the trainer does not report) are not checkpointed: they restart with the job.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass

from torchtitan.components.dataloader import BaseDataLoader

from pipetune.config.model import ModelConfig
from pipetune.data import Overlong
from pipetune.data.image_files import BadImages
from pipetune.data.storage import open_dataset
from pipetune.packing import PackingConfig
from torchtitan_patches.data.loader import DataLoaderConfig, PackingSource, PipeTuneDataLoader
from torchtitan_patches.titan.tokenizer import text_tokenizer


class PipeTuneTitanDataLoader(BaseDataLoader):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        gbs: int = 16
        """Samples (documents) per global batch over all data-parallel replicas, before packing
        (PipeTune's GBS)."""

        seed: int = 0
        """Shuffling seed of the sample stream."""

        overlong: str = "truncate"
        """Samples longer than ``training.seq_len``: ``truncate``, ``reject`` (leave out) or ``error``
        (as ``pipetune pack --overlong``)."""

        num_workers: int = 2
        """Worker processes that decode images and build the tensors, off the training process
        (0: in it, as the CPU jobs do, whose ranks already take every core)."""

        min_pixels: int = 0
        """Images smaller than this many pixels are upscaled (0: one merged patch of the encoder)."""

        max_pixels: int = 0
        """Images larger than this many pixels are downscaled, keeping their aspect ratio, as
        TorchTitan's ``resize_to_pixel_budget`` does (0: the encoder's standard image,
        ``pipetune.image_grid`` patches per side)."""

        keep_aspect: bool = True
        """Images keep their aspect ratio and size within the pixel budget; off: every image is
        resized to the standard square. The separated layout always resizes to the square (its
        encoder messages have one shape)."""

        bad_images: str = "error"
        """An image that cannot be read: ``error`` names it and stops before training; ``skip``
        leaves its sample out (counted in the log) and keeps what can be read of damaged ones."""

        def data_loader_config(self, seq_len: int) -> DataLoaderConfig:
            """pipetune's loader settings for rows of up to ``seq_len`` tokens."""
            if not self.dataset_path:
                raise ValueError("dataloader.dataset_path is empty: give the data set directory (e.g. from `pipetune data make`)")
            if self.overlong not in {o.value for o in Overlong}:
                raise ValueError(f"dataloader.overlong={self.overlong!r}: use one of {[o.value for o in Overlong]}")
            if self.bad_images not in {b.value for b in BadImages}:
                raise ValueError(f"dataloader.bad_images={self.bad_images!r}: use one of {[b.value for b in BadImages]}")
            return DataLoaderConfig(data=self.dataset_path, gbs=self.gbs, max_seq_len=seq_len, seed=self.seed,
                                    overlong=Overlong(self.overlong), num_workers=self.num_workers,
                                    packing=PackingConfig(max_seq_len=seq_len), min_pixels=self.min_pixels or None,
                                    max_pixels=self.max_pixels or None, keep_aspect=self.keep_aspect,
                                    bad_images=BadImages(self.bad_images))

    def __init__(self, config: Config, *, dp_world_size: int = 1, dp_rank: int = 0, tokenizer=None, seq_len: int,
                 local_batch_size: int = 1, **kwargs):
        self.loader_config = config.data_loader_config(seq_len)
        if config.gbs < 1:
            raise ValueError(f"dataloader.gbs must be a positive number of samples, got {config.gbs}")
        if config.gbs < dp_world_size:
            raise ValueError(f"dataloader.gbs {config.gbs} is smaller than the data-parallel degree {dp_world_size}: every replica "
                             "needs a sample each step; raise dataloader.gbs")
        self.config = config
        self.tokenizer = tokenizer
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.store = open_dataset(config.dataset_path, tokenizer=text_tokenizer(tokenizer), bad_images=self.loader_config.bad_images)
        rows = len(self.store)
        if config.gbs > rows:
            left_out = f"; {len(self.store.skipped)} more are left out" if self.store.skipped else ""
            raise ValueError(f"dataloader.gbs {config.gbs} is larger than the data set {config.dataset_path} ({rows} rows to train "
                             f"on{left_out}): a global batch holds distinct samples; use dataloader.gbs <= {rows} or a larger data set")
        self.inner: PipeTuneDataLoader | None = None

    def bind(self, model: ModelConfig, packing_source: PackingSource, *, seq_multiple: int = 1, pixels: bool = True,
             square_images: bool = False) -> PipeTuneDataLoader:
        """Build the wrapped loader for ``model``'s shapes, packed by ``packing_source``, its
        micro-batches padded to a multiple of ``seq_multiple`` tokens (sequence parallelism);
        ``pixels=False`` on a rank that runs no encoder chunk (it decodes no image);
        ``square_images`` resizes every image to the standard square (the separated layout)."""
        if self.tokenizer is not None and self.tokenizer.get_vocab_size() > model.backbone.vocab_size:
            raise ValueError(
                f"the job's tokenizer has {self.tokenizer.get_vocab_size()} ids but the model's vocabulary is "
                f"{model.backbone.vocab_size}; use a tokenizer that fits the model")
        config = dataclasses.replace(self.loader_config, seq_multiple=seq_multiple,
                                     keep_aspect=self.loader_config.keep_aspect and not square_images)
        self.inner = config.build(model, packing_source=packing_source, tokenizer=self.store.tokenizer, dp_rank=self.dp_rank,
                                  dp_size=self.dp_world_size, pixels=pixels, store=self.store)
        return self.inner

    def _bound(self) -> PipeTuneDataLoader:
        if self.inner is None:
            raise RuntimeError("PipeTuneTitanDataLoader is used before PipeTuneTrainer bound it to the model and planner")
        return self.inner

    def __iter__(self):
        return iter(self._bound())

    KEY = "pipetune_loader"
    OPTIONS = {"data": "dataloader.dataset_path", "rows": "dataloader.dataset_path", "data_digest": "dataloader.dataset_path",
               "gbs": "dataloader.gbs", "seed": "dataloader.seed", "max_seq_len": "training.seq_len", "overlong": "dataloader.overlong",
               "image_sizing": "dataloader.min_pixels/max_pixels/keep_aspect, pipetune.image_grid"}
    """The job option behind each field of the loader's fingerprint (the rest are not job options)."""

    def state_dict(self) -> dict:
        # one pickled leaf, alike on every rank: the stream position and what decides the stream
        state = self._bound().state_dict()
        return {self.KEY: pickle.dumps({k: v for k, v in state.items() if k not in ("share", "truncation")})}

    def load_state_dict(self, state_dict: dict) -> None:
        self._bound().load_state_dict(pickle.loads(state_dict[self.KEY]), names=self.OPTIONS)
