"""Settings PipeTuneTrainer cannot honour are refused at config time, in one line naming the
setting; latency tables of another device or dtype are refused naming the file and the fix."""

import dataclasses

import numpy as np
import pytest

from pipetune_configs import config_registry
from pipetune.cost import LatencyTable
from pipetune.cost.latency_table import Curve
from pipetune.plan.layout.planner_config import SplitBackward
from pipetune.schedule.table import ChunkStyle
from torchtitan_patches.titan.job_checks import check_table, refuse_unsupported
from torchtitan_patches.titan.model_parts import schedule_family


@pytest.fixture(autouse=True)
def two_ranks(monkeypatch):
    """torchrun's world of the stock job: 2 pipeline ranks, so one data-parallel replica."""
    monkeypatch.setenv("WORLD_SIZE", "2")


def _refused(config, setting: str) -> str:
    with pytest.raises(ValueError) as e:
        refuse_unsupported(config)
    message = str(e.value)
    assert "\n" not in message and message.startswith(setting), message
    return message


@pytest.mark.parametrize("name", ["muse_glimmer_mm", "muse_glimmer_heavy_vit", "muse_glimmer_mm_gpu", "muse_glimmer_mm_testbed",
                                  "muse_glimmer_heavy_vit_testbed"])
def test_stock_configs_pass(name):
    refuse_unsupported(getattr(config_registry, name)())


@pytest.mark.parametrize("schedule", ["1F1B", "gpipe"])
def test_one_stage_schedules_pass(schedule):
    config = config_registry.muse_glimmer_mm()
    config.parallelism.pipeline_parallel_schedule = schedule
    refuse_unsupported(config)


@pytest.mark.parametrize("schedule, chunks, split, style", [("1F1B", 1, "off", "loop"), ("Interleaved1F1B", 2, "off", "loop"),
                                                            ("interleaved1f1b", 2, "off", "loop"), ("InterleavedZeroBubble", 2, "on", "loop"),
                                                            ("ZBVZeroBubble", 2, "on", "v"), ("dualpipev", 2, "on", "v")])
def test_multi_stage_schedules_pass_as_virtual_stages(schedule, chunks, split, style):
    """TorchTitan's loop-style schedules: two chunks per rank by default, as TorchTitan builds them;
    InterleavedZeroBubble splits every backward; the V-shaped ones run two chunks per rank in a V,
    backwards split."""
    config = config_registry.muse_glimmer_mm()
    config.parallelism.pipeline_parallel_schedule = schedule
    config.training.local_batch_size = 4  # torch's DualPipeV, which TorchTitan builds unused, needs 2P micro-batches
    refuse_unsupported(config)
    assert schedule_family(config) == (chunks, SplitBackward(split), ChunkStyle(style))


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_v_shaped_schedules_split_backwards_and_hold_two_chunks_per_rank(schedule):
    config = config_registry.muse_glimmer_mm()
    config.parallelism.pipeline_parallel_schedule = schedule
    config.training.local_batch_size = 4
    config.pipetune.split_backward = "auto"
    assert f"{schedule} always splits backwards" in _refused(config, "pipetune.split_backward")
    config.pipetune.split_backward = "off"
    config.parallelism.pipeline_parallel_layers_per_stage = 2  # 5 stages on PP 2
    assert "needs exactly 4 stages (two per rank" in _refused(config, "parallelism.pipeline_parallel_layers_per_stage")
    config.parallelism.pipeline_parallel_layers_per_stage = 3  # 4 stages
    refuse_unsupported(config)
    config.parallelism.pipeline_parallel_layers_per_stage = None
    config.pipetune.layout = "separated"
    assert "run on co-located layouts" in _refused(config, "pipetune.layout")
    config.pipetune.layout = "even"
    config.training.local_batch_size = 3
    if schedule == "DualPipeV":
        assert "set --training.local_batch_size 4" in _refused(config, "parallelism.pipeline_parallel_schedule")
    else:
        refuse_unsupported(config)


@pytest.mark.parametrize("per_stage, chunks", [(3, 2), (1, 5), (2, None), (6, None)])
def test_layers_per_stage_sets_an_interleaved_schedules_chunks_per_rank(per_stage, chunks):
    """TorchTitan's rule on Muse Glimmer's 8 layers: ceil((8 + 1 + 1) / layers per stage) stages,
    a multiple of PP 2 and at least two per rank (2 gives 5 stages; 6 gives 2, one per rank)."""
    config = config_registry.muse_glimmer_mm()
    config.parallelism.pipeline_parallel_schedule = "Interleaved1F1B"
    config.parallelism.pipeline_parallel_layers_per_stage = per_stage
    if chunks is None:
        assert "leave it unset for two chunks per rank" in _refused(config, "parallelism.pipeline_parallel_layers_per_stage")
    else:
        refuse_unsupported(config)
        assert schedule_family(config)[0] == chunks


@pytest.mark.parametrize("schedule", ["PipelineScheduleSingle", "LoopedBFS"])
def test_other_schedules_refused(schedule):
    config = config_registry.muse_glimmer_mm()
    config.parallelism.pipeline_parallel_schedule = schedule
    assert "set --parallelism.pipeline_parallel_schedule 1F1B" in _refused(config, "parallelism.pipeline_parallel_schedule")


@pytest.mark.parametrize("degree", ["data_parallel_shard_degree", "tensor_parallel_degree"])
def test_virtual_stages_and_split_backward_accepted_beside_data_or_tensor_parallelism(monkeypatch, degree):
    monkeypatch.setenv("WORLD_SIZE", "4")
    for schedule, split in (("Interleaved1F1B", "auto"), ("InterleavedZeroBubble", "off"), ("1F1B", "on")):
        config = config_registry.muse_glimmer_mm()
        setattr(config.parallelism, degree, 2)
        config.parallelism.pipeline_parallel_schedule = schedule
        config.pipetune.split_backward = split
        refuse_unsupported(config)


def test_virtual_stages_and_split_backward_run_on_co_located_layouts_only():
    """The separated layout runs one chunk per rank and whole backwards; ``auto`` then searches the
    co-located split only (``model_parts.choose_layout``)."""
    for schedule, split in (("InterleavedZeroBubble", "off"), ("1F1B", "on")):
        config = config_registry.muse_glimmer_mm()
        config.parallelism.pipeline_parallel_schedule, config.pipetune.split_backward = schedule, split
        config.pipetune.layout = "separated"
        what = "2 chunks per rank and split backward" if schedule != "1F1B" else "split backward"
        assert f"{what} " in _refused(config, "pipetune.layout separated")
        for layout in ("auto", "even", "1,3,2,2" if schedule != "1F1B" else "3,5"):
            config.pipetune.layout = layout
            refuse_unsupported(config)


def test_split_backward_setting():
    from torchtitan_patches.settings import PipeTuneSettings

    with pytest.raises(ValueError, match="pipetune.split_backward must be one of"):
        PipeTuneSettings.Config(split_backward="sometimes")
    config = config_registry.muse_glimmer_mm()
    config.parallelism.pipeline_parallel_schedule = "InterleavedZeroBubble"
    config.pipetune.split_backward = "auto"
    assert "always splits backwards" in _refused(config, "pipetune.split_backward auto")


def test_schedule_csv_refused():
    config = config_registry.muse_glimmer_mm()
    config.parallelism.pipeline_parallel_schedule_csv = "schedule.csv"
    _refused(config, "parallelism.pipeline_parallel_schedule_csv")


def test_gradient_accumulation_refused():
    config = config_registry.muse_glimmer_mm()
    config.training.global_batch_size = 4 * config.training.local_batch_size
    assert "--training.global_batch_size -1" in _refused(config, "training.global_batch_size")


def test_global_batch_of_one_accumulation_step_passes(monkeypatch):
    """local_batch_size x replicas is one accumulation step; with shard degree -1 the replicas come
    from WORLD_SIZE (8 ranks / PP 2 = 4 replicas)."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    config = config_registry.muse_glimmer_mm()
    config.training.global_batch_size = 4 * config.training.local_batch_size
    refuse_unsupported(config)
    config.parallelism.data_parallel_shard_degree = 2
    _refused(config, "training.global_batch_size")


def test_context_parallelism_refused():
    config = config_registry.muse_glimmer_mm()
    config.parallelism.context_parallel_degree = 2
    _refused(config, "parallelism.context_parallel_degree")


def test_unmapped_model_refused():
    config = config_registry.muse_glimmer_mm()
    config.model_spec = dataclasses.replace(config.model_spec, name="kimi_k2_7", flavor="debugmodel")
    message = _refused(config, "model_spec")
    assert "kimi_k2_7/debugmodel" in message and "muse_glimmer" in message and "model_spec.py" in message


def test_validation_refused():
    config = config_registry.muse_glimmer_mm()
    config.validator.enable = True
    assert "--validator.no-enable" in _refused(config, "validator.enable")


def test_microbatch_size_refused():
    config = config_registry.muse_glimmer_mm()
    config.parallelism.pipeline_parallel_microbatch_size = 2
    assert "pipetune.max_mbs" in _refused(config, "parallelism.pipeline_parallel_microbatch_size")


@pytest.mark.parametrize("name, value", [("module_fqns_per_model_part", [["layers.0"], ["layers.1"]]),
                                         ("pipeline_parallel_layers_per_stage", 4),
                                         ("pipeline_parallel_first_stage_less_layers", 2),
                                         ("pipeline_parallel_last_stage_less_layers", 0)])
def test_titan_stage_split_refused(name, value):
    config = config_registry.muse_glimmer_mm()
    setattr(config.parallelism, name, value)
    assert "--pipetune.layout" in _refused(config, f"parallelism.{name}")


def _table(device: str, dtype: str, *, estimate: bool = False) -> LatencyTable:
    grid = np.array([1.0, 2.0])
    return LatencyTable(model=None, curves={"rest": Curve("packed_len", grid, grid, grid)}, memory={}, p2p={}, device=device,
                        dtype=dtype, estimate=estimate)


@pytest.mark.parametrize("device, dtype, job_device, job_dtype", [
    ("cpu: x86_64", "float32", "cpu", "float32"),
    ("NVIDIA H100 80GB HBM3", "bfloat16", "cuda", "bfloat16"),
    ("cpu: x86_64", "torch.float32", "cpu", "float32"),
    ("H100-SXM (analytical estimate)", "bfloat16", "cuda", "torch.bfloat16"),
])
def test_matching_table_passes(device, dtype, job_device, job_dtype):
    check_table(_table(device, dtype, estimate="estimate" in device), device_type=job_device, dtype=job_dtype, where="t.json")


@pytest.mark.parametrize("device, dtype, job_device, job_dtype", [
    ("cpu: x86_64", "float32", "cuda", "float32"),
    ("NVIDIA H100 80GB HBM3", "bfloat16", "cpu", "bfloat16"),
    ("cpu: x86_64", "float32", "cpu", "bfloat16"),
    ("NVIDIA H100 80GB HBM3", "bfloat16", "cuda", "float32"),
])
def test_other_device_or_dtype_refused(device, dtype, job_device, job_dtype):
    with pytest.raises(ValueError) as e:
        check_table(_table(device, dtype), device_type=job_device, dtype=job_dtype, where="tables/h100/table.json")
    message = str(e.value)
    assert "\n" not in message and message.startswith("tables/h100/table.json: latency table profiled on")
    assert "python -m profiling.prepare_job" in message and f"--device {job_device} --dtype {job_dtype}" in message


def test_estimate_refused_on_cpu():
    with pytest.raises(ValueError, match="estimated for H100-SXM"):
        check_table(_table("H100-SXM (analytical estimate)", "bfloat16", estimate=True), device_type="cpu", dtype="float32",
                    where="est.json")


@pytest.mark.parametrize("section, name, value", [("parallelism", "fsdp_reshard_after_forward", "always"),
                                                  ("training", "enable_cpu_offload", True)])
def test_scale_out_settings_the_runtime_does_not_honour_are_refused(section, name, value):
    config = config_registry.muse_glimmer_mm()
    setattr(getattr(config, section), name, value)
    _refused(config, f"{section}.{name}")


@pytest.mark.parametrize("degree", ["data_parallel_shard_degree", "tensor_parallel_degree"])
def test_data_and_tensor_parallel_jobs_pass_with_any_layout(monkeypatch, degree):
    monkeypatch.setenv("WORLD_SIZE", "4")
    for layout in ("even", "3,5", "auto", "separated"):
        config = config_registry.muse_glimmer_mm()
        setattr(config.parallelism, degree, 2)
        config.pipetune.layout = layout
        refuse_unsupported(config)


@pytest.mark.parametrize("shard, tp, jitter, schedule, separated", [(1, 1, 0, "1F1B", True), (2, 1, 0, "1F1B", True),
                                                                    (1, 2, 0, "1F1B", True), (2, 1, 4, "1F1B", False),
                                                                    (1, 1, 0, "Interleaved1F1B", False)])
def test_auto_weighs_the_separated_layout_beside_data_and_tensor_parallelism(monkeypatch, shard, tp, jitter, schedule, separated):
    """``auto`` searches the separated layout too, whatever the DP and TP degrees; jitter-aware jobs
    stay co-located (the separated planner scores deterministic times only), and so do jobs with
    virtual stages (it runs one chunk per rank)."""
    from types import SimpleNamespace

    from torchtitan_patches.titan import model_parts

    monkeypatch.setenv("WORLD_SIZE", str(2 * shard * tp))
    config = config_registry.muse_glimmer_mm()
    config.parallelism.data_parallel_shard_degree, config.parallelism.tensor_parallel_degree = shard, tp
    config.pipetune.layout, config.pipetune.jitter_draws = "auto", jitter
    config.parallelism.pipeline_parallel_schedule = schedule
    asked = []
    search = SimpleNamespace(search=lambda separated: asked.append(separated) or SimpleNamespace(best=SimpleNamespace(layout="chosen")))
    monkeypatch.setattr(model_parts, "layout_search", lambda *args: search)
    assert model_parts.choose_layout(config, SimpleNamespace(encoder=object()), None, lambda: []) == "chosen"
    assert asked == [separated]


@pytest.mark.parametrize("shard, replicate, share", [(1, 1, 16), (2, 1, 8), (2, 2, 4)])
def test_layout_and_baseline_are_chosen_on_batches_of_one_replicas_share(monkeypatch, shard, replicate, share):
    """Each pipeline plans its replica's share of the global batch, so the sampled batches the
    layout search and the guard's baseline are chosen on are that large."""
    from types import SimpleNamespace

    from torchtitan_patches.titan import model_parts

    monkeypatch.setenv("WORLD_SIZE", str(2 * shard * replicate))
    config = config_registry.muse_glimmer_mm()
    config.parallelism.data_parallel_shard_degree, config.parallelism.data_parallel_replicate_degree = shard, replicate
    config.dataloader.gbs = 16
    asked = {}
    monkeypatch.setattr(model_parts, "text_tokenizer", lambda tok: None)
    monkeypatch.setattr(model_parts, "open_dataset", lambda path, tokenizer, bad_images: SimpleNamespace(table=None))
    monkeypatch.setattr(model_parts, "sample_batches", lambda table, model, **kw: asked.update(kw) or [])
    config.tokenizer = SimpleNamespace(build=lambda tokenizer_path: None)
    model_parts.sample_job_batches(config, None)
    assert asked["gbs"] == share and asked["count"] == 8


@pytest.mark.parametrize("dtype, shard, replicate, world, cp, master", [
    ("float32", 1, 1, 2, 1, False),  # full precision: nothing is cast
    ("bfloat16", 1, 1, 2, 1, True),  # pipeline only: float32 weights under autocast
    ("bfloat16", -1, 1, 2, 1, True),  # -1 resolves to 1 on a world of pipeline ranks only
    ("bfloat16", -1, 1, 4, 1, False),  # ... and to 2 here: FSDP gathers bf16 weights
    ("bfloat16", 2, 1, 4, 1, False),
    ("bfloat16", 1, 2, 4, 1, False),  # a replicate degree alone: pipetune shards over it too (for_pipetune)
    ("bfloat16", 1, 1, 4, 2, False),  # context parallelism shards weights too (TorchTitan's fsdp_enabled)
])
def test_master_weights_follow_whether_fsdp_holds_the_weights(monkeypatch, dtype, shard, replicate, world, cp, master):
    from torchtitan_patches.titan.model_parts import master_weights_of

    monkeypatch.setenv("WORLD_SIZE", str(world))
    config = config_registry.muse_glimmer_mm()
    config.training.mixed_precision_param = dtype
    par = config.parallelism
    par.data_parallel_shard_degree, par.data_parallel_replicate_degree, par.context_parallel_degree = shard, replicate, cp
    assert master_weights_of(config) is master


@pytest.mark.parametrize("estimate", [False, True])
def test_the_job_sets_the_tables_weight_precision_and_a_measured_mismatch_is_logged(estimate, caplog):
    from torchtitan_patches.titan.job_checks import with_job_weights

    table = _table("NVIDIA H100 80GB HBM3", "bfloat16", estimate=estimate)
    with caplog.at_level("WARNING"):
        assert with_job_weights(table, True, where="t.json").master_weights
        assert not with_job_weights(dataclasses.replace(table, master_weights=True), False, where="t.json").master_weights
        assert with_job_weights(dataclasses.replace(table, master_weights=True), True, where="t.json").master_weights
    assert len([r for r in caplog.records if "t.json was timed with" in r.getMessage()]) == (0 if estimate else 2)


def test_compiling_muse_glimmers_model_refused_and_the_loss_alone_passes():
    config = config_registry.muse_glimmer_mm()
    config.compile.enable = True
    assert "--compile.no-enable" in _refused(config, "compile.enable")
    config.compile.components = ["loss"]
    refuse_unsupported(config)
