"""TorchTitan job configs that train with pipetune's plans.

    torchrun --nproc-per-node 2 -m torchtitan.train --module torchtitan_patches.titan \
        --config pipetune_muse_glimmer_mm --dataloader.dataset_path DATA --pipetune.latency_table TABLE

Every function returns a ``PipeTuneTrainer.Config``: TorchTitan's ``Trainer.Config`` plus the
``pipetune`` section; any field can be overridden on the command line as with TorchTitan's own
configs (``--pipetune.mode original``, ``--training.steps 50``, ``--checkpoint.enable`` ...).
"""

from __future__ import annotations

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import ParallelismConfig, TrainingConfig

from torchtitan_patches.titan.dataloader import PipeTuneTitanDataLoader
from torchtitan_patches.titan.model_spec import muse_glimmer_spec
from torchtitan_patches.titan.tokenizer import ByteTokenizer
from torchtitan_patches.titan.trainer import PipeTuneSettings, PipeTuneTrainer


def pipetune_muse_glimmer_mm() -> PipeTuneTrainer.Config:
    """TorchTitan's Muse Glimmer ``debugmodel_mm`` (8 layers of width 256, a 3-layer ViT of
    width 64 with 2x2 token merge; ~8 M parameters) on 2 pipeline stages, pipetune plans; trains
    on CPU (document-masked attention, see ``titan.model_spec``) or GPU."""
    spec = muse_glimmer_spec("debugmodel_mm")
    return PipeTuneTrainer.Config(
        model_spec=spec,
        hf_assets_path="",
        tokenizer=ByteTokenizer.Config(),
        loss=CrossEntropyLoss.Config(global_vocab_size=spec.model.vocab_size),
        dataloader=PipeTuneTitanDataLoader.Config(dataset_path="out/titan/data", gbs=16),
        metrics=MetricsProcessor.Config(log_freq=1),
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=2, seq_len=1024, steps=10, disable_cuda_graphs=True),
        parallelism=ParallelismConfig(spmd_backend="spmd_types", pipeline_parallel_degree=2, pipeline_parallel_schedule="1F1B"),
        checkpoint=CheckpointManager.Config(interval=5, last_save_model_only=False),
        activation_checkpoint=None,
        pipetune=PipeTuneSettings.Config(latency_table="out/titan/table.json"),
    )


def original_muse_glimmer_mm() -> PipeTuneTrainer.Config:
    """The same job with the ``original`` plan: fixed micro-batch size, samples in arrival order,
    no encoder pre-computation (PipeTune's baseline), run by the same executor."""
    config = pipetune_muse_glimmer_mm()
    config.pipetune.mode = "original"
    return config


def pipetune_muse_glimmer_heavy_vit() -> PipeTuneTrainer.Config:
    """A Muse Glimmer whose trained vision encoder costs more than its backbone (``heavy_vit`` in
    ``titan.model_spec``: ViT 10 x 192 over 8 x 8 patches per image, backbone 8 x 128), on 2
    pipeline stages: the setting where the stage layout matters, since stage 0 of a co-located
    layout runs the whole encoder (``benchmarks/layout_real.py`` trains it with the even, the
    searched and the separated layout).

    Data: DataMix3 (``python -m profiling.prepare_job --config
    pipetune_muse_glimmer_heavy_vit --mix datamix3 --out out/titan_heavy``). GBS 12 at seq_len 512
    (about 5 packed sequences per step) keeps a step near one second on two CPU cores. Trains on
    CPU: the backbone's attention is pipetune's per-document SDPA (``titan.document_attention.
    DocumentAttention``), the ViT's is SDPA under dense per-image masks (``VisionMaskAttention``)."""
    config = pipetune_muse_glimmer_mm()
    spec = muse_glimmer_spec("heavy_vit")
    config.model_spec = spec
    config.loss = CrossEntropyLoss.Config(global_vocab_size=spec.model.vocab_size)
    config.dataloader.dataset_path = "out/titan_heavy/data"
    config.dataloader.gbs = 12
    config.training.seq_len = 512
    config.pipetune = PipeTuneSettings.Config(latency_table="out/titan_heavy/table.json", image_grid=8, freeze_vision_encoder=False)
    return config
