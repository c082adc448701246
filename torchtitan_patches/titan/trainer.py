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
  which torch 2.13 lacks, is therefore never called. Replaying several jobs' records side by side
  (``pipetune.replay a,b``), a step runs each job's plan of its batch, only the last run's
  gradients kept; a calibration step runs its plan pipelined and serially likewise, and at the
  smallest size also the batch at the largest size serially (``calibrate_serial``: the pairs that
  measure contention and per-call overhead), and so does every ``tuned_twin_every``-th later step
  with its pipetune plan (the pairs kappa is then measured on).
* ``batch_generator``: the dataloader yields one ``GlobalBatch`` per step (see
  ``titan.dataloader``).
* ``state_dict``: adds the planner's state (calibration window and runs, per-mbs correction,
  guard), so a resumed job plans as the uninterrupted one would.

The stage layout comes from pipetune (``pipetune.layout``: even, explicit, or searched) and is
handed to TorchTitan's splitter as ``parallelism.module_fqns_per_model_part``, so planner and
runtime agree on it. Rank 0 decides every step's plan (``titan.plan_source``: replayed,
calibration cycle, the job's planner planning ``plan_ahead`` batches ahead in a background
thread, or the guard's baseline) and sends plans over a gloo group. After each step rank 0 refits
the latency table to the last ``online_window`` steps' action times, updates the per-mbs
correction the planner compares sizes with (``pipetune.cost.correction``) and the measured guard
(``pipetune.plan.guard``: pipetune's plans run only while measured faster than the best fixed
configuration). Per step it writes a record to ``<dump_folder>/pipetune/steps.jsonl`` (mode, kind
of plan and guard state, mbs, micro-batches, order, pre-computed encoders, predicted and measured
pipeline time, the plan's set-up time on the slowest rank, both plans' predictions, loss, layout,
whether it was its size's first step (``cold``), the plan itself and every rank's action
timeline) and logs the numbers through the metrics processor.

Limits: pipeline parallelism only (no data, tensor or context parallelism yet: the executor
addresses ranks of the world group), one stage per rank, fp32 compute (TorchTitan 0.3.0 applies
mixed precision through FSDP, which this trainer does not use yet; the executor itself runs bf16
autocast, see ``PlanExecutor``).
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

from pipetune.config.model import ModelConfig
from pipetune.cost import CostModel, LatencyTable, StageLayout, load_latency_table
from pipetune.cost.correction import FamilyCorrection
from pipetune.data.batch import BatchMeta
from pipetune.data.storage import open_dataset
from pipetune.plan import Mode, PlannerConfig
from pipetune.plan.async_planner import AsyncPlanner
from pipetune.plan.compare import best_static_planner
from pipetune.plan.guard import Guard, GuardConfig, GuardState, PlanKind
from pipetune.plan.layout_search import LayoutSearch, sample_batches
from pipetune.plan.plan import IterationPlan
from pipetune.schedule.table import Placement
from pipetune.simulate import TimedAction
from torchtitan_patches.compat.cpu_device import use_cpu
from torchtitan_patches.compat.torch_compat import add_missing_torch_apis as fill_gaps
from torchtitan_patches.data.micro_batch import GlobalBatch
from torchtitan_patches.pipeline.calibrate import MeasuredStep, OnlineCalibrator
from torchtitan_patches.runtime.executor import ImageShapes, PlanExecutor
from torchtitan_patches.runtime.plan_channel import PlanChannel
from torchtitan_patches.titan.dataloader import PipeTuneTitanDataLoader
from torchtitan_patches.titan.model_spec import planning_model_config
from torchtitan_patches.titan.plan_source import PlanSource, StepKind, load_replays
from torchtitan_patches.titan.stages import TitanStage, encoder_chunks, keep_encoder_chunks
from torchtitan_patches.titan.tokenizer import text_encoder

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
        """Backbone layers per stage: ``even`` or counts such as ``3,5``; ``separated``: DIP's layout,
        the vision encoder in chunks on every rank and images in fixed-size sub-microbatches (chosen
        by the partitioner); ``auto``: the faster of the best co-located split and ``separated``,
        predicted on sampled batches of the job's data with the latency table, under ``memory_gib``."""

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

        cpu_heap_reserve_gib: float = 1.5
        """On CPU: heap each rank touches before training and keeps, so that steps do not pay page
        faults while the heap grows to the job's peak (``torchtitan_patches.cpu_allocator``: those
        follow the run's history, not the plan, and would mislead the online calibration). Size it
        to the ranks' peak memory, which TorchTitan's memory monitor logs (peak resident memory on
        CPU); it stays resident. 0: off. No effect on GPUs."""

        online_window: int = 8
        """Refit the latency table to the last N measured steps after every step (0: off)."""

        image_grid: int = 4
        """Patches per image side (pipetune plans with one image size; a multiple of the merge)."""

        freeze_vision_encoder: bool = True
        """Train without the vision encoder's gradients (PipeTune's setting; lets ``E`` run early
        without keeping its graph)."""

        strict_order: bool = False
        """Give every message one tag, so gloo matches messages by order as NCCL does (a check)."""

        calibrate_steps: int = 0
        """The first N steps train with balanced plans cycling through every micro-batch size, so
        the online calibration has measured each size before the planner compares them. Their runs
        stay in every later fit beside the window (``OnlineCalibrator``), except each size's first
        step, which pays one-off costs."""

        calibrate_serial: bool = True
        """Calibration steps of more than one micro-batch also run their plan serially (no two
        ranks computing at once) beside the pipelined run, and the online calibration measures the
        contention kappa on those pairs' ratios of iteration times and holds it (``OnlineCalibrator``,
        ``twin_contention``). Those of the smallest size also run the batch at the largest size
        serially, and the calibration measures the per-call overhead on the (serial, larger)
        pairs (``size_overhead``). Costs one serial run per such step and one more per
        ``max_mbs`` calibration steps. Co-located layouts only (a separated plan's serial twin is
        not defined, so there the window fits kappa and the overhead with everything else)."""

        tuned_twin_every: int = 0
        """pipetune mode, after the calibration steps: every Nth step whose plan is the planner's
        also runs it serially (a tuned twin), and the online calibration measures kappa on the
        recent tuned twins once it has a few (``OnlineCalibrator``): contention priced on the plans
        being priced, not only on the calibration's. Costs one serial run (about 1.2 pipelined steps
        on 2 CPU ranks) per N steps; worth it where ranks contend for a shared CPU (beside other
        jobs), where kappa differs between plan families. 0: off. Co-located layouts only, like
        ``calibrate_serial``."""

        guard: bool = True
        """pipetune mode: fall back to the best fixed configuration while pipetune's plans are
        measured slower than it (``pipetune.plan.guard``; probes the baseline every
        ``guard_probe_every`` steps)."""

        guard_probe_every: int = 16
        """Steps between baseline probes of the guard (one probe step runs the baseline plan)."""

        guard_window: int = 8
        """Tuned steps the guard judges on (it decides once it has ``min(4, guard_window)``)."""

        jitter_draws: int = 0
        """Score plans by their expected time over this many draws of per-action jitter (0: the
        deterministic simulation; else >= 2). Needs ``online_window``: the spread is fitted online
        from the measured action times (``pipetune.cost.variability``)."""

        replay: list[str] = field(default_factory=list)
        """Run the plans recorded in earlier jobs' ``pipetune/steps.jsonl`` instead of planning (same
        data set, batch size, seed and sequence length; each plan is checked against its batch). With
        several files (``a,b,c``, recording the same batches), every step runs each file's plan of its
        batch back to back, the file that runs first rotating with the step, and keeps the last run's
        gradients (every plan of a batch gives the same gradients); one record per run, ``replay_of``
        naming the file. Plans so timed seconds apart are compared without the drift of the
        machine's speed between jobs."""

        def __post_init__(self) -> None:
            Mode(self.mode)
            for name in ("plan_ahead", "max_mbs", "mbs", "online_window", "image_grid", "calibrate_steps", "tuned_twin_every"):
                if getattr(self, name) < 0:
                    raise ValueError(f"pipetune.{name} must be >= 0, got {getattr(self, name)}")
            if self.budget_s <= 0 or self.memory_gib <= 0:
                raise ValueError("pipetune.budget_s and pipetune.memory_gib must be positive")
            if self.cpu_heap_reserve_gib < 0:
                raise ValueError(f"pipetune.cpu_heap_reserve_gib must be >= 0, got {self.cpu_heap_reserve_gib}")
            if self.jitter_draws == 1 or self.jitter_draws < 0:
                raise ValueError(f"pipetune.jitter_draws must be 0 (deterministic) or >= 2, got {self.jitter_draws}")
            if self.jitter_draws and self.layout == "separated":
                raise ValueError("pipetune.jitter_draws: the separated layout's planner scores deterministic times only; "
                                 "set jitter_draws 0 or a co-located layout")
            if self.guard_probe_every < 2 or self.guard_window < 1:
                raise ValueError(f"pipetune.guard_probe_every must be >= 2 and pipetune.guard_window >= 1, got "
                                 f"{self.guard_probe_every} and {self.guard_window}")


def layout_fqns(layout: StageLayout, parts: list[str], *, separated: bool = False) -> list[list[str]]:
    """TorchTitan module names per pipeline stage for ``layout`` (the vision stack and embeddings
    on stage 0, norm and head on the last stage). ``separated`` (DIP's layout): every stage keeps
    ``vision_encoder``, which ``keep_encoder_chunks`` then cuts to the rank's encoder chunks
    (TorchTitan's splitter keeps or drops only whole top-level modules)."""
    fqns = [[f"layers.{i}" for i in range(lo, hi)] for lo, hi in layout.layer_ranges]
    fqns[0][:0] = [*(p for p in parts if not (separated and p == "vision_encoder")), "tok_embeddings"]
    fqns[-1] += ["norm", "lm_head"]
    return [["vision_encoder", *f] for f in fqns] if separated else fqns


def local_encoder_chunks(rank: int, pp: int, chunk_ranges) -> list[int]:
    """The encoder chunks of DIP's separated layout that ``rank`` of ``pp`` holds."""
    return [k for k, r in enumerate(Placement.separated(pp, len(chunk_ranges), encoder_trained=False).encoder) if r == rank]


def sample_job_batches(config: PipeTuneTrainer.Config, model: ModelConfig) -> list[BatchMeta]:
    """8 batches of the job's data drawn with their own seed (deterministic, so every rank draws
    the same): the layout search and the choice of the guard's baseline are made on them."""
    dl = config.dataloader
    encode = text_encoder(config.tokenizer.build(tokenizer_path=config.hf_assets_path))
    return sample_batches(open_dataset(dl.dataset_path, encode=encode).table, model, gbs=dl.gbs, max_seq_len=config.training.seq_len,
                          count=8, seed=dl.seed, overlong=dl.overlong)


def layout_search(config: PipeTuneTrainer.Config, model: ModelConfig, table: LatencyTable, sample: list[BatchMeta]) -> LayoutSearch:
    """The layout search of a job (``auto``, and the partitioner for ``separated``): its latency
    table, memory and micro-batch limits, on ``sample``."""
    pt, pp = config.pipetune, config.parallelism.pipeline_parallel_degree
    return LayoutSearch(model, CostModel(table, StageLayout.even(model.backbone.n_layers, pp)), sample, max_seq_len=config.training.seq_len,
                        memory_bytes=pt.memory_gib * 2**30, max_mbs=pt.max_mbs, seed=config.dataloader.seed)


def _pipeline_only(parallelize_fn, encoder_chunks=()):
    """The model's ``parallelize_fn`` without data parallelism: with one replica FSDP shards
    nothing, and its lazy initialisation refuses a submodule (the encoder, run by its own actions)
    running before the root module. With ``encoder_chunks`` (DIP's separated layout: the
    encoder's block ranges), each rank's part is first cut to its encoder chunks (still on the
    meta device: TorchTitan materialises the parts after parallelising them)."""
    if "skip_dp" not in inspect.signature(parallelize_fn).parameters:
        raise ValueError(f"{parallelize_fn.__qualname__} cannot skip FSDP (no skip_dp argument); PipeTuneTrainer needs that")
    if not encoder_chunks:
        return functools.partial(parallelize_fn, skip_dp=True)

    def parallelize(model, *, parallel_dims, **kwargs):
        rank = parallel_dims.get_mesh("pp").get_local_rank()
        keep_encoder_chunks(model.vision_encoder, encoder_chunks, local_encoder_chunks(rank, parallel_dims.pp, encoder_chunks))
        if getattr(model, "vision_adapter", None) is not None:
            return parallelize_fn(model, parallel_dims=parallel_dims, skip_dp=True, **kwargs)
        # a part with encoder chunks but no adapter (not stage 0): Muse Glimmer's parallelize_fn
        # asserts that a vision encoder comes with its adapter, so it parallelises the part
        # without its encoder chunks (with no TP, compile or activation checkpointing on them)
        chunks, model.vision_encoder = model.vision_encoder, None
        model = parallelize_fn(model, parallel_dims=parallel_dims, skip_dp=True, **kwargs)
        model.vision_encoder = chunks
        return model

    return parallelize


class PipeTuneTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pipetune: PipeTuneSettings.Config = field(default_factory=PipeTuneSettings.Config)

    def __init__(self, config: Config):
        pt = config.pipetune
        use_cpu(int(pt.cpu_heap_reserve_gib * 2**30))
        fill_gaps()
        spec = config.model_spec
        self.planning_model = planning_model_config(spec, image_grid=pt.image_grid, encoder_frozen=pt.freeze_vision_encoder)
        pp = config.parallelism.pipeline_parallel_degree
        if pp < 2:
            raise ValueError("PipeTuneTrainer plans pipelines: set parallelism.pipeline_parallel_degree >= 2")
        self.table = load_latency_table(pt.latency_table, model=self.planning_model, tp=1)
        self.layout = self._choose_layout(config, pp)
        self.encoder_chunks = self.layout.encoder_chunks if self.layout.is_separated else ()
        logger.info(f"pipetune layout ({pt.layout}): backbone layers per stage {self.layout.layers_per_stage()}"
                    + (f"; separated encoder, blocks per chunk {[hi - lo for lo, hi in self.encoder_chunks]}, "
                       f"{self.layout.image_sub_batch} images per sub-microbatch" if self.encoder_chunks else ""))
        vision = [m for m in VISION_MODULES if getattr(spec.model, m, None) is not None]
        config.parallelism.module_fqns_per_model_part = layout_fqns(self.layout, vision, separated=bool(self.encoder_chunks))
        config.model_spec = dataclasses.replace(spec, parallelize_fn=_pipeline_only(spec.parallelize_fn, self.encoder_chunks))
        super().__init__(config)
        if self.parallel_dims.world_size != pp:
            raise ValueError(f"PipeTuneTrainer runs pipeline parallelism only: world size {self.parallel_dims.world_size} != PP {pp}")
        if len(self.model_parts) != 1:
            raise ValueError("PipeTuneTrainer runs one pipeline stage per rank (a flat 1F1B-style split)")
        self._build_pipetune(config, pp)

    def _sample(self, config: Config) -> list[BatchMeta]:
        if getattr(self, "_sampled", None) is None:
            self._sampled = sample_job_batches(config, self.planning_model)
        return self._sampled

    def _choose_layout(self, config: Config, pp: int) -> StageLayout:
        """``even`` or explicit counts; ``separated``: the partitioner's layout; ``auto``: the faster
        of the best co-located split and the separated layout on the sampled batches."""
        layout = config.pipetune.layout
        if layout not in ("auto", "separated"):
            return StageLayout.parse(layout, self.planning_model.backbone.n_layers, pp)
        search = layout_search(config, self.planning_model, self.table, self._sample(config))
        if layout == "separated":
            return search.partition().layout
        # the separated planner scores deterministic times only, so jitter-aware jobs stay co-located
        return search.search(separated=self.planning_model.encoder is not None and not config.pipetune.jitter_draws).best.layout

    def _build_pipetune(self, config: Config, pp: int) -> None:
        pt = config.pipetune
        self.rank = dist.get_rank()
        timeout = timedelta(seconds=config.comm.init_timeout_seconds)
        self.control = dist.new_group(backend="gloo", timeout=timeout)
        part = self.model_parts[0]
        if pt.freeze_vision_encoder and getattr(part, "vision_encoder", None) is not None:
            part.vision_encoder.requires_grad_(False)  # AdamW skips parameters without gradients
        sizes = [None] * pp
        dist.all_gather_object(sizes, sum(p.numel() * p.element_size() for p in part.parameters()), group=self.control)
        if self.rank == 0:  # each rank materialised only its own stage (meta-device init)
            logger.info("pipetune: parameter bytes per rank " + ", ".join(f"rank {r} {b / 2**20:.1f} MiB" for r, b in enumerate(sizes)))
        stage = TitanStage(part, is_first=self.rank == 0, is_last=self.rank == pp - 1, image_grid=pt.image_grid)
        enc = self.planning_model.encoder
        if self.encoder_chunks:
            chunks = encoder_chunks(part, self.encoder_chunks, local_encoder_chunks(self.rank, pp, self.encoder_chunks), image_grid=pt.image_grid)
        else:
            chunks = encoder_chunks(part, [(0, enc.n_layers)], [0], image_grid=pt.image_grid) if enc is not None and stage.is_first else {}
        self.executor = PlanExecutor(
            {self.rank: stage}, chunks, dim=self.planning_model.backbone.dim, rank=self.rank, control_group=self.control,
            image_shapes=ImageShapes.of(enc) if enc is not None else None, device=self.device, strict_order=pt.strict_order,
            loss_fn=lambda logits, labels, n: self.loss_fn(logits, labels, torch.tensor(n, device=logits.device))[0])
        self.profiled = CostModel(self.table, self.layout)
        self.calibrator = OnlineCalibrator(self.table, self.layout, pt.online_window, jitter_draws=pt.jitter_draws) if self.rank == 0 and pt.online_window else None
        self.sizes_run: set[int] = set()  # micro-batch sizes this process has run (a size's first step is cold)
        if not isinstance(self.dataloader, PipeTuneTitanDataLoader):
            raise ValueError(f"PipeTuneTrainer needs dataloader = PipeTuneTitanDataLoader.Config, got {type(self.dataloader).__name__}")
        loader = self.dataloader.bind(self.planning_model, packing_source=None)
        self.source, error = None, [None]
        if self.rank == 0:  # only rank 0 plans; a planner it cannot build stops every rank, not just rank 0
            try:
                self.source = self._plan_source(config, loader)
            except ValueError as e:
                error = [str(e)]
        dist.broadcast_object_list(error, src=0, group=self.control)
        if error[0] is not None:
            raise ValueError(f"pipetune: rank 0 cannot plan this job: {error[0]}")
        self.channel = PlanChannel(self.source, group=self.control)
        loader.packing_source = self.channel
        self.records_path = Path(config.dump_folder) / "pipetune" / "steps.jsonl"

    def _plan_source(self, config: Config, loader) -> PlanSource:
        """Rank 0's planners: the job's mode, the calibration cycle, and the guard's baseline."""
        pt, seq, seed = config.pipetune, config.training.seq_len, config.debug.seed or 0
        replays = load_replays(pt.replay)
        replay = replays[0] if replays else None
        self.other_replays = replays[1:]
        cost, memory = self.profiled, pt.memory_gib * 2**30
        tuned = PlannerConfig(mode=Mode(pt.mode), max_seq_len=seq, memory_bytes=memory, max_mbs=pt.max_mbs, mbs=pt.mbs or None,
                              seed=seed, jitter_draws=pt.jitter_draws).build(self.planning_model, cost)
        # every planner predicts the same kind of time (expected under jitter, or deterministic), so the
        # per-mbs correction and the guard compare like with like
        calibration = [PlannerConfig(mode=Mode.BALANCED, max_seq_len=seq, memory_bytes=memory, mbs=k, seed=seed,
                                     jitter_draws=pt.jitter_draws).build(self.planning_model, cost)
                       for k in range(1, tuned.max_mbs + 1)] if pt.calibrate_steps else []
        tuning = tuned.config.mode is Mode.PIPETUNE
        guarded = pt.guard and tuning and replay is None
        baseline = best_static_planner(self.planning_model, cost, self._sample(config), max_seq_len=seq, memory_bytes=memory, seed=seed,
                                       max_mbs=pt.max_mbs, jitter_draws=pt.jitter_draws) if guarded else None
        self.planners = [tuned, *calibration, *([baseline] if baseline else [])]
        self.guard = Guard(GuardConfig(probe_every=pt.guard_probe_every, window=pt.guard_window,
                                       min_steps=min(4, pt.guard_window))) if guarded else None
        self.correction = FamilyCorrection() if pt.online_window and tuning else None
        self.async_planner = AsyncPlanner(tuned, loader.meta, budget_s=pt.budget_s, lookahead=pt.plan_ahead)
        if baseline is not None:
            logger.info(f"pipetune guard: baseline = {baseline.config.mode.value} packing at mbs {baseline.fixed_mbs} "
                        "(best fixed configuration on 8 sampled batches)")
        return PlanSource(self.async_planner, baseline=baseline, calibration=calibration, calibrate_steps=pt.calibrate_steps,
                          guard=self.guard, replay=replay)

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
        lr_metrics = self.lr_schedulers.get_metrics()
        batch = next(data_iterator)
        plan = self.channel.pop(batch.step)
        twin = self._serial_twin(batch.step, plan)
        size_twin = self._size_twin(batch.step) if twin else None
        runs = [(batch, plan), *self._replayed_beside(batch.step), *([(batch, twin)] if twin else []), *([size_twin] if size_twin else [])]
        cold = [p.mbs not in self.sizes_run for _, p in runs]
        self.sizes_run.update(p.mbs for _, p in runs)
        self.ntokens_seen += sum(mb.num_tokens for mb in batch.micro_batches)
        first = self._rotation(batch.step) % len(runs)
        replayed = len(self.config.pipetune.replay) > 1
        for k in [*range(first, len(runs)), *range(first)]:
            self.optimizers.zero_grad()  # the last run's gradients are the step's
            with self.train_context():
                res = self.executor.run(*runs[k])
            is_size_twin = size_twin is not None and runs[k] is size_twin
            record = self._record(*runs[k], res, replay_of=k if replayed else None, serial=runs[k][1] is twin or is_size_twin,
                                  size_twin=is_size_twin, cold=cold[k])
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()], self.config.training.max_norm, foreach=True,
            pp_mesh=self.parallel_dims.get_optional_mesh("pp"), ep_enabled=self.parallel_dims.ep_enabled)
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        if self.metrics_processor.should_log(self.step):
            extra = {f"pipetune/{k}": record[k] for k in ("mbs", "micro_batches", "precomputed_encoders", "predicted_s", "measured_s")}
            if self.rank == 0:
                extra["pipetune/baseline_ran"] = float(record["kind"] == StepKind.BASELINE.value)
            self.metrics_processor.log(self.step, record["loss"], record["loss"], float(grad_norm.item()),
                                       extra_metrics={**extra, **lr_metrics})

    def _serial_twin(self, step: int, plan: IterationPlan) -> IterationPlan | None:
        """The serial run of a calibration step's plan (``calibrate_serial``) or of every
        ``tuned_twin_every``-th later step's pipetune plan (the guard's baseline plans are not
        pipetune's); every rank decides alike, on the step and the plan it received."""
        pt = self.config.pipetune
        if pt.replay or not plan.has_serial_twin:
            return None
        if step < pt.calibrate_steps:
            return plan.serialised() if pt.calibrate_serial else None
        tuned = self._tuned_twins_run(step) and plan.mode is Mode.PIPETUNE and (step - pt.calibrate_steps) % pt.tuned_twin_every == 0
        return plan.serialised() if tuned else None

    def _tuned_twins_run(self, step: int) -> bool:
        """Whether ``step`` is past calibration in a job that runs tuned twins (not a replay)."""
        pt = self.config.pipetune
        return bool(pt.tuned_twin_every) and not pt.replay and step >= pt.calibrate_steps

    def _rotation(self, step: int) -> int:
        """Which of a step's runs goes first: the batch step, or where tuned twins run the twin's
        count (they fall on every Nth step, so the step alone would put the same run first each
        time)."""
        pt = self.config.pipetune
        return (step - pt.calibrate_steps) // pt.tuned_twin_every if self._tuned_twins_run(step) else step

    def _size_twin(self, step: int) -> tuple[GlobalBatch, IterationPlan] | None:
        """Batch ``step`` packed and planned at the calibration's largest size on the serial
        schedule, where rank 0's plan source gives one (``PlanSource.size_twin``)."""
        plan = self.source.size_twin(self.dataloader.inner.meta(step)) if self.rank == 0 else None
        sent = self._sent_from_rank0(step, [plan.to_json()] if plan else [])
        return sent[0] if sent else None

    def _replayed_beside(self, step: int) -> list[tuple[GlobalBatch, IterationPlan]]:
        """The plans of batch ``step`` in the second and later ``pipetune.replay`` files with the
        batch packed as each says."""
        if len(self.config.pipetune.replay) < 2:
            return []
        return self._sent_from_rank0(step, [r[step] for r in self.other_replays] if self.rank == 0 else [])

    def _sent_from_rank0(self, step: int, plans: list[str]) -> list[tuple[GlobalBatch, IterationPlan]]:
        """Rank 0's ``plans`` of batch ``step`` (JSON; other ranks pass anything), sent to every
        rank over the control group, each with the batch packed as it says."""
        box = [plans if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        loader = self.dataloader.inner
        meta = loader.meta(step)
        received = [IterationPlan.from_json(js, batch_ids=meta.table.ids) for js in box[0]]
        return [(loader.pack(meta, [list(mb) for mb in p.micro_batches]), p) for p in received]

    def _record(self, batch, plan, res, *, replay_of: int | None = None, serial: bool = False, size_twin: bool = False,
                cold: bool = False) -> dict:
        """Gather every rank's timing and loss (gloo); on rank 0 feed the calibration, correction
        and guard (a run of a later replay file feeds nothing, a serial run, the serial twin, size
        twin or tuned twin, only the calibration's pairs and anchors), and write the record.
        ``cold``: the process's first step at this micro-batch size, whose first run meets its
        tensor shapes first and pays one-off costs (measured before the CPU heap reserve:
        pipelined over serial time 1.01-1.27 where the size's later steps gave 0.69-0.95, or
        0.59-0.73 where the serial run went first; mostly page faults, which
        ``pipetune.cpu_heap_reserve_gib`` now absorbs where it covers the heap), so it feeds
        neither the pairs nor the calibration runs."""
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (res.start, res.end, res.timeline, res.loss, res.overhead_s), group=self.control)
        start = min(g[0] for g in every)
        measured = max(g[1] for g in every) - start
        loss = next(g[3] for g in every if g[3] is not None)
        timeline = [TimedAction(t.rank, t.action, t.start - start, t.end - start, t.precomputed) for g in every for t in g[2]]
        record = {"step": self.step, "batch": batch.step, "mode": plan.mode, "mbs": plan.mbs,
                  "micro_batches": plan.num_micro_batches, "order": list(plan.order),
                  "precomputed_encoders": sum(t.precomputed for t in timeline), "predicted_s": plan.predicted_s,
                  "measured_s": measured, "plan_setup_s": max(g[4] for g in every), "loss": loss, "fallback": plan.fallback, "layout": self.layout.layers_per_stage(),
                  "separated": self.layout.is_separated,
                  "samples": [list(mb) for mb in plan.micro_batches]}
        if replay_of is not None:
            record["replay_of"] = replay_of
        if serial:
            record["serial"] = True
        if size_twin:
            record["size_twin"] = True
        if cold:
            record["cold"] = True
        if self.rank == 0:
            if replay_of:
                record.update(kind=StepKind.REPLAY.value, tuned_predicted_s=plan.predicted_s, baseline_predicted_s=float("nan"))
            elif serial:
                tuned = self._tuned_twins_run(batch.step)  # a tuned twin, not a calibration step's serial run
                record.update(kind=(StepKind.TUNED if tuned else StepKind.CALIBRATION).value, tuned_predicted_s=float("nan"),
                              baseline_predicted_s=float("nan"))
                self._learn_from_serial(batch, plan, timeline, measured, record, cold=cold, size_twin=size_twin, tuned=tuned)
            else:
                self._learn(batch, plan, timeline, measured, record, cold)
            record["plan"] = plan.to_json()
            record["timeline"] = [[t.rank, str(t.action), t.start, t.end, t.precomputed] for t in timeline]
            self.records_path.parent.mkdir(parents=True, exist_ok=True)
            with self.records_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            how = (" serial" if serial else "") + (" size twin" if size_twin else "")
            logger.info(f"pipetune step {self.step}: {record['kind']}{how} plan ({plan.mode}), mbs {plan.mbs}, "
                        f"{plan.num_micro_batches} micro-batches, {record['precomputed_encoders']} encoders pre-computed, predicted "
                        f"{plan.predicted_s * 1e3:.1f} ms, "
                        f"measured {measured * 1e3:.1f} ms" + (f"; guard {record['guard']}" if "guard" in record else ""))
        return record

    def _learn_from_serial(self, batch, plan, timeline, measured: float, record: dict, *, cold: bool, size_twin: bool,
                           tuned: bool) -> None:
        """Rank 0, after a serial twin, size twin or tuned twin (not a size's first step):
        re-measure kappa on the twins and the per-call overhead on the size pairs."""
        if cold or self.calibrator is None:
            return
        fitted = self.calibrator.observe_serial(self._measured_step(batch, plan, timeline, measured), size_twin=size_twin, tuned=tuned)
        record.update(contention=self.calibrator.contention, call_overhead_s=self.calibrator.overhead)
        if fitted is not None:
            self._set_cost(fitted[0])

    def _measured_step(self, batch, plan, timeline, measured: float) -> MeasuredStep:
        return MeasuredStep.from_timelines(self.profiled, [timeline], plan, self.dataloader.inner.meta(batch.step), measured)

    def _set_cost(self, cost) -> None:
        """Every planner of rank 0 prices with the latest calibrated model."""
        for planner in self.planners:
            planner.set_cost(cost)

    def _learn(self, batch, plan, timeline, measured: float, record: dict, cold: bool) -> None:
        """Rank 0, after a step: refit the table (not on the first step, which pays one-off
        warm-up costs), update the per-mbs correction and the guard, and note them in ``record``."""
        step = self.source.pop(batch.step)
        record.update(kind=step.kind.value, tuned_predicted_s=step.tuned_predicted_s, baseline_predicted_s=step.baseline_predicted_s)
        if self.step == 1 or step.kind is StepKind.REPLAY:
            return
        if self.calibrator is not None:
            cost, _ = self.calibrator.update(self._measured_step(batch, plan, timeline, measured),
                                             calibration=step.kind is StepKind.CALIBRATION and not cold)
            record.update(contention=cost.table.contention, call_overhead_s=cost.table.fixed("fwd") + cost.table.fixed("bwd"))
            self._set_cost(cost)
        if self.correction is not None:
            self.correction.observe(plan.mbs, measured, plan.predicted_s)
            self.planners[0].set_correction(self.correction.factors())
        if self.guard is not None and step.kind in (StepKind.TUNED, StepKind.BASELINE):
            kind = PlanKind.TUNED if step.kind is StepKind.TUNED else PlanKind.BASELINE
            before = self.guard.state
            ran_s = step.tuned_predicted_s if kind is PlanKind.TUNED else step.baseline_predicted_s
            d = self.guard.observe(kind, measured, ran_s, step.baseline_predicted_s)
            record.update(guard=d.state.value, guard_advantage=d.advantage)
            if d.state is not before:
                say = logger.warning if d.state is GuardState.FALLBACK else logger.info
                say(f"pipetune guard: {before.value} -> {d.state.value} at step {self.step} (pipetune's measured advantage over "
                    f"the baseline, log ratio: {d.advantage:+.3f} +- {d.stderr:.3f})")

    def state_dict(self) -> dict:
        state = {"calibrator": self.calibrator.state_dict() if self.calibrator else None,
                 "guard": self.guard.state_dict() if getattr(self, "guard", None) else None,
                 "correction": self.correction.state_dict() if getattr(self, "correction", None) else None}
        return {**super().state_dict(), f"pipetune_rank_{self.rank}": pickle.dumps(state)}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        key = f"pipetune_rank_{self.rank}"
        if key not in state_dict:
            raise ValueError(f"the checkpoint has no planner state for rank {self.rank} ({key}); it was not written by "
                             "PipeTuneTrainer with this pipeline degree")
        state = pickle.loads(state_dict[key])
        if self.rank != 0:
            return
        if self.guard is not None and state["guard"] is not None:
            self.guard.load_state_dict(state["guard"])
        if self.correction is not None and state["correction"] is not None:
            self.correction.load_state_dict(state["correction"])
            self.planners[0].set_correction(self.correction.factors())
        saved = state.get("calibrator")  # absent from checkpoints of older pipetune versions: refit from scratch
        fitted = self.calibrator.load_state_dict(saved) if self.calibrator is not None and saved else None
        if fitted is not None:
            self._set_cost(fitted[0])

    def close(self) -> None:
        if getattr(self, "async_planner", None) is not None:
            self.async_planner.close()
        super().close()
