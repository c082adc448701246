"""``PipeTuneTrainer``: TorchTitan's ``Trainer`` whose pipeline runs pipetune's per-step plans.

What stays TorchTitan's: config parsing (``--module pipetune_configs --config ...``), distributed set-up,
the model (built on meta from the job's ``ModelSpec``, split by its ``pipelining_fn``, each part
through its ``parallelize_fn``, weights by ``init_weights``), the loss (``sum / label tokens``),
gradient clipping, optimizer, LR schedule, checkpointing (DCP through ``CheckpointManager``),
metrics and logging. What is overridden, and why:

* ``train_step``: the stock step pulls a fixed number of equal micro-batches and calls a torch
  ``PipelineSchedule``, whose shapes are inferred once; pipetune's steps have their own
  micro-batch count, lengths, order and encoder placement, so the step runs the plan through
  ``PlanExecutor`` (order-safe on NCCL) on the parts TorchTitan built. The torch schedule that
  ``pipelining_fn`` also returns is not used (nor TorchTitan 0.3.0's ``schedule.step(arg_mbs=)``,
  which torch 2.13 lacks).
* ``batch_generator``: the dataloader yields one ``GlobalBatch`` per step.
* Checkpoints gain each lead's learning (calibration window and anchors, per-mbs correction,
  guard), by replica in one entry (``titan.checkpoint_entries``), so a resumed job, of this degree
  or another, plans as the uninterrupted one would (where the table and layout are the same;
  otherwise it is reset).
* ``train``: a failure on any rank stops every rank, naming the lost rank (``runtime.job_stop``).

A step: each data-parallel replica's lead rank (pipeline stage 0, TP rank 0; rank 0 with one
replica) has a ``PlanSource`` that gives its replica's plan of the batch (replayed, calibration
cycle, the planner planning ``plan_ahead`` batches ahead in its own process, the guard's
baseline, or the planner's fallback when that process fails) and sends it to the replica's ranks
(``runtime.plan_channel``); every rank runs its replica's plan on its pipeline (``runs``: one
run; a subclass may add measurement runs); the lead learns from its replica's run
(``pipetune.serve.learner``: online refit, per-mbs correction, guard), and rank 0 appends one
``StepRecord`` per replica to ``<dump_folder>/pipetune/steps.jsonl``.

Data parallelism (FSDP, or HSDP with a replicate degree; ``runtime.data_parallel``): every lead
splits the global batch over the replicas (``pipetune.plan.data_parallel.dp_balance``: deterministic, priced by
the profiled table, so every lead gets the same split; the leads check that their plans
partition the batch) and plans its own share, in parallel with the others
(``runtime.replica_groups``); every replica runs its own plan on its pipeline (TorchTitan's ``pp``
mesh), FSDP gathers and reduces once per step, and the loss is normalised by the global batch's
label tokens. Times are taken per rank from its own step start, so ranks on other nodes need no
common clock.

Tensor parallelism is the model's own TP plan on each stage: every TP rank of a replica runs the
same plan on its own pipeline (TorchTitan's ``pp`` mesh at its TP coordinate); with sequence
parallelism micro-batches are padded to a multiple of the TP degree and each pipeline carries its
share of the sequence. Gradients of parameters every TP rank holds whole are summed over TP
(``runtime.tensor_parallel``) and the clipping norm is the whole model's (``runtime.grad_norm``).

Schedules: TorchTitan's ``1F1B`` (and ``GPipe``) give one backbone chunk per rank;
``Interleaved1F1B`` gives ``V`` chunks per rank (TorchTitan's stages per rank, ``V x P`` parts from
its ``pipelining_fn`` split, chunk ``c`` on rank ``c mod P``), whose parts the executor runs as
chunks of one plan; ``InterleavedZeroBubble`` the same with every backbone backward split into
input and weight gradients (``pipetune.split_backward``: off, on, or auto, chosen per iteration).

Virtual stages and split backward run beside data and tensor parallelism as they run alone:
FSDP gathers and reduces every part of the rank once per step (``FsdpStep``), and TP's own
backward collectives run inside the ``I`` actions of both TP ranks alike. So does DIP's separated
layout: every rank's encoder chunks are TP- and FSDP-sharded as stage 0's are
(``titan.model_parts.for_pipetune``), and ``FsdpStep`` gathers and reduces them whether or not
its replica's share has images.

Limits: no context parallelism (``titan.job_checks`` refuses it and the rest at config time).
Compute in ``training.mixed_precision_param`` (with FSDP its mixed-precision policy casts the
weights, without it float32 weights under autocast, whose per-forward weight copies the planner
counts: ``titan.job_checks.with_job_weights``). The executor has run on one GPU
(``benchmarks/gpu_check.py``); this trainer has not yet run on GPUs.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from pipetune.serve.learner import Learned, Learner
from pipetune.cost import CostModel, load_latency_table
from pipetune.packing import FlopsModel
from pipetune.plan import Mode
from pipetune.plan.layout.planner_config import PlannerConfig
from pipetune.serve.async_planner import AsyncPlanner
from pipetune.plan.layout.compare import best_static_planner
from pipetune.plan.data_parallel.dp_balance import ShareCost
from pipetune.serve.guard import GuardState
from pipetune.plan.plan import IterationPlan
from pipetune.serve.plan_source import PlanSource, load_replay
from pipetune.plan.data_parallel.replicas import ReplicaShare, SharePlanner
from pipetune.records import StepKind, StepRecord
from pipetune.simulate import TimedAction
from torchtitan_patches.data.micro_batch import GlobalBatch
from torchtitan_patches.runtime.data_parallel import FsdpStep
from torchtitan_patches.runtime.executor import ImageShapes, PlanExecutor, StepResult
from torchtitan_patches.runtime import job_stop
from torchtitan_patches.runtime.grad_norm import clip_grad_norm_
from torchtitan_patches.runtime.tensor_parallel import TensorParallelGrads
from torchtitan_patches.runtime.plan_channel import PlanChannel
from torchtitan_patches.runtime.replica_groups import ReplicaGroups
from torchtitan_patches.settings import PipeTuneSettings
from torchtitan_patches.compat.cpu_device import use_cpu
from torchtitan_patches.titan.checkpoint_entries import LEARNED_KEY, LearnedState, checked_load
from torchtitan_patches.titan.dataloader import PipeTuneTitanDataLoader
from torchtitan_patches.titan.metrics import StepWork, WorkMetricsProcessor
from torchtitan_patches.titan.job_checks import check_table, refuse_unsupported, with_job_weights
from torchtitan_patches.titan.model_parts import (choose_layout, local_encoder_chunks, master_weights_of, sample_job_batches, schedule_family,
                                                  split_for_layout)
from torchtitan_patches.titan.model_spec import planning_model_config, stage_runtime
from torchtitan_patches.compat.torch_compat import add_missing_torch_apis


@dataclass(frozen=True)
class Run:
    """One execution of a plan in a step: the step's own (``extra=False``), or a run an extension
    adds beside it. Every run starts from the step's weights; the last run's gradients train."""

    batch: GlobalBatch
    plan: IterationPlan
    extra: bool = False


@dataclass(frozen=True)
class Share:
    """What one rank reports of a run (its times are from its own step start)."""

    replica: int
    stage: int
    tp_rank: int
    elapsed_s: float
    loss: float | None
    overhead_s: float
    peak_bytes: float | None
    host_syncs: int | None
    timeline: list[TimedAction]


@dataclass(frozen=True)
class RunOutcome:
    """A run as every rank knows it: the loss over all replicas, the time of the slowest, and the
    records: on a lead its replica's, on rank 0 every replica's."""

    loss: float
    measured_s: float
    records: list[StepRecord]
    work: StepWork


class PipeTuneTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pipetune: PipeTuneSettings.Config = field(default_factory=PipeTuneSettings.Config)

    record_class: ClassVar[type[StepRecord]] = StepRecord

    def __init__(self, config: Config):
        refuse_unsupported(config)
        add_missing_torch_apis()
        use_cpu()
        pt, pp = config.pipetune, config.parallelism.pipeline_parallel_degree
        if pp < 2:
            raise ValueError("PipeTuneTrainer plans pipelines: set parallelism.pipeline_parallel_degree >= 2")
        self.planning_model = planning_model_config(config.model_spec, image_grid=pt.image_grid, encoder_frozen=pt.freeze_vision_encoder)
        self.table = load_latency_table(pt.latency_table, model=self.planning_model, tp=config.parallelism.tensor_parallel_degree)
        check_table(self.table, device_type="cuda" if torch.cuda.is_available() else "cpu", dtype=config.training.mixed_precision_param,
                    where=pt.latency_table)
        self.table = with_job_weights(self.table, master_weights_of(config), where=pt.latency_table)
        self.chunks_per_rank, self.split_backward = schedule_family(config)
        self.layout = choose_layout(config, self.planning_model, self.table, lambda: self._sample(config))
        per = "chunk (chunk c on rank c mod P)" if self.chunks_per_rank > 1 else "stage"
        logger.info(f"pipetune layout ({pt.layout}): backbone layers per {per} {self.layout.layers_per_stage()}; "
                    f"split backward {self.split_backward.value}"
                    + (f"; separated encoder, blocks per chunk {[hi - lo for lo, hi in self.layout.encoder_chunks]}, "
                       f"{self.layout.image_sub_batch} images per sub-microbatch" if self.layout.is_separated else ""))
        split_for_layout(config, self.layout)
        config.metrics = WorkMetricsProcessor.upgrade(config.metrics)
        super().__init__(config)
        if len(self.model_parts) != self.chunks_per_rank:
            raise ValueError(f"PipeTuneTrainer planned {self.chunks_per_rank} backbone chunks per rank; TorchTitan's split gave "
                             f"{len(self.model_parts)} model parts")
        self._build_pipetune(config)

    def _sample(self, config: Config):
        """8 batches of the job's data (the layout search and the guard's baseline are chosen on them)."""
        if getattr(self, "_sampled", None) is None:
            self._sampled = sample_job_batches(config, self.planning_model)
        return self._sampled

    def _build_pipetune(self, config: Config) -> None:
        dims = self.parallel_dims
        self.rank = dist.get_rank()
        self.stage = dims.get_mesh("pp").get_local_rank()
        self.replicas, self.replica = (dims.get_mesh("batch").size(), dims.get_mesh("batch").get_local_rank()) if dims.dp_enabled else (1, 0)
        tp = dims.get_optional_mesh("tp")
        self.tp_rank = tp.get_local_rank() if tp is not None else 0
        timeout = timedelta(seconds=config.comm.init_timeout_seconds)
        self.control = dist.new_group(backend="gloo", timeout=timeout)
        self.groups = ReplicaGroups.build(self.replica, self.stage, self.tp_rank, control=self.control, timeout=timeout)
        self.sequence_shards = dims.tp if dims.tp_enabled and config.parallelism.enable_sequence_parallel else 1
        self.executor = self._build_executor(config.pipetune, dims.pp)
        self.fsdp = FsdpStep(self.model_parts) if dims.dp_enabled else None
        self.tp_grads = TensorParallelGrads(self.model_parts, dims.tp, group=tp.get_group() if tp is not None else None)
        self.profiled = CostModel(self.table, self.layout)
        self.flops = FlopsModel(self.planning_model)
        self.metrics_processor.count_recompute(config.activation_checkpoint)
        self.sizes_run: set[int] = set()  # micro-batch sizes this process has run (a size's first run is cold)
        if not isinstance(self.dataloader, PipeTuneTitanDataLoader):
            raise ValueError(f"PipeTuneTrainer needs dataloader = PipeTuneTitanDataLoader.Config, got {type(self.dataloader).__name__}")
        loader = self.dataloader.bind(self.planning_model, packing_source=None, seq_multiple=self.sequence_shards,
                                      pixels=bool(self.executor.encoder), square_images=self.layout.is_separated)
        if self.rank == 0 and loader.store.skipped:
            row, why = loader.store.skipped[0]
            logger.warning(f"pipetune: left out {len(loader.store.skipped)} samples without text or (dataloader.bad_images=skip) "
                           f"with unreadable images, e.g. row {row}: {why}")
        self.source = self.learner = self.async_planner = None
        error = None
        if self.groups.is_lead:  # each replica's lead plans; a planner one cannot build stops every rank
            try:
                self.learner = self._learner(config.pipetune)
                self.source = self._plan_source(config, loader)
            except ValueError as e:
                error = str(e)
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error, group=self.control)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            raise ValueError(f"pipetune: rank {failed[0][0]} cannot plan this job: {failed[0][1]}")
        self.channel = PlanChannel(self.source, replica=self.replica, replicas=self.replicas, links=self.groups)
        loader.packing_source = self.channel
        self.records_path = Path(config.dump_folder) / "pipetune" / "steps.jsonl"
        if self.checkpointer.enable:
            self.checkpointer.states[LEARNED_KEY] = LearnedState(self._save_learned, self._load_learned)
            self.checkpointer.load = checked_load(self.checkpointer.load, self.checkpointer.folder)

    def _build_executor(self, pt: PipeTuneSettings.Config, pp: int) -> PlanExecutor:
        """This rank's backbone chunks (TorchTitan's parts of stages ``r, r + P, ...``, in that
        order) and encoder chunks (meta-initialised: each rank materialised only its own parts)
        behind a ``PlanExecutor`` on its pipeline (TorchTitan's ``pp`` mesh)."""
        stage, chunks_total = self.stage, pp * self.chunks_per_rank
        parts = dict(zip(range(stage, chunks_total, pp), self.model_parts))
        runtime = stage_runtime(self.config.model_spec)
        for part in parts.values():
            if pt.freeze_vision_encoder and getattr(part, "vision_encoder", None) is not None:
                part.vision_encoder.requires_grad_(False)  # AdamW skips parameters without gradients
                for name in runtime.trained_with_frozen_encoder:
                    getattr(part.vision_encoder, name).requires_grad_(True)
        sizes = [None] * dist.get_world_size()
        dist.all_gather_object(sizes, sum(p.numel() * p.element_size() for part in parts.values() for p in part.parameters()), group=self.control)
        if self.rank == 0:
            logger.info("pipetune: parameter bytes per rank " + ", ".join(f"rank {r} {b / 2**20:.1f} MiB" for r, b in enumerate(sizes)))
        backbone = {c: runtime.stage(part, is_first=c == 0, is_last=c == chunks_total - 1) for c, part in parts.items()}
        enc = self.planning_model.encoder
        if self.layout.is_separated:
            ranges = self.layout.encoder_chunks
            chunks = runtime.encoder_chunks(parts[stage], ranges, local_encoder_chunks(stage, pp, ranges), image_grid=pt.image_grid)
        else:
            chunks = runtime.encoder_chunks(parts[0], [(0, enc.n_layers)], [0], image_grid=pt.image_grid) if enc is not None and 0 in parts else {}
        return PlanExecutor(
            backbone, chunks, dim=self.planning_model.backbone.dim, rank=stage, group=self.parallel_dims.get_mesh("pp").get_group(),
            control_group=self.control, replica=self.replica, sequence_shards=self.sequence_shards, image_shapes=ImageShapes.of(enc) if enc is not None else None,
            device=self.device, strict_order=pt.strict_order, count_host_syncs=pt.count_host_syncs, compute_dtype=TORCH_DTYPE_MAP[self.config.training.mixed_precision_param],
            loss_fn=lambda logits, labels, n: self.loss_fn(logits, labels, n)[0])  # a Python divisor: no upload per micro-batch

    def _learner(self, pt: PipeTuneSettings.Config) -> Learner:
        """A lead's learning from its replica's runs (an extension point: a subclass may measure more)."""
        return pt.learner(self.profiled)

    def _plan_source(self, config: Config, loader) -> PlanSource:
        """A lead's planners: the job's mode, the calibration cycle, and the guard's baseline. Every
        planner predicts the same kind of time (expected under jitter, or deterministic), so the
        per-mbs correction and the guard compare like with like. With data parallelism each plans
        this replica's share of the job's split: the balanced one (``pipetune.plan.data_parallel.dp_balance``,
        priced by the profiled table, which every lead holds alike; mode ``original`` keeps
        TorchTitan's round-robin). The job's planner splits and plans ahead in its own process
        (``AsyncPlanner``), so ``self.planners`` holds the ``AsyncPlanner``, through which model
        updates reach that process."""
        pt, seq, seed = config.pipetune, config.training.seq_len, config.debug.seed or 0
        memory = pt.memory_gib * 2**30

        def planner(mode: Mode, mbs: int | None, max_mbs: int = pt.max_mbs):
            return PlannerConfig(mode=mode, max_seq_len=seq, memory_bytes=memory, max_mbs=max_mbs, mbs=mbs, seed=seed,
                                 jitter_draws=pt.jitter_draws, split_backward=self.split_backward).build(self.planning_model, self.profiled)

        balanced = Mode(pt.mode) is not Mode.ORIGINAL and self.replicas > 1
        share = ReplicaShare(self.replicas, self.replica, ShareCost(self.profiled, packed_tokens=seq) if balanced else None)
        tuned = SharePlanner(planner(Mode(pt.mode), pt.mbs or None), share)
        calibration = [planner(Mode.BALANCED, k) for k in range(1, tuned.max_mbs + 1)] if pt.calibration.steps else []
        baseline = best_static_planner(self.planning_model, self.profiled, self._sample(config), max_seq_len=seq, memory_bytes=memory,
                                       seed=seed, max_mbs=pt.max_mbs, jitter_draws=pt.jitter_draws,
                                       split_backward=self.split_backward) if pt.guarded else None
        if baseline is not None and self.rank == 0:
            fewest = baseline.config.min_micro_batches
            logger.info(f"pipetune guard: baseline = {baseline.config.mode.value} packing at mbs {baseline.fixed_mbs}"
                        + (f", at least {fewest} micro-batches" if fewest > 1 else "")
                        + (", of each replica's share, judged per replica" if self.replicas > 1 else "")
                        + " (best fixed configuration on 8 sampled batches)")
        self.async_planner = AsyncPlanner(tuned, loader.reader, budget_s=pt.budget_s, lookahead=pt.plan_ahead)
        self.planners = [self.async_planner, *calibration, *([baseline] if baseline else [])]
        return PlanSource(self.async_planner, read=loader.reader, share=share, baseline=baseline, calibration=calibration, calibrate_steps=pt.calibration.steps,
                          guard=self.learner.guard, replay=load_replay(pt.replay.path) if pt.replay.path else None)

    def batch_generator(self, data_iterable):
        it = iter(data_iterable)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.metrics_processor.data_loading_times.append(time.perf_counter() - t0)
            if batch.damaged_images:
                logger.warning(f"pipetune: batch {batch.step} holds {batch.damaged_images} damaged images, kept as far as readable "
                               "(dataloader.bad_images=skip)")
            yield batch

    def runs(self, batch: GlobalBatch, plan: IterationPlan) -> list[Run]:
        """The runs of a step, in order (an extension point): here the plan, once."""
        return [Run(batch, plan)]

    def train_step(self, data_iterator):
        lr_metrics = self.lr_schedulers.get_metrics()
        batch = next(data_iterator)
        runs = self.runs(batch, self.channel.pop(batch.step))
        cold = {run.plan.mbs for run in runs} - self.sizes_run
        self.sizes_run |= cold
        self.ntokens_seen += sum(mb.num_tokens for mb in batch.micro_batches)
        outcomes = [self._execute(run, cold=run.plan.mbs in cold) for run in runs]
        own = next(o for o, run in zip(outcomes, runs) if not run.extra)
        if not math.isfinite(own.loss):  # TorchTitan's check, before the optimizer takes the step
            raise RuntimeError(f"Loss is not finite (loss={own.loss}) at step {self.step}. Stopping training.")
        self.metrics_processor.add_work(own.work.scaled(1 / self.replicas))
        grad_norm = self.clip_gradients()
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        if self.metrics_processor.should_log(self.step):
            extra = {"pipetune/measured_s": own.measured_s}
            if self.rank == 0 and own.records:
                slowest = max(own.records, key=lambda r: r.measured_s)
                extra |= {f"pipetune/{k}": getattr(slowest, k) for k in ("mbs", "micro_batches", "precomputed_encoders", "predicted_s")}
                extra["pipetune/baseline_ran"] = float(slowest.kind is StepKind.BASELINE)
            self.metrics_processor.log(self.step, own.loss, own.loss, float(grad_norm.item()), extra_metrics={**extra, **lr_metrics})

    def clip_gradients(self) -> torch.Tensor:
        """Clip by the whole model's gradient norm (``runtime.grad_norm``: right under TP, where
        TorchTitan 0.3.0's ``clip_grad_norm_`` leaves each TP rank its own norm); returns it."""
        return clip_grad_norm_(self.tp_grads.copies, self.config.training.max_norm, device=self.device)

    def _execute(self, run: Run, *, cold: bool) -> "RunOutcome":
        """Run ``run`` from the step's weights (under data parallelism with one FSDP reduction);
        each lead learns from its replica's run, and rank 0 writes every replica's record."""
        self.optimizers.zero_grad()
        with self.train_context(), self.fsdp.step() if self.fsdp is not None else nullcontext():
            res = self.executor.run(run.batch, run.plan)
        self.tp_grads.reduce()
        outcome = self._gather(run, res, cold=cold)
        if self.groups.is_lead:
            self._learn(run, outcome.records)
            outcome = RunOutcome(outcome.loss, outcome.measured_s, self._collect(outcome.records), outcome.work)
        if self.rank == 0:
            for record in outcome.records:
                record.append_to(self.records_path)
            r = max(outcome.records, key=lambda r: r.measured_s)
            fell_back = [x for x in outcome.records if x.fallback]
            logger.info(f"pipetune step {self.step}: {r.kind.value if r.kind else '?'} plan ({run.plan.mode}), "
                        + (f"{self.replicas} replicas, slowest {r.replica}: " if self.replicas > 1 else "")
                        + f"mbs {r.mbs}, {r.micro_batches} micro-batches, {r.precomputed_encoders} encoders "
                        f"pre-computed, predicted {r.predicted_s * 1e3:.1f} ms, measured {r.measured_s * 1e3:.1f} ms"
                        + (f"; guard {r.guard}" if r.guard else ""))
            if fell_back:
                logger.warning(f"pipetune step {self.step}: fallback plans on replica" + ("s " if len(fell_back) > 1 else " ")
                               + "; ".join(f"{x.replica} ({x.fallback_reason or 'no reason given'})" for x in fell_back))
        return outcome

    def _collect(self, records: list[StepRecord]) -> list[StepRecord]:
        """A lead's records of a run, handed to rank 0: there every replica's, by replica; elsewhere its own."""
        if self.groups.leads is None:  # one replica: rank 0 leads it
            return records
        every = [None] * len(self.groups.lead_ranks) if self.rank == 0 else None
        dist.gather_object(records, every, dst=0, group=self.groups.leads)
        return sorted((r for rs in every for r in rs), key=lambda r: r.replica) if self.rank == 0 else records

    def _run_plan(self, run: Run) -> IterationPlan:
        """A lead: the plan its replica ran in ``run`` (an extension's extra run: its one plan)."""
        return run.plan if run.extra else self.source.decided[run.batch.step].plan.plan

    def _gather(self, run: Run, res: StepResult, *, cold: bool) -> "RunOutcome":
        """The run's loss and work (summed over replicas) and time (its slowest replica's) on every
        rank, by two all-reduces; each replica's timings sent to its lead, which makes
        the replica's record, whose timeline is that of the replica's first pipeline (of its
        tensor-parallel ranks, which run the same actions). Times are from each rank's own step
        start (``StepResult``), so clocks of other nodes need not agree."""
        mine = Share(self.replica, self.stage, self.tp_rank, res.elapsed_s, res.loss, res.overhead_s, res.peak_bytes, res.host_syncs, res.timeline)
        work = StepWork.of(self.flops, run.batch.micro_batches) if self.groups.is_lead else StepWork()  # once per replica
        sums = torch.tensor([mine.loss if mine.loss is not None and self.tp_rank == 0 else 0.0, *work.as_list()], dtype=torch.float64)
        measured = torch.tensor([res.elapsed_s], dtype=torch.float64)
        dist.all_reduce(sums, group=self.control)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=self.control)
        loss, total = float(sums[0]), StepWork.from_list(sums[1:].tolist())
        every: list[Share] | None = self.groups.to_lead(mine)
        if every is None:
            return RunOutcome(loss, float(measured.item()), [], total)
        plan = self._run_plan(run)
        ranks = sorted((g for g in every if g.tp_rank == 0), key=lambda g: g.stage)
        timeline = sorted((t for g in ranks for t in g.timeline), key=lambda t: (t.start, t.rank))
        record = self.record_class(
            step=self.step, batch=run.batch.step, mode=plan.mode, mbs=plan.mbs, micro_batches=plan.num_micro_batches,
            order=list(plan.order), samples=[list(mb) for mb in plan.micro_batches],
            precomputed_encoders=sum(t.precomputed for t in timeline), predicted_s=plan.predicted_s,
            measured_s=max(g.elapsed_s for g in every), plan_setup_s=max(g.overhead_s for g in every),
            loss=sum(g.loss for g in ranks if g.loss is not None), fallback=plan.fallback, layout=self.layout.layers_per_stage(),
            separated=self.layout.is_separated, plan=plan.to_json(), cold=cold, replica=self.replica,
            peak_bytes=[g.peak_bytes for g in ranks], predicted_peak_bytes=list(plan.peak_bytes), host_syncs=[g.host_syncs for g in ranks],
            timeline=[[t.rank, str(t.action), t.start, t.end, t.precomputed] for t in timeline], model_flops=work.model_flops,
            real_tokens=work.real_tokens, padding_tokens=work.padding_tokens, **self.run_fields(run))
        return RunOutcome(loss, float(measured.item()), [record], total)

    def run_fields(self, run: Run) -> dict:
        """Record fields that describe how ``run`` ran (an extension point)."""
        return {"extra_run": run.extra}

    def _learn(self, run: Run, records: list[StepRecord]) -> None:
        """A lead, after the step's own run: why its replica's plan ran (the plan source's
        decision) and what the learner takes from it."""
        decided = self.source.pop(run.batch.step)
        for record in records:
            record.kind, record.fallback_reason = decided.kind, decided.fallback_reason
            record.tuned_predicted_s, record.baseline_predicted_s = decided.tuned_predicted_s, decided.baseline_predicted_s
        self._apply(self.learner.observe(records, decided.plan.plans, decided.plan.share))

    def _apply(self, learned: Learned) -> None:
        """A lead: every planner prices with the latest model, the job's planner compares sizes with
        the latest per-mbs factors, and guard transitions are logged."""
        if learned.cost is not None:
            for planner in self.planners:
                planner.set_cost(learned.cost)
        if learned.factors is not None:
            self.planners[0].set_correction(learned.factors)
        if learned.guard is not None:
            before, d = learned.guard
            if d.state is not before:
                say = logger.warning if d.state is GuardState.FALLBACK else logger.info
                say(f"pipetune guard{f' (replica {self.replica})' if self.replicas > 1 else ''}: {before.value} -> {d.state.value} at step {self.step} (pipetune's measured advantage over "
                    f"the baseline, log ratio: {d.advantage:+.3f} +- {d.stderr:.3f})")

    def train(self):
        """TorchTitan's loop; a failure on any rank stops every rank, naming the lost rank and the
        step (``runtime.job_stop``)."""
        stop = job_stop.JobStop(lambda: self.step, grace_s=min(10.0, self.config.comm.train_timeout_seconds))
        try:
            super().train()
        except Exception as e:
            stopped = stop.failed(e)
            if stopped is e:
                raise
            raise stopped from e

    def _learned_on(self) -> dict:
        """What a lead's learning measured: the latency table and the layout (not the data-parallel degree)."""
        return {"table": hashlib.sha256(pickle.dumps(self.table)).hexdigest(), "layout": repr(self.layout),
                "chunks_per_rank": self.chunks_per_rank, "split_backward": self.split_backward.value}

    def _save_learned(self) -> bytes:
        """Every lead's learning by replica, alike on every rank (one all-gather per checkpoint), so
        that a job of another degree can load it."""
        mine = self.learner.state_dict() if self.learner is not None else None
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (self.replica, mine) if self.groups.is_lead else None, group=self.control)
        replicas = [state for _, state in sorted(x for x in every if x is not None)]
        return pickle.dumps({"on": self._learned_on(), "replicas": replicas})

    def _load_learned(self, state: bytes) -> None:
        """Each lead takes its replica's learning, or with fewer replicas saved replica ``r mod
        saved``'s; learning of another table or layout is dropped, with one line."""
        saved, now = pickle.loads(state), self._learned_on()
        if saved["on"] != now:
            if self.rank == 0:
                logger.warning("pipetune: learned state reset (calibration, per-mbs correction, guard): the checkpoint's was learnt on "
                               f"another {', '.join(k for k in now if saved['on'].get(k) != now[k])}")
            return
        taken = self.replica % len(saved["replicas"])
        if self.rank == 0 and len(saved["replicas"]) != self.replicas:
            logger.info(f"pipetune: learned state of {len(saved['replicas'])} replicas carried over to {self.replicas}: replica r takes "
                        f"replica r mod {len(saved['replicas'])}'s")
        if self.learner is not None and saved["replicas"][taken] is not None:
            self._apply(self.learner.load_state_dict(saved["replicas"][taken]))

    def close(self) -> None:
        if getattr(self, "async_planner", None) is not None:
            self.async_planner.close()
        super().close()
