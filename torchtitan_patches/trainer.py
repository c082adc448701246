"""``PipeTuneTrainer``: TorchTitan's ``Trainer`` whose pipeline runs pipetune's per-step plans.

TorchTitan keeps config parsing, distributed set-up, the model (meta init, ``pipelining_fn``
split, ``parallelize_fn`` per part, ``init_weights``), the loss, the optimizer and LR schedule,
DCP checkpointing, metrics and logging. Overridden, and why:

* ``train_step``: the stock step calls a torch ``PipelineSchedule`` over equal micro-batches whose
  shapes are inferred once; pipetune's steps have their own micro-batch count, lengths, order and
  encoder placement, so each runs its plan through ``PlanExecutor`` (order-safe on NCCL) on the
  parts TorchTitan built. Interleaved schedules give ``V`` parts per rank (chunk ``c`` on rank
  ``c mod P``), run as one plan's chunks; ``InterleavedZeroBubble`` splits every backward.
* ``batch_generator``: one ``GlobalBatch`` per step. ``clip_gradients``: the whole model's norm.
* ``train``: a failure on any rank stops every rank, naming the lost rank (``runtime.job_stop``).
* Checkpoints gain each replica lead's learning, by replica (``titan.checkpoint_entries``).

A step: each data-parallel replica's lead (stage 0, TP rank 0) has a ``PlanSource`` (the planner
planning ``plan_ahead`` batches ahead in its own process, calibration cycle, guard baseline,
replay, fallback) and sends its replica's plan to the replica's ranks (``runtime.plan_channel``);
every rank runs it; the lead learns from the run (``pipetune.serve.learner``) and rank 0 appends
one ``StepRecord`` per replica to ``<dump_folder>/pipetune/steps.jsonl``. With FSDP / HSDP every
lead plans its share of the job's deterministic split and FSDP gathers and reduces once per step
(``runtime.data_parallel``); TP is the model's own plan on each stage. docs/design.md (Trainer,
Scale-out) says how, and what is tested.

Limits: no context parallelism (``titan.job_checks`` refuses it and the rest at config time).
Compute is in ``training.mixed_precision_param`` (FSDP's policy casts the weights; without FSDP,
float32 weights under autocast, whose copies the planner counts). The executor has run on one GPU
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
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from pipetune.cost import CostModel, load_latency_table
from pipetune.packing import FlopsModel
from pipetune.plan import Mode
from pipetune.plan.data_parallel.dp_balance import ShareCost
from pipetune.plan.data_parallel.replicas import ReplicaShare, SharePlanner
from pipetune.plan.layout.compare import best_static_planner
from pipetune.plan.plan import IterationPlan
from pipetune.records import StepKind, StepRecord
from pipetune.serve.async_planner import AsyncPlanner
from pipetune.serve.guard import GuardState
from pipetune.serve.learner import Learned, Learner
from pipetune.serve.plan_source import PlanSource, load_replay
from torchtitan_patches.compat.cpu_device import use_cpu
from torchtitan_patches.compat.torch_compat import add_missing_torch_apis
from torchtitan_patches.data.micro_batch import GlobalBatch
from torchtitan_patches.models.model_spec import planning_model_config
from torchtitan_patches.runtime import job_stop
from torchtitan_patches.runtime.data_parallel import FsdpStep
from torchtitan_patches.runtime.executor import StepResult
from torchtitan_patches.runtime.grad_norm import clip_grad_norm_
from torchtitan_patches.runtime.plan_channel import PlanChannel
from torchtitan_patches.runtime.replica_groups import ReplicaGroups
from torchtitan_patches.runtime.tensor_parallel import TensorParallelGrads
from torchtitan_patches.settings import PipeTuneSettings
from torchtitan_patches.titan.checkpoint_entries import LEARNED_KEY, LearnedState, checked_load
from torchtitan_patches.titan.dataloader import PipeTuneTitanDataLoader
from torchtitan_patches.titan.job_checks import check_table, refuse_unsupported, with_job_weights
from torchtitan_patches.titan.metrics import StepWork, WorkMetricsProcessor
from torchtitan_patches.titan.model_parts import choose_layout, master_weights_of, sample_job_batches, schedule_family, split_for_layout
from torchtitan_patches.titan.run_outcome import Run, RunOutcome, Share, collect_records, log_step, replica_record
from torchtitan_patches.titan.stage_executor import build_executor


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
        self.chunks_per_rank, self.split_backward, _ = schedule_family(config)
        self.layout = choose_layout(config, self.planning_model, self.table, lambda: self._sample(config))
        per = "stage" if self.chunks_per_rank == 1 else f"chunk ({self.layout.style.value}-style placement)"
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
        self.executor = build_executor(self, config.pipetune, self.planning_model, self.layout)
        self.fsdp = FsdpStep(self.model_parts) if dims.dp_enabled else None
        self.tp_grads = TensorParallelGrads(self.model_parts, dims.tp, group=tp.get_group() if tp is not None else None)
        self.profiled = CostModel(self.table, self.layout)
        self.flops = FlopsModel(self.planning_model)
        self.metrics_processor.count_recompute(config.activation_checkpoint, self.model_parts, self.control)
        self.sizes_run: set[int] = set()  # micro-batch sizes this process has run (a size's first run is cold)
        if not isinstance(self.dataloader, PipeTuneTitanDataLoader):
            raise ValueError(f"PipeTuneTrainer needs dataloader = PipeTuneTitanDataLoader.Config, got {type(self.dataloader).__name__}")
        loader = self.dataloader.bind(self.planning_model, packing_source=None, seq_multiple=self.sequence_shards,
                                      pixels=bool(self.executor.encoder), square_images=self.layout.is_separated)
        if self.rank == 0 and loader.store.skipped:
            row, why = loader.store.skipped[0]
            logger.warning(f"pipetune: left out {len(loader.store.skipped)} samples without text or (dataloader.bad_images=skip) "
                           f"with unreadable images, e.g. row {row}: {why}")
        self._build_planning(config, loader)
        self.records_path = Path(config.dump_folder) / "pipetune" / "steps.jsonl"

    def _build_planning(self, config: Config, loader) -> None:
        """Each replica lead's learner and plan source (a lead that cannot build them stops every
        rank), the plan channel, and the checkpoint's learned-state entry."""
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
        if self.checkpointer.enable:
            on = {"table": hashlib.sha256(pickle.dumps(self.table)).hexdigest(), "layout": repr(self.layout),
                  "chunks_per_rank": self.chunks_per_rank, "split_backward": self.split_backward.value}  # not the data-parallel degree
            self.checkpointer.states[LEARNED_KEY] = LearnedState(self.learner, on=on, replica=self.replica, replicas=self.replicas,
                                                                 group=self.control, apply=self._apply)
            self.checkpointer.load = checked_load(self.checkpointer.load, self.checkpointer.folder)

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

        def planner(mode: Mode, mbs: int | None):
            return pt.planner_config(mode, seq_len=seq, seed=seed, split_backward=self.split_backward, mbs=mbs).build(self.planning_model, self.profiled)

        balanced = Mode(pt.mode) is not Mode.ORIGINAL and self.replicas > 1
        share = ReplicaShare(self.replicas, self.replica, ShareCost(self.profiled, packed_tokens=seq) if balanced else None)
        tuned = SharePlanner(planner(Mode(pt.mode), pt.mbs), share)
        calibration = [planner(Mode.BALANCED, k) for k in range(1, tuned.max_mbs + 1)] if pt.calibration.steps else []
        baseline = best_static_planner(self.planning_model, self.profiled, self._sample(config), max_seq_len=seq,
                                       memory_bytes=pt.memory_gib * 2**30, seed=seed, max_mbs=pt.max_mbs, jitter_draws=pt.jitter_draws,
                                       split_backward=self.split_backward, offload=pt.offload) if pt.guarded else None
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
            outcome = RunOutcome(outcome.loss, outcome.measured_s, collect_records(outcome.records, self.groups, self.rank), outcome.work)
        if self.rank == 0:
            for record in outcome.records:
                record.append_to(self.records_path)
            log_step(self.step, outcome.records, run.plan, self.replicas)
        return outcome

    def _run_plan(self, run: Run) -> IterationPlan:
        """A lead: the plan its replica ran in ``run`` (an extension's extra run: its one plan)."""
        return run.plan if run.extra else self.source.decided[run.batch.step].plan.plan

    def _gather(self, run: Run, res: StepResult, *, cold: bool) -> "RunOutcome":
        """The run's loss and work (summed over replicas) and time (its slowest replica's) on every
        rank, by two all-reduces; each replica's shares sent to its lead, which makes the replica's
        record (``titan.run_outcome``)."""
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
        record = replica_record(self.record_class, every, self._run_plan(run), work, step=self.step, batch=run.batch.step, cold=cold,
                                replica=self.replica, layout=self.layout.layers_per_stage(), separated=self.layout.is_separated,
                                **self.run_fields(run))
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

    def close(self) -> None:
        if getattr(self, "async_planner", None) is not None:
            self.async_planner.close()
        super().close()
