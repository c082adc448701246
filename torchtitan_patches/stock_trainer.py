"""``StockTrainer``: TorchTitan's own trainer and pipeline, runnable here and timed like pipetune's.

The baseline a TorchTitan user runs instead of pipetune: the model's own ``pipelining_fn`` split
(vision stack on stage 0), its ``parallelize_fn`` (FSDP included), torch's schedule from
``parallelism.pipeline_parallel_schedule`` over fixed micro-batches, TorchTitan's ``train_step``.
Nothing of pipetune's planning runs. What is added, and why:

* the version and device shims of ``torchtitan_patches.compat`` (torch 2.13's schedule ``step``,
  ``dist.set_timeout``, the CPU device), without which TorchTitan 0.3.0's pipeline does not run
  on torch 2.13 or on a machine without CUDA;
* ``FixedShapeDataLoader`` bound to the model's planning shapes, so the job reads pipetune's data
  sets, step for step the same samples as a ``PipeTuneTrainer`` job;
* ``freeze_vision_encoder`` (PipeTune's setting, on by default as in ``PipeTuneSettings``), so
  both trainers train the same parameters;
* model FLOPs of real tokens, the vision encoder's included, in TorchTitan's logged throughput,
  tflops and MFU (``titan.metrics``: as ``PipeTuneTrainer`` logs them, so the two compare);
* a record per step on rank 0 (``<dump_folder>/stock/steps.jsonl``: step, pipeline seconds, loss,
  real tokens, model FLOPs, padding tokens), the pipeline time measured as ``PipeTuneTrainer`` measures its own: the pipeline
  step alone (TorchTitan's ``pp_forward_backward_step``), without the optimizer and data loading,
  on the slowest rank.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.trainer import Trainer

from torchtitan_patches.compat.cpu_device import use_cpu
from torchtitan_patches.compat.torch_compat import add_missing_torch_apis
from torchtitan_patches.titan.fixed_shape_loader import FixedShapeDataLoader
from torchtitan_patches.titan.metrics import WorkMetricsProcessor
from torchtitan_patches.models.model_spec import planning_model_config


class StockTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        freeze_vision_encoder: bool = True
        """Train without the vision encoder's gradients (as ``pipetune.freeze_vision_encoder``)."""

        image_grid: int = 4
        """Patches per image side of the data's images (as ``pipetune.image_grid``)."""

    def __init__(self, config: Config):
        add_missing_torch_apis()
        use_cpu()
        if not isinstance(config.dataloader, FixedShapeDataLoader.Config):
            raise ValueError(f"StockTrainer reads pipetune data sets: dataloader = FixedShapeDataLoader.Config, got "
                             f"{type(config.dataloader).__name__}")
        if config.dataloader.rows_per_step != config.training.local_batch_size:
            raise ValueError(f"dataloader.rows_per_step {config.dataloader.rows_per_step} != training.local_batch_size "
                             f"{config.training.local_batch_size}: TorchTitan's step pulls local_batch_size rows, the loader cuts steps of rows_per_step")
        config.metrics = WorkMetricsProcessor.upgrade(config.metrics)
        super().__init__(config)
        encoder = getattr(self.model_parts[0], "vision_encoder", None)
        if config.freeze_vision_encoder and encoder is not None:
            encoder.requires_grad_(False)
        spec = config.model_spec
        model = planning_model_config(spec, image_grid=config.image_grid, encoder_frozen=config.freeze_vision_encoder)
        self.dataloader.bind(model)
        self.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=config.comm.init_timeout_seconds))
        self.metrics_processor.count_recompute(config.activation_checkpoint, self.model_parts, self.control)
        self.records_path = Path(config.dump_folder) / "stock" / "steps.jsonl"
        self.last_work = None  # the work of the step the loader cut last

    def pp_forward_backward_step(self, **kwargs) -> torch.Tensor:
        t0 = time.perf_counter()
        loss = super().pp_forward_backward_step(**kwargs)
        elapsed = time.perf_counter() - t0
        cut = self.dataloader.work  # steps the loader cut since the last call: this step's, once whatever the accumulation
        if cut:
            self.last_work = cut[-1]
            for new in cut:
                self.metrics_processor.add_work(new)
            cut.clear()
        work = self.last_work
        mine = torch.tensor([elapsed, float(loss.sum()) if self.pp_has_last_stage else 0.0], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self.control))]
        dist.all_gather(every, mine, group=self.control)
        if dist.get_rank() == 0:
            self.records_path.parent.mkdir(parents=True, exist_ok=True)
            with self.records_path.open("a") as f:
                f.write(json.dumps({"step": self.step, "pipeline_s": max(float(e[0]) for e in every),
                                    "loss": sum(float(e[1]) for e in every),
                                    "real_tokens": work.real_tokens, "model_flops": work.model_flops,
                                    "padding_tokens": work.padding_tokens}) + "\n")
        return loss
