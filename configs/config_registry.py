"""TorchTitan job configs that train with pipetune's plans, installed as ``pipetune_configs`` (any directory).

    torchrun --nproc-per-node 2 -m torchtitan.train --module pipetune_configs --config muse_glimmer_mm \
        --dataloader.dataset_path DATA --pipetune.latency_table TABLE

Every function returns a ``PipeTuneTrainer.Config`` (the ``*_testbed`` ones a
``TestbedTrainer.Config``): TorchTitan's ``Trainer.Config`` plus the ``pipetune`` section; any
field can be overridden on the command line as with TorchTitan's own configs
(``--pipetune.mode original``, ``--training.steps 50``, ``--checkpoint.enable`` ...).

* ``muse_glimmer_mm``: the debug job (CPU or GPU), what the tests train;
* ``muse_glimmer_heavy_vit``: a trained ViT that costs more than its backbone (layouts matter);
* ``muse_glimmer_mm_gpu``: a template for GPU jobs (NCCL, bf16, PP 4);
* ``muse_glimmer_mm_testbed``, ``muse_glimmer_heavy_vit_testbed``: the same jobs on the 2-core CPU
  testbed (``torchtitan_patches/testbed``), which the main job and the benchmarks run;
* ``muse_glimmer_mm_stock``: the debug job on TorchTitan's stock pipeline (``StockTrainer``), the
  baseline pipetune is measured against;
* ``qwen3_5_debug``: TorchTitan's Qwen3.5 ``debugmodel`` (with a small vocabulary), CPU or GPU.
"""

from __future__ import annotations

import dataclasses
import os

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import ParallelismConfig, TrainingConfig

from torchtitan_patches.testbed.trainer import TestbedTrainer
from torchtitan_patches.settings import PipeTuneSettings
from torchtitan_patches.stock_trainer import StockTrainer
from torchtitan_patches.titan.fixed_shape_loader import FixedShapeDataLoader
from torchtitan_patches.titan.dataloader import PipeTuneTitanDataLoader
from torchtitan_patches.models.muse_glimmer.spec import muse_glimmer_spec
from torchtitan_patches.models.qwen3_5.spec import qwen3_5_spec
from torchtitan_patches.titan.tokenizer import ByteTokenizer
from torchtitan_patches.trainer import PipeTuneTrainer


def muse_glimmer_mm() -> PipeTuneTrainer.Config:
    """TorchTitan's Muse Glimmer ``debugmodel_mm`` (8 layers of width 256, a 3-layer ViT of
    width 64 with 2x2 token merge; ~8 M parameters) on 2 pipeline stages; trains on CPU
    (document-masked attention, see ``torchtitan_patches.models.model_spec``) or GPU. Data: real
    image files and text in TorchTitan's formats through a HuggingFace tokenizer with vision
    tokens, images at their own resolution within TorchTitan's pixel budget for this model
    (``python -m profiling.prepare_job --config muse_glimmer_mm --out out/titan`` writes them)."""
    spec = muse_glimmer_spec("debugmodel_mm")
    return PipeTuneTrainer.Config(
        model_spec=spec,
        hf_assets_path="out/titan/fixture/tokenizer",
        tokenizer=HuggingFaceTokenizer.Config(),
        loss=CrossEntropyLoss.Config(global_vocab_size=spec.model.vocab_size),
        dataloader=PipeTuneTitanDataLoader.Config(dataset_path="out/titan/fixture/data", gbs=16, num_workers=0),  # 2 CPU cores: the ranks take both
        metrics=MetricsProcessor.Config(log_freq=1),
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=2, seq_len=1024, steps=10, disable_cuda_graphs=True, mixed_precision_param="float32"),
        parallelism=ParallelismConfig(spmd_backend="spmd_types", pipeline_parallel_degree=2, pipeline_parallel_schedule="1F1B"),
        checkpoint=CheckpointManager.Config(interval=5, last_save_model_only=False),
        activation_checkpoint=None,
        pipetune=PipeTuneSettings.Config(latency_table="out/titan/table.json"),
    )


def _on_generated_mix(spec, data: str) -> PipeTuneTrainer.Config:
    """``muse_glimmer_mm``'s job for another model spec on a generated mix (synthetic token ids:
    pipetune's byte tokenizer's special ids)."""
    config = muse_glimmer_mm()
    config.model_spec = spec
    config.loss = CrossEntropyLoss.Config(global_vocab_size=spec.model.vocab_size)
    config.tokenizer, config.hf_assets_path = ByteTokenizer.Config(), ""
    config.dataloader.dataset_path = data
    return config


def qwen3_5_debug() -> PipeTuneTrainer.Config:
    """TorchTitan's Qwen3.5 ``debugmodel`` (8 layers of width 256: 6 Gated DeltaNet, 2 gated full
    attention; a 4-block ViT of width 256, 2 x 2 merger) with a 2048-token vocabulary
    (``debugmodel_small_vocab``, 10 M parameters) on 2 pipeline stages, the ViT frozen and its
    merger trained, images of 4 x 4 patches (64 x 64 pixels, 4 tokens). Co-located layouts only
    (``torchtitan_patches.models.qwen3_5``). Data and table: ``python -m profiling.prepare_job --config qwen3_5_debug
    --mix datamix2 --out out/titan_qwen``."""
    config = _on_generated_mix(qwen3_5_spec("debugmodel_small_vocab"), "out/titan_qwen/data")
    config.pipetune = PipeTuneSettings.Config(latency_table="out/titan_qwen/table.json", layout="even")
    return config


def muse_glimmer_heavy_vit() -> PipeTuneTrainer.Config:
    """A Muse Glimmer whose trained vision encoder costs more than its backbone (``heavy_vit`` in
    ``torchtitan_patches.models.model_spec``: ViT 10 x 192 over 8 x 8 patches per image, backbone
    8 x 128) on 2 pipeline stages: the setting where the stage layout matters, since stage 0 of a
    co-located layout runs the whole encoder. Data: DataMix3 (``python -m profiling.prepare_job
    --config muse_glimmer_heavy_vit --mix datamix3 --out out/titan_heavy``). GBS 12 at seq_len 512
    keeps a step near one second on two CPU cores."""
    config = _on_generated_mix(muse_glimmer_spec("heavy_vit"), "out/titan_heavy/data")
    config.dataloader.gbs = 12
    config.training.seq_len = 512
    config.pipetune = PipeTuneSettings.Config(latency_table="out/titan_heavy/table.json", image_grid=8, freeze_vision_encoder=False)
    return config


def muse_glimmer_mm_gpu() -> PipeTuneTrainer.Config:
    """A template for a GPU job: 4 pipeline stages (one GPU each, NCCL, TorchTitan's default on
    CUDA), bf16 compute (``training.mixed_precision_param``), the layout searched on the job's data
    (``auto``). Give it your data set and a latency table profiled on your GPUs:

        python -m profiling.prepare_job --config muse_glimmer_mm_gpu --device cuda --no-data --out tables/h100
        torchrun --nproc-per-node 4 -m torchtitan.train --module pipetune_configs --config muse_glimmer_mm_gpu \\
            --dataloader.dataset_path /data/my_mix --pipetune.latency_table tables/h100/table.json

    Swap in your model's spec, batch size and optimizer as in any TorchTitan config. Not yet run on
    GPUs (only ``scripts/gpu_check.sh`` has, on one GPU). Give it your tokenizer's directory too
    (``--hf_assets_path``: a HuggingFace tokenizer with vision start / end and image tokens).
    Micro-batch shapes change every step, so
    the CUDA allocator grows expandable segments rather than caching one block per shape (unless
    ``PYTORCH_CUDA_ALLOC_CONF`` says otherwise)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    config = muse_glimmer_mm()
    config.parallelism.pipeline_parallel_degree = 4
    config.training.mixed_precision_param = "bfloat16"
    config.dataloader.gbs = 128
    config.dataloader.num_workers = 4
    config.training.steps = 1000
    config.metrics.log_freq = 10
    config.checkpoint.interval = 500
    config.pipetune = PipeTuneSettings.Config(latency_table="tables/h100/table.json", layout="auto", memory_gib=60.0)
    return config


def muse_glimmer_mm_stock() -> StockTrainer.Config:
    """``muse_glimmer_mm`` as TorchTitan's stock pipeline trains it (``StockTrainer``): its own
    split and 1F1B schedule over micro-batches of one row of ``training.seq_len`` tokens, the
    same data stream, model, optimizer and seed, ``rows_per_step`` rows per step (set it and
    ``training.local_batch_size`` together: ``benchmarks/vs_torchtitan.py`` streams as many rows as
    the global batches pack into on average, and with ``--dataloader.pad_steps`` one batch per step
    in as many rows as the longest batch packs into). The baseline of the comparison with pipetune."""
    base = muse_glimmer_mm()
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.name != "pipetune"}
    fields["dataloader"] = FixedShapeDataLoader.Config(dataset_path=base.dataloader.dataset_path, gbs=base.dataloader.gbs, rows_per_step=8,
                                                       num_workers=base.dataloader.num_workers)
    fields["training"] = dataclasses.replace(base.training, local_batch_size=8)
    return StockTrainer.Config(**fields, freeze_vision_encoder=base.pipetune.freeze_vision_encoder, image_grid=base.pipetune.image_grid)


def _testbed(config: PipeTuneTrainer.Config) -> TestbedTrainer.Config:
    return TestbedTrainer.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})


def muse_glimmer_mm_testbed() -> TestbedTrainer.Config:
    """``muse_glimmer_mm`` on the 2-core CPU testbed (heap reserve, contention and per-call
    overhead measured on twins; ``torchtitan_patches/testbed``)."""
    return _testbed(muse_glimmer_mm())


def muse_glimmer_heavy_vit_testbed() -> TestbedTrainer.Config:
    """``muse_glimmer_heavy_vit`` on the 2-core CPU testbed."""
    return _testbed(muse_glimmer_heavy_vit())
