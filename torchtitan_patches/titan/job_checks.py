"""TorchTitan settings ``PipeTuneTrainer`` cannot honour, refused before anything is built.

``PipeTuneTrainer`` keeps TorchTitan's config and builds through TorchTitan's ``Trainer``, which
would accept these settings and then either ignore them (pipetune's executor runs its own plans,
not TorchTitan's schedule or micro-batching) or fail deep in set-up. ``refuse_unsupported`` turns
each into a one-line ``ValueError`` that names the setting (as its command-line path) and says what
to set instead; ``check_table`` does the same for a latency table made for another device or dtype.

Refused: pipeline schedules other than 1F1B, GPipe and the ones pipetune runs as virtual stages
(``Interleaved1F1B``, ``InterleavedZeroBubble``, and V-shaped ``ZBVZeroBubble`` and ``DualPipeV``),
and schedule CSV files; virtual stages or split backward with DIP's separated layout (``_families``); a
``training.global_batch_size`` that asks for gradient accumulation;
context parallelism, FSDP resharding after forward, CPU offload; compiling Muse Glimmer's model
(``_muse_glimmer_compile``); TorchTitan's validator; a
micro-batch size or stage split set through TorchTitan's pipeline settings (pipetune chooses both; ``pipeline_parallel_layers_per_stage``
only sets an interleaved schedule's stages per rank, as in TorchTitan); model families whose planning shapes are
not mapped (``PLANNED_MODELS``), and what the Qwen3.5 mapping lacks (``_qwen3_5``).

Limits, plainly: the data-parallel degree is known before ``init_distributed`` only from the config
and torchrun's ``WORLD_SIZE`` (``model_parts.replicas_of``; without it, a shard degree of -1 counts
as one replica). Not checked, because the trainer does
apply them (its cost is then not what the latency table says until the online calibration has
refitted it; the planner's memory model assumes no activation checkpointing, which over-counts
what a checkpointed job holds): ``compile`` (but for Muse Glimmer's model), ``activation_checkpoint``,
quantisation converters, ``training.dtype``.
``training.local_batch_size`` only sizes TorchTitan's unused torch schedule (and its accumulation
arithmetic); the batch is ``dataloader.gbs``. Scale-out limits are in ``_scale_out``.
"""

from __future__ import annotations

import dataclasses

from torchtitan.tools.logging import logger

from pipetune.plan.layout.planner_config import SplitBackward, separated_excluded
from torchtitan_patches.titan.model_parts import INTERLEAVED_SCHEDULES, V_SHAPED_SCHEDULES, dtype_name, replicas_of, schedule_family

__all__ = ["PLANNED_MODELS", "check_table", "refuse_unsupported", "with_job_weights"]

PLANNED_MODELS = ("muse_glimmer", "qwen3_5")
"""``ModelSpec.name`` of the families whose planning shapes ``model_spec.planning_model_config``
maps (its schema checks then refuse flavours it cannot express)."""

SCHEDULES = ("1F1B", "GPipe")
"""The one-stage-per-rank schedules (torch's names, matched case-insensitively as torch does); the
torch schedule TorchTitan builds from them (or from a multi-stage one, ``INTERLEAVED_SCHEDULES``,
``V_SHAPED_SCHEDULES``) is not run, pipetune's plans are."""

LAYOUT_SETTINGS = {
    "module_fqns_per_model_part": None,
    "pipeline_parallel_layers_per_stage": None,
    "pipeline_parallel_first_stage_less_layers": 1,
    "pipeline_parallel_last_stage_less_layers": 1,
}
"""TorchTitan's stage-split settings and their defaults: pipetune overwrites the split from
``pipetune.layout``, so any other value would be ignored."""


def refuse_unsupported(config) -> None:
    """Raise ``ValueError`` for the first setting of ``config`` (a ``PipeTuneTrainer.Config``) that
    the trainer would ignore or fail on later (see module doc). Builds nothing. Call it on the
    job's config as given: ``split_for_layout`` later writes ``module_fqns_per_model_part``, so a
    config a trainer has already consumed is refused."""
    _model(config.model_spec)
    par = config.parallelism
    _schedule(config)
    if par.context_parallel_degree > 1:
        raise ValueError(f"parallelism.context_parallel_degree {par.context_parallel_degree}: PipeTuneTrainer has no context "
                         "parallelism (each rank runs whole sequences): set --parallelism.context_parallel_degree 1")
    if par.pipeline_parallel_microbatch_size != 1:
        raise ValueError(f"parallelism.pipeline_parallel_microbatch_size {par.pipeline_parallel_microbatch_size}: pipetune chooses "
                         "every step's micro-batch size itself: leave it 1 and bound the size with --pipetune.max_mbs "
                         "(or fix it with --pipetune.mbs in the original and balanced modes)")
    for name, default in LAYOUT_SETTINGS.items():
        if name == "pipeline_parallel_layers_per_stage" and par.pipeline_parallel_schedule.lower() in (*INTERLEAVED_SCHEDULES, *V_SHAPED_SCHEDULES):
            continue  # the stages per rank (schedule_family), as TorchTitan reads it; the layers per chunk are pipetune.layout's
        if getattr(par, name) != default:
            raise ValueError(f"parallelism.{name} {getattr(par, name)}: pipetune splits the model by pipetune.layout and would "
                             f"ignore this: leave it at TorchTitan's default ({default}) and choose the split with --pipetune.layout "
                             "(even, counts such as 3,5, auto or separated)")
    _families(config)
    _accumulation(config)
    _scale_out(config)
    _qwen3_5(config)
    _muse_glimmer_compile(config)
    if config.validator.enable:
        raise ValueError("validator.enable: TorchTitan's validation runs the torch pipeline schedule, which PipeTuneTrainer "
                         "builds but never runs: turn it off (--validator.no-enable)")


def _scale_out(config) -> None:
    """What the data- and tensor-parallel runtime does not do (yet): FSDP resharding between
    micro-batches (``FsdpStep`` gathers once per step, so that replicas with different micro-batch
    counts issue the same collectives), CPU offload. DIP's separated layout runs beside both: every
    rank's encoder chunks are TP- and FSDP-sharded (``model_parts.for_pipetune``)."""
    par, training = config.parallelism, config.training
    if par.fsdp_reshard_after_forward != "default":
        raise ValueError(f"parallelism.fsdp_reshard_after_forward {par.fsdp_reshard_after_forward}: pipetune gathers each FSDP "
                         "unit once per step (replicas run different micro-batch counts): leave it default")
    if training.enable_cpu_offload:
        raise ValueError("training.enable_cpu_offload: pipetune's executor keeps the parameters on the device it computes on: "
                         "turn it off (--training.no-enable_cpu_offload)")


def _muse_glimmer_compile(config) -> None:
    """TorchTitan 0.3.0 compiles Muse Glimmer's vision adapter per block (``apply_compile``), but the
    adapter has no ``layers``, so its ``parallelize_muse_glimmer`` stops with an ``AttributeError``
    (stock TorchTitan's trainer too): refused here with the setting named instead."""
    if config.model_spec.name == "muse_glimmer" and config.compile.enable and "model" in config.compile.components:
        raise ValueError("compile.enable with 'model' in compile.components: TorchTitan 0.3.0 cannot compile Muse Glimmer's "
                         "vision adapter (apply_compile needs a block stack named layers; the stock trainer fails too): turn it "
                         "off (--compile.no-enable) or compile the loss only (--compile.components loss)")


def _qwen3_5(config) -> None:
    """What pipetune's Qwen3.5 mapping (``models.qwen3_5``) does not do yet: the separated layout
    (and ``auto``, which may choose it)."""
    if config.model_spec.name != "qwen3_5":
        return
    if config.pipetune.layout in ("separated", "auto"):
        raise ValueError(f"pipetune.layout {config.pipetune.layout}: Qwen3.5 runs with its vision encoder on stage 0 (co-located "
                         "layouts) only: use --pipetune.layout even or layer counts such as 3,5")


def _model(spec) -> None:
    if spec is None:
        raise ValueError("model_spec is not set: the job's config function must give one (e.g. muse_glimmer_spec('debugmodel_mm'))")
    if spec.name not in PLANNED_MODELS:
        raise ValueError(f"model_spec {spec.name}/{spec.flavor}: pipetune maps the planning shapes of {', '.join(PLANNED_MODELS)} "
                         "only: map this family in torchtitan_patches/models/model_spec.py (planning_model_config) or train "
                         "muse_glimmer")


def _schedule(config) -> None:
    par = config.parallelism
    name = par.pipeline_parallel_schedule
    if name.lower() not in {s.lower() for s in SCHEDULES} | set(INTERLEAVED_SCHEDULES) | set(V_SHAPED_SCHEDULES):
        raise ValueError(f"parallelism.pipeline_parallel_schedule {name}: pipetune runs 1F1B, GPipe, Interleaved1F1B, "
                         "InterleavedZeroBubble, ZBVZeroBubble and DualPipeV plans: set --parallelism.pipeline_parallel_schedule 1F1B")
    built = config.training.local_batch_size // par.pipeline_parallel_microbatch_size
    if name.lower() == "dualpipev" and built < 2 * par.pipeline_parallel_degree:
        raise ValueError(f"parallelism.pipeline_parallel_schedule {name}: TorchTitan builds torch's DualPipeV schedule (pipetune runs "
                         f"its own plans instead) over training.local_batch_size {config.training.local_batch_size} micro-batches, "
                         f"and torch refuses fewer than the {2 * par.pipeline_parallel_degree} chunks: set "
                         f"--training.local_batch_size {2 * par.pipeline_parallel_degree} (the batch is still dataloader.gbs)")
    if par.pipeline_parallel_schedule_csv:
        raise ValueError(f"parallelism.pipeline_parallel_schedule_csv {par.pipeline_parallel_schedule_csv}: pipetune plans "
                         "every step's schedule itself and would not run this file: unset it")


def _families(config) -> None:
    """Virtual stages (``V >= 2``) and split backward run on co-located layouts (even, explicit or
    ``auto``, which then searches the co-located split only; the separated planner makes neither),
    with or without data and tensor parallelism."""
    par, pt = config.parallelism, config.pipetune
    name = par.pipeline_parallel_schedule
    if name.lower() in ("interleavedzerobubble", *V_SHAPED_SCHEDULES) and pt.split_backward == SplitBackward.AUTO:
        raise ValueError(f"pipetune.split_backward auto: {name} always splits backwards: use Interleaved1F1B to "
                         "let the planner choose per iteration, or leave pipetune.split_backward off")
    chunks, split, _ = schedule_family(config)
    excluded = separated_excluded(chunks_per_rank=chunks, split_backward=split, offload=pt.offload) if pt.layout == "separated" else []
    if excluded:
        setting = (f"parallelism.pipeline_parallel_schedule {par.pipeline_parallel_schedule}" if chunks > 1
                   else f"pipetune.split_backward {split.value}")
        raise ValueError(f"pipetune.layout separated: {' and '.join(excluded)} ({setting}) run on co-located layouts: use "
                         "--pipetune.layout auto (the searched co-located split), even or layer counts (one per chunk)")


def _accumulation(config) -> None:
    """TorchTitan derives gradient accumulation steps from ``training.global_batch_size``; pipetune
    trains one global batch of ``dataloader.gbs`` samples per optimizer step and never accumulates."""
    training = config.training
    want = training.global_batch_size
    replicas = replicas_of(config)
    if want >= 0 and want != training.local_batch_size * replicas:
        raise ValueError(f"training.global_batch_size {want}: not training.local_batch_size {training.local_batch_size} x "
                         f"{replicas} data-parallel replica(s), so TorchTitan would accumulate gradients, which PipeTuneTrainer "
                         "does not do: set --training.global_batch_size -1 and size the batch with --dataloader.gbs")


def check_table(table, *, device_type: str, dtype: str, where: str) -> None:
    """Refuse ``table`` (a ``LatencyTable`` read from ``where``) unless it was made for
    ``device_type`` ("cpu" or "cuda") in ``dtype`` (the job's ``training.mixed_precision_param``;
    "bfloat16" and "torch.bfloat16" are the same): its latencies would price the wrong machine.

    Analytical tables (``estimate``) are checked like measured ones, by what they state: the GPU
    their hardware preset models, in bf16 (``pipetune.cost.analytical``). A bf16 CUDA job may start
    from one and let the online calibration fit it; a CPU or fp32 job is refused, since a roofline
    of another machine and precision says nothing about it. Which GPU model a CUDA table was
    profiled on is not compared (driver names vary; the calibration absorbs the difference)."""
    made, want = (table.device_type, dtype_name(table.dtype)), (device_type, dtype_name(dtype))
    if made != want:
        how = "estimated for" if table.estimate else "profiled on"
        raise ValueError(f"{where}: latency table {how} {table.device} in {table.dtype}, but this job runs on {device_type} in "
                         f"{want[1]} (training.mixed_precision_param): re-profile with python -m profiling.prepare_job --module "
                         f"<module> --config <job> --device {device_type} --dtype {want[1]} --no-data --out <new folder>, then "
                         "pass --pipetune.latency_table <new folder>/table.json")


def with_job_weights(table, master_weights: bool, *, where: str):
    """``table`` planning with the job's weight precision (``model_parts.master_weights_of``): with
    master weights the cost model counts the weight copies each forward keeps
    (``CostModel.weight_copy_bytes``), whatever the table was timed with. A measured table timed
    the other way is kept with a warning (its latencies miss or add the per-forward weight casts,
    which the online calibration fits); re-profiling with ``profiling.prepare_job`` matches it."""
    if table.master_weights != master_weights and not table.estimate:
        how = ("float32 weights under autocast" if table.master_weights else "weights held in the compute dtype")
        logger.warning(f"pipetune: {where} was timed with {how}, but this job "
                       f"{'keeps float32 weights under autocast (no FSDP)' if master_weights else 'holds its weights in the compute dtype'}: "
                       "its latencies are off by the weight casts until the online calibration fits them; re-profile with "
                       "python -m profiling.prepare_job for this job")
    return dataclasses.replace(table, master_weights=master_weights)
