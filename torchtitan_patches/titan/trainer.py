"""``PipeTuneTrainer``: TorchTitan's ``Trainer`` whose pipeline runs pipetune's per-step plans.

What stays TorchTitan's: config parsing (``--module torchtitan_patches.titan --config ...``),
distributed set-up, the model (built on meta from the job's ``ModelSpec``, split by its
``pipelining_fn``, each part through its ``parallelize_fn``, weights by ``init_weights``), the loss
(``sum / label tokens``), gradient clipping, optimizer, LR schedule, checkpointing (DCP through
``CheckpointManager``), metrics and logging. What is overridden, and why:

* ``train_step``: the stock step pulls a fixed number of equal micro-batches and calls a torch
  ``PipelineSchedule``, whose shapes are inferred once; pipetune's steps have their own
  micro-batch count, lengths, order and encoder placement, so the step runs the plan through
  ``PlanExecutor`` (order-safe on NCCL) on the parts TorchTitan built. The torch schedule that
  ``pipelining_fn`` also returns is not used. TorchTitan 0.3.0's ``schedule.step(arg_mbs=...)``,
  which torch 2.13 lacks, is therefore never called.
* ``batch_generator``: the dataloader yields one ``GlobalBatch`` per step (see
  ``titan.dataloader``).
* ``state_dict``: adds the planner's state (calibrated latency table and calibration window),
  so a resumed job plans as the uninterrupted one would.

The stage layout comes from pipetune (``pipetune.layout``: even, explicit, or searched) and is
handed to TorchTitan's splitter as ``parallelism.module_fqns_per_model_part``, so planner and
runtime agree on it. Rank 0 plans ``plan_ahead`` batches ahead in a background thread
(``AsyncPlanner``) and sends plans over a gloo group; per step it writes a record (mode, mbs,
micro-batches, order, pre-computed encoders, predicted and measured pipeline time, loss) to
``<dump_folder>/pipetune/steps.jsonl`` and logs the numbers through the metrics processor.

Limits: pipeline parallelism only (no data, tensor or context parallelism yet: the executor
addresses ranks of the world group), one stage per rank, fp32 or autocast compute without FSDP.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import pickle
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.config import Configurable
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from pipetune.cost import CostModel, StageLayout, load_latency_table
from pipetune.plan import Mode, PlannerConfig
from pipetune.data.storage import open_dataset
from pipetune.plan.async_planner import AsyncPlanner
from pipetune.plan.layout import LayoutSearch, sample_batches
from pipetune.simulate import TimedAction
from torchtitan_patches.pipeline.calibrate import MeasuredStep, OnlineCalibrator
from torchtitan_patches.pipeline.executor import PlanExecutor
from torchtitan_patches.pipeline.plan_channel import PlanChannel
from torchtitan_patches.titan.cpu_device import use_cpu
from torchtitan_patches.titan.dataloader import PipeTuneTitanDataLoader
from torchtitan_patches.titan.model_spec import planning_model_config
from torchtitan_patches.titan.stages import TitanEncoder, TitanStage
from torchtitan_patches.titan.tokenizer import text_encoder
from torchtitan_patches.titan.torch_compat import fill_gaps

VISION_MODULES = ("vision_encoder", "vision_adapter", "vision_projection", "perception_emb_norm")


class PipeTuneSettings(Configurable):
    """Holder of the ``pipetune`` config section (TorchTitan sections are ``Configurable.Config``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        mode: str = "pipetune"
        """Planner mode: original (fixed mbs, arrival order), balanced, reorder or pipetune."""

        latency_table: str = ""
        """Latency table of this device for the model's planning shapes (``pipetune profile``)."""

        layout: str = "even"
        """Backbone layers per stage: ``even``, ``auto`` (searched on sampled batches of the job's
        data with the latency table, under ``memory_gib``) or counts such as ``3,5``."""

        budget_s: float = 2.0
        """Planning time per batch; past it the balanced plan at the last good mbs is used."""

        plan_ahead: int = 2
        """Batches planned ahead of the one being trained."""

        max_mbs: int = 4
        """Largest micro-batch size (samples) the planner may choose."""

        mbs: int = 0
        """Micro-batch size of the fixed-size modes (original, balanced); 0: the largest that fits."""

        memory_gib: float = 16.0
        """Memory per rank the plans must fit."""

        online_window: int = 8
        """Refit the latency table to the last N measured steps after every step (0: off)."""

        image_grid: int = 4
        """Patches per image side (pipetune plans with one image size; a multiple of the merge)."""

        freeze_vision_encoder: bool = True
        """Train without the vision encoder's gradients (PipeTune's setting; lets ``E`` run early
        without keeping its graph)."""

        strict_order: bool = False
        """Give every message one tag, so gloo matches messages by order as NCCL does (a check)."""

        def __post_init__(self) -> None:
            Mode(self.mode)
            for name in ("plan_ahead", "max_mbs", "mbs", "online_window", "image_grid"):
                if getattr(self, name) < 0:
                    raise ValueError(f"pipetune.{name} must be >= 0, got {getattr(self, name)}")
            if self.budget_s <= 0 or self.memory_gib <= 0:
                raise ValueError("pipetune.budget_s and pipetune.memory_gib must be positive")


def layout_fqns(model_spec, layout: StageLayout, parts: list[str]) -> list[list[str]]:
    """TorchTitan module names per pipeline stage for ``layout`` (the vision stack and embeddings
    on stage 0, norm and head on the last stage)."""
    fqns = [[f"layers.{i}" for i in range(lo, hi)] for lo, hi in layout.layer_ranges]
    fqns[0][:0] = [*parts, "tok_embeddings"]
    fqns[-1] += ["norm", "lm_head"]
    return fqns


def _pipeline_only(parallelize_fn):
    """The model's ``parallelize_fn`` without data parallelism: with one replica FSDP shards
    nothing, and its lazy initialisation refuses a submodule (the encoder of an ``E`` action)
    running before the root module."""
    if "skip_dp" not in inspect.signature(parallelize_fn).parameters:
        raise ValueError(f"{parallelize_fn.__qualname__} cannot skip FSDP (no skip_dp argument); PipeTuneTrainer needs that")
    return functools.partial(parallelize_fn, skip_dp=True)


class PipeTuneTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pipetune: PipeTuneSettings.Config = field(default_factory=PipeTuneSettings.Config)

    def __init__(self, config: Config):
        use_cpu()
        fill_gaps()
        pt = config.pipetune
        spec = config.model_spec
        self.planning_model = planning_model_config(spec, image_grid=pt.image_grid, encoder_frozen=pt.freeze_vision_encoder)
        pp = config.parallelism.pipeline_parallel_degree
        if pp < 2:
            raise ValueError("PipeTuneTrainer plans pipelines: set parallelism.pipeline_parallel_degree >= 2")
        self.table = load_latency_table(pt.latency_table, model=self.planning_model, tp=1)
        self.layout = self._choose_layout(config, pp)
        logger.info(f"pipetune layout ({pt.layout}): backbone layers per stage {self.layout.layers_per_stage()}")
        vision = [m for m in VISION_MODULES if getattr(spec.model, m, None) is not None]
        config.parallelism.module_fqns_per_model_part = layout_fqns(spec, self.layout, vision)
        config.model_spec = dataclasses.replace(spec, parallelize_fn=_pipeline_only(spec.parallelize_fn))
        super().__init__(config)
        if self.parallel_dims.world_size != pp:
            raise ValueError(f"PipeTuneTrainer runs pipeline parallelism only: world size {self.parallel_dims.world_size} != PP {pp}")
        if len(self.model_parts) != 1:
            raise ValueError("PipeTuneTrainer runs one pipeline stage per rank (a flat 1F1B-style split)")
        self._build_pipetune(config, pp)

    def _choose_layout(self, config: Config, pp: int) -> StageLayout:
        """``even``, explicit counts, or ``auto``: the layout search on 8 batches sampled from the
        job's data (deterministic, so every rank finds the same layout on its own)."""
        pt, model = config.pipetune, self.planning_model
        n = model.backbone.n_layers
        if pt.layout != "auto":
            return StageLayout.parse(pt.layout, n, pp)
        dl, seq = config.dataloader, config.training.seq_len
        encode = text_encoder(config.tokenizer.build(tokenizer_path=config.hf_assets_path))
        sample = sample_batches(open_dataset(dl.dataset_path, encode=encode).table, model, gbs=dl.gbs, max_seq_len=seq, count=8, seed=dl.seed,
                                overlong=dl.overlong)
        search = LayoutSearch(model, CostModel(self.table, StageLayout.even(n, pp)), sample, max_seq_len=seq,
                              memory_bytes=pt.memory_gib * 2**30, max_mbs=pt.max_mbs, seed=dl.seed)
        return search.search().best.layout

    def _build_pipetune(self, config: Config, pp: int) -> None:
        pt = config.pipetune
        self.rank = dist.get_rank()
        timeout = timedelta(seconds=config.comm.init_timeout_seconds)
        self.control = dist.new_group(backend="gloo", timeout=timeout)
        part = self.model_parts[0]
        if pt.freeze_vision_encoder and getattr(part, "vision_encoder", None) is not None:
            part.vision_encoder.requires_grad_(False)  # AdamW skips parameters without gradients
        stage = TitanStage(part, is_first=self.rank == 0, is_last=self.rank == pp - 1)
        encoder = TitanEncoder(part) if stage.is_first and getattr(part, "vision_encoder", None) is not None else None
        self.executor = PlanExecutor(
            {self.rank: stage}, encoder, dim=self.planning_model.backbone.dim, rank=self.rank, control_group=self.control,
            device=self.device, strict_order=pt.strict_order,
            loss_fn=lambda logits, labels, n: self.loss_fn(logits, labels, torch.tensor(n, device=logits.device))[0])
        self.profiled = CostModel(self.table, self.layout)
        self.cost = self.profiled
        self.calibrator = OnlineCalibrator(self.table, self.layout, pt.online_window) if self.rank == 0 and pt.online_window else None
        if not isinstance(self.dataloader, PipeTuneTitanDataLoader):
            raise ValueError(f"PipeTuneTrainer needs dataloader = PipeTuneTitanDataLoader.Config, got {type(self.dataloader).__name__}")
        loader = self.dataloader.bind(self.planning_model, packing_source=None)
        self.planner = None
        if self.rank == 0:
            planner = PlannerConfig(mode=Mode(pt.mode), max_seq_len=config.training.seq_len, memory_bytes=pt.memory_gib * 2**30,
                                    max_mbs=pt.max_mbs, mbs=pt.mbs or None, seed=config.debug.seed or 0).build(self.planning_model, self.cost)
            self.planner = AsyncPlanner(planner, loader.meta, budget_s=pt.budget_s, lookahead=pt.plan_ahead)
        self.channel = PlanChannel(self.planner.plan if self.planner else None, group=self.control)
        loader.packing_source = self.channel
        self.records_path = Path(config.dump_folder) / "pipetune" / "steps.jsonl"

    def batch_generator(self, data_iterable):
        it = iter(data_iterable)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.metrics_processor.ntokens_since_last_log += sum(mb.num_tokens for mb in batch.micro_batches)
            self.metrics_processor.data_loading_times.append(time.perf_counter() - t0)
            yield batch

    def train_step(self, data_iterator):
        self.optimizers.zero_grad()
        lr_metrics = self.lr_schedulers.get_metrics()
        batch = next(data_iterator)
        plan = self.channel.pop(batch.step)
        self.ntokens_seen += sum(mb.num_tokens for mb in batch.micro_batches)
        with self.train_context():
            res = self.executor.run(batch, plan)
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()], self.config.training.max_norm, foreach=True,
            pp_mesh=self.parallel_dims.get_optional_mesh("pp"), ep_enabled=self.parallel_dims.ep_enabled)
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        record = self._record(batch, plan, res)
        if self.metrics_processor.should_log(self.step):
            extra = {f"pipetune/{k}": record[k] for k in ("mbs", "micro_batches", "precomputed_encoders", "predicted_s", "measured_s")}
            self.metrics_processor.log(self.step, record["loss"], record["loss"], float(grad_norm.item()),
                                       extra_metrics={**extra, **lr_metrics})

    def _record(self, batch, plan, res) -> dict:
        """Gather every rank's timing and loss (gloo), refit the table on rank 0, write the record."""
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (res.start, res.end, res.timeline, res.loss), group=self.control)
        start = min(g[0] for g in every)
        measured = max(g[1] for g in every) - start
        loss = next(g[3] for g in every if g[3] is not None)
        record = {"step": self.step, "batch": batch.step, "mode": self.config.pipetune.mode, "mbs": plan.mbs,
                  "micro_batches": plan.num_micro_batches, "order": list(plan.order),
                  "precomputed_encoders": sum(t.precomputed for g in every for t in g[2]), "predicted_s": plan.predicted_s,
                  "measured_s": measured, "loss": loss, "fallback": plan.fallback,
                  "samples": [list(mb) for mb in plan.micro_batches],
                  "layout": self.layout.layers_per_stage()}
        if self.rank == 0:
            if self.calibrator is not None and self.step > 1:  # the first step pays one-off warm-up costs
                timeline = [TimedAction(t.rank, t.action, t.start - start, t.end - start, t.precomputed) for g in every for t in g[2]]
                meta = self.dataloader.inner.meta(batch.step)
                self.cost, _ = self.calibrator.update(MeasuredStep.from_timelines(self.profiled, [timeline], plan, meta, measured))
                self.planner.planner.set_cost(self.cost)
            self.records_path.parent.mkdir(parents=True, exist_ok=True)
            with self.records_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            logger.info(f"pipetune step {self.step}: mode {record['mode']}, mbs {plan.mbs}, {plan.num_micro_batches} micro-batches, "
                        f"{record['precomputed_encoders']} encoders pre-computed, predicted {plan.predicted_s * 1e3:.1f} ms, "
                        f"measured {measured * 1e3:.1f} ms")
        return record

    def state_dict(self) -> dict:
        state = {"window": list(self.calibrator.steps) if self.calibrator else []}
        return {**super().state_dict(), f"pipetune_rank_{self.rank}": pickle.dumps(state)}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        key = f"pipetune_rank_{self.rank}"
        if key not in state_dict:
            raise ValueError(f"the checkpoint has no planner state for rank {self.rank} ({key}); it was not written by "
                             "PipeTuneTrainer with this pipeline degree")
        state = pickle.loads(state_dict[key])
        if self.calibrator is not None:
            self.calibrator.steps.extend(state["window"])
            if self.calibrator.steps:
                self.cost, _ = self.calibrator.update(self.calibrator.steps.pop())
                self.planner.planner.set_cost(self.cost)

    def close(self) -> None:
        if getattr(self, "planner", None) is not None:
            self.planner.close()
        super().close()
