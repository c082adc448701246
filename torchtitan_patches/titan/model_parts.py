"""How TorchTitan splits and parallelises a model for pipetune's stage layout.

The layout (``pipetune.layout``: even, explicit counts, searched, or DIP's separated layout) is
chosen before TorchTitan builds the model and handed to its splitter as
``parallelism.module_fqns_per_model_part``, so planner and runtime agree on it. Layouts that are
searched are scored on batches sampled from the job's own data with the job's latency table.

Virtual stages: with TorchTitan's ``Interleaved1F1B`` or ``InterleavedZeroBubble`` schedule the
layout has ``V x P`` backbone chunks (``schedule_family``: V as TorchTitan derives its stages per
rank), and TorchTitan's splitter gives rank ``r`` the parts of chunks ``r, r + P, ...`` (its "loop"
style), in that order: chunk ``c`` on rank ``c mod P``, ``Placement.interleaved``. With
``ZBVZeroBubble`` or ``DualPipeV`` it gives rank ``r`` chunks ``r`` and ``2P - 1 - r`` (its "v"
style, ``Placement.v_shaped``): rank 0 then holds the embeddings, the encoder and the head, and a
searched layout (``auto``) is scored on that placement, rank 0's chunks counted together.

Limits: the separated layout's encoder chunks past stage 0 get the job's activation checkpointing
but not ``torch.compile`` (refused for Muse Glimmer in ``titan.job_checks``), which no Muse Glimmer
job with its vision stack can use in TorchTitan 0.3.0, pipetune's or stock:
``parallelize_muse_glimmer`` compiles the vision adapter with ``apply_compile``, which needs
``layers`` (AttributeError), so compiling the chunks could not be tested. With that call skipped
by hand, a compiled (aot_eager) separated DP 2 x PP 2 job ran, and with full activation
checkpointing too it stopped at dynamo's recompile limit (``CheckpointWrapper.forward``,
``fullgraph``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from typing import NamedTuple

from torchtitan.config import TORCH_DTYPE_MAP

from pipetune.config.model import ModelConfig
from pipetune.cost import CostModel, LatencyTable, StageLayout
from pipetune.data.batch import BatchMeta
from pipetune.data.storage import open_dataset
from pipetune.plan.layout.layout_search import LayoutSearch, sample_batches
from pipetune.plan.layout.planner_config import SplitBackward, separated_excluded
from pipetune.schedule.table import ChunkStyle, Placement
from torchtitan_patches.models.muse_glimmer.tp_fix import convert_first_block_input
from torchtitan_patches.runtime.data_parallel import shard_part
from torchtitan_patches.models.muse_glimmer.stages import keep_encoder_chunks
from torchtitan_patches.titan.tokenizer import text_tokenizer

VISION_MODULES = ("vision_encoder", "vision_adapter", "vision_projection", "perception_emb_norm")


def layout_fqns(layout: StageLayout, parts: list[str], *, separated: bool = False) -> list[list[str]]:
    """TorchTitan module names per pipeline stage for ``layout`` (the vision stack and embeddings
    on stage 0, norm and head on the last stage). ``separated`` (DIP's layout): every stage keeps
    ``vision_encoder``, which ``keep_encoder_chunks`` then cuts to the rank's encoder chunks
    (TorchTitan's splitter keeps or drops only whole top-level modules)."""
    fqns = [[f"layers.{i}" for i in range(lo, hi)] for lo, hi in layout.layer_ranges]
    fqns[0][:0] = [*(p for p in parts if not (separated and p == "vision_encoder")), "tok_embeddings"]
    fqns[-1] += ["norm", "lm_head"]
    return [["vision_encoder", *f] for f in fqns] if separated else fqns


INTERLEAVED_SCHEDULES: dict[str, SplitBackward | None] = {"interleaved1f1b": None, "interleavedzerobubble": SplitBackward.ON}
"""TorchTitan's "loop" schedules pipetune runs as virtual stages (lower-case names, as torch matches
them), with the split backward each implies (``None``: ``pipetune.split_backward`` decides)."""
V_SHAPED_SCHEDULES = ("zbvzerobubble", "dualpipev")
"""TorchTitan's "v" schedules: two chunks per rank in a V (``Placement.v_shaped``), backwards split.
pipetune plans its own tables over that placement each step; torch's orders for them
(``pipetune.schedule.schedules.zbv_zero_bubble``, ``dual_pipe_v``) are what the stock trainer runs."""


class ScheduleFamily(NamedTuple):
    """What a job's schedule setting fixes for the planner: chunks per rank, their style, split backward."""

    chunks_per_rank: int
    split: SplitBackward
    style: ChunkStyle = ChunkStyle.LOOP


def schedule_family(config) -> ScheduleFamily:
    """Backbone chunks per rank, split backward and chunk style of a job: ``V = 1`` for one-stage
    schedules; for interleaved ones TorchTitan's stages per rank (``_get_pipeline_metadata``: from
    ``pipeline_parallel_layers_per_stage``, ``ceil((layers + 2) / layers_per_stage) / P``, else 2);
    ``InterleavedZeroBubble`` always splits backwards, the others as ``pipetune.split_backward``
    says; V-shaped schedules run two chunks per rank and split backwards (TorchTitan asserts two).
    ``ValueError`` for a layers-per-stage that does not give a whole V >= 2 (exactly 2 V-shaped)."""
    par = config.parallelism
    name = par.pipeline_parallel_schedule.lower()
    split = SplitBackward(config.pipetune.split_backward)
    v_shaped = name in V_SHAPED_SCHEDULES
    if name not in INTERLEAVED_SCHEDULES and not v_shaped:
        return ScheduleFamily(1, split)
    split = SplitBackward.ON if v_shaped else INTERLEAVED_SCHEDULES[name] or split
    style = ChunkStyle.V if v_shaped else ChunkStyle.LOOP
    per_stage, pp = par.pipeline_parallel_layers_per_stage, par.pipeline_parallel_degree
    if per_stage is None:
        return ScheduleFamily(2, split, style)
    stages = math.ceil((len(config.model_spec.model.layers) + par.pipeline_parallel_first_stage_less_layers
                        + par.pipeline_parallel_last_stage_less_layers) / per_stage)
    if stages % pp or stages // pp < 2 or (v_shaped and stages != 2 * pp):
        need = f"exactly {2 * pp} stages (two per rank" if v_shaped else f"a multiple >= 2 of the {pp} pipeline ranks (at least two chunks per rank"
        raise ValueError(f"parallelism.pipeline_parallel_layers_per_stage {per_stage}: gives {stages} stages; "
                         f"{par.pipeline_parallel_schedule} needs {need}): choose a value that does, or leave it unset for two "
                         "chunks per rank")
    return ScheduleFamily(stages // pp, split, style)


def local_encoder_chunks(rank: int, pp: int, chunk_ranges) -> list[int]:
    """The encoder chunks of DIP's separated layout that ``rank`` of ``pp`` holds."""
    return [k for k, r in enumerate(Placement.separated(pp, len(chunk_ranges), encoder_trained=False).encoder) if r == rank]


def sample_job_batches(config, model: ModelConfig) -> list[BatchMeta]:
    """8 batches of the job's data drawn with their own seed (deterministic, so every rank draws
    the same): the layout search and the choice of the guard's baseline are made on them. Each is
    as large as one data-parallel replica's share (``dataloader.gbs / replicas``), what every
    pipeline plans: a global batch's worth of rows would favour larger micro-batches and layouts
    that need more micro-batches than a replica gets. The rows are the loader's: the job's
    ``dataloader.bad_images`` policy decides which are left out."""
    dl = config.dataloader
    loader = dl.data_loader_config(config.training.seq_len)  # checks the settings before the data set is read
    tokenizer = text_tokenizer(config.tokenizer.build(tokenizer_path=config.hf_assets_path))
    store = open_dataset(loader.data, tokenizer=tokenizer, bad_images=loader.bad_images)
    return sample_batches(store.table, model, gbs=max(dl.gbs // replicas_of(config), 1), max_seq_len=config.training.seq_len,
                          count=8, seed=dl.seed, overlong=dl.overlong)


def layout_search(config, model: ModelConfig, table: LatencyTable, sample: list[BatchMeta]) -> LayoutSearch:
    """The layout search of a job (``auto``, and the partitioner for ``separated``): its latency
    table, memory and micro-batch limits, chunks per rank and split backward, on ``sample``."""
    pt, pp = config.pipetune, config.parallelism.pipeline_parallel_degree
    chunks, split, style = schedule_family(config)
    even = StageLayout.even(model.backbone.n_layers, pp * chunks, chunks_per_rank=chunks, style=style)
    return LayoutSearch(model, CostModel(table, even), sample, max_seq_len=config.training.seq_len, memory_bytes=pt.memory_gib * 2**30,
                        split_backward=split, max_mbs=pt.max_mbs, seed=config.dataloader.seed, offload=pt.offload)


def for_pipetune(parallelize_fn, encoder_chunks=()):
    """The model's ``parallelize_fn`` for the parts pipetune runs, without its FSDP: with one
    replica FSDP would shard nothing (and its lazy initialisation refuses a submodule, the
    encoder run by its own actions, running before the root module); with data parallelism
    ``runtime.data_parallel.shard_part`` applies FSDP/HSDP instead (see there why) and
    ``FsdpStep`` drives it per step. Tensor parallelism is the model's own plan (its
    ``parallelize_fn``), with the first block's input conversion Muse Glimmer lacks without
    sequence parallelism (``models.muse_glimmer.tp_fix``); ``runtime.tensor_parallel`` sums the
    gradients TorchTitan leaves to its FSDP. With ``encoder_chunks`` (DIP's separated layout: the
    encoder's block ranges), each rank's part is first cut to its encoder chunks (still on the
    meta device: TorchTitan materialises the parts after parallelising them), and every rank's
    chunks get stage 0's TP, activation checkpointing and FSDP (``encoder_as_stage_0``), so DP
    and TP run beside that layout too and the job's AC applies to the whole encoder."""
    if "skip_dp" not in inspect.signature(parallelize_fn).parameters:
        raise ValueError(f"{parallelize_fn.__qualname__} cannot skip FSDP (no skip_dp argument); PipeTuneTrainer needs that")

    def parallelize(model, *, parallel_dims, **kwargs):
        if parallel_dims.tp_enabled:
            convert_first_block_input(model, enable_sp=kwargs["parallelism"].enable_sequence_parallel)
        if encoder_chunks:
            rank = parallel_dims.get_mesh("pp").get_local_rank()
            keep_encoder_chunks(model.vision_encoder, encoder_chunks, local_encoder_chunks(rank, parallel_dims.pp, encoder_chunks))
        if encoder_chunks and getattr(model, "vision_adapter", None) is None:
            # a part with encoder chunks but no adapter (not stage 0): Muse Glimmer's parallelize_fn
            # asserts that a vision encoder comes with its adapter, so it parallelises the part
            # without its encoder chunks, and they get what it gives stage 0's (FSDP: shard_part below)
            chunks, model.vision_encoder = model.vision_encoder, None
            model = parallelize_fn(model, parallel_dims=parallel_dims, skip_dp=True, **kwargs)
            model.vision_encoder = chunks
            encoder_as_stage_0(chunks, parallel_dims, **kwargs)
        else:
            model = parallelize_fn(model, parallel_dims=parallel_dims, skip_dp=True, **kwargs)
        if not parallel_dims.dp_enabled:
            return model
        training = kwargs["training"]
        shard = "dp_shard" if parallel_dims.get_optional_mesh("dp_shard") is not None else "fsdp"
        axes = [a for a, n in (("dp_replicate", parallel_dims.dp_replicate), (shard, parallel_dims.dp_shard)) if n > 1]
        return shard_part(model, parallel_dims.get_mesh(axes if len(axes) > 1 else axes[0]),
                          param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param], reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce])

    return parallelize


def encoder_as_stage_0(chunks, parallel_dims, *, ac_config, dump_folder, **_) -> None:
    """What Muse Glimmer's ``parallelize_fn`` does to stage 0's vision encoder before FSDP, on the
    encoder chunks of a later rank, by TorchTitan's own functions: TP from their own sharding
    configs, then the job's activation checkpointing of every block (not compile: module doc)."""
    if parallel_dims.tp_enabled:
        chunks.parallelize(parallel_dims)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(chunks)


def choose_layout(config, model: ModelConfig, table: LatencyTable, sample) -> StageLayout:
    """``even`` or explicit counts (``V x P`` of them with V chunks per rank, ``schedule_family``);
    ``separated``: the partitioner's layout; ``auto``: the faster of the best co-located split and
    the separated layout on the sampled batches (``sample()``, called only for those two; one
    replica's share each, ``sample_job_batches``). The separated planner
    scores deterministic times only, so jitter-aware jobs stay co-located; it runs one chunk per
    rank and whole backwards, so with virtual stages or split backward ``auto`` is the best
    co-located split of ``V x P`` chunks (``titan.job_checks`` refuses ``separated`` there)."""
    layout, pp = config.pipetune.layout, config.parallelism.pipeline_parallel_degree
    chunks_per_rank, split, style = schedule_family(config)
    if layout not in ("auto", "separated"):
        return StageLayout.parse(layout, model.backbone.n_layers, pp * chunks_per_rank, chunks_per_rank=chunks_per_rank, style=style)
    search = layout_search(config, model, table, sample())
    if layout == "separated":
        return search.partition().layout
    excluded = separated_excluded(encoder=model.encoder is not None, chunks_per_rank=chunks_per_rank, split_backward=split,
                                  jitter_draws=config.pipetune.jitter_draws, offload=config.pipetune.offload)
    return search.search(separated=not excluded).best.layout


def _shard_degree(config) -> int:
    par = config.parallelism
    shard = par.data_parallel_shard_degree
    if shard == -1:
        rest = par.pipeline_parallel_degree * par.tensor_parallel_degree * par.context_parallel_degree * par.data_parallel_replicate_degree
        shard = max(int(os.environ.get("WORLD_SIZE", rest)) // rest, 1)
    return shard


def replicas_of(config) -> int:
    """The job's data-parallel degree, from its config and torchrun's ``WORLD_SIZE`` (what
    TorchTitan's ``ParallelDims`` will derive), before any process group exists."""
    return _shard_degree(config) * config.parallelism.data_parallel_replicate_degree


def dtype_name(name: str) -> str:
    """A dtype as configs and tables spell it: "bfloat16" and "torch.bfloat16" are the same."""
    return str(name).removeprefix("torch.")


def master_weights_of(config, dtype: str | None = None) -> bool:
    """Whether the job trains in reduced precision (``dtype``, default its
    ``training.mixed_precision_param``) with float32 weights under autocast, as pipetune's executor
    does with one replica; with more (``for_pipetune``: FSDP or HSDP over every data-parallel axis,
    a replicate degree alone included) or with context parallelism, FSDP's mixed-precision policy
    gathers the weights in that dtype."""
    reduced = dtype_name(dtype or config.training.mixed_precision_param) != "float32"
    return reduced and replicas_of(config) == 1 and config.parallelism.context_parallel_degree == 1


def split_for_layout(config, layout: StageLayout) -> None:
    """Point TorchTitan's splitter at ``layout`` and its ``parallelize_fn`` at the parts pipetune
    runs (``for_pipetune``)."""
    spec = config.model_spec
    chunks = layout.encoder_chunks if layout.is_separated else ()
    vision = [m for m in VISION_MODULES if getattr(spec.model, m, None) is not None]
    config.parallelism.module_fqns_per_model_part = layout_fqns(layout, vision, separated=bool(chunks))
    config.model_spec = dataclasses.replace(spec, parallelize_fn=for_pipetune(spec.parallelize_fn, chunks))
