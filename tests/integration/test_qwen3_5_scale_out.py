"""TorchTitan's Qwen3.5 ``debugmodel`` (small vocabulary) under ``PipeTuneTrainer`` beside data
parallelism (FSDP; HSDP, replicate 2 x shard 2) and tensor parallelism on 8 gloo ranks, as Muse
Glimmer in test_titan_scale_out: each step's loss, gradients and gradient norm equal the unsplit
model's on the whole global batch. Gated DeltaNet runs its CPU path; the merger trains, the ViT's
blocks too in the TP job. DP and TP each run within these jobs, not alone: one job checks both."""

from pathlib import Path

import pytest
import torch

from pipetune.records import StepRecord
from launch import torchrun
from small_job import job_args
from titan_reference import check_unsplit_step, qwen3_5_unsplit_model, qwen3_5_unsplit_step

pytestmark = pytest.mark.timeout(150)
WORKER = Path(__file__).with_name("titan_scale_out_worker.py")
STEPS = 2


@pytest.fixture
def unsplit_backend(monkeypatch):
    """The single-process reference runs without TorchTitan's SPMD type annotations (no mesh)."""
    from torchtitan.distributed import utils as dist_utils

    monkeypatch.setattr(dist_utils, "_spmd_backend", "partial_dtensor")


def _scale_out_job(qwen_job, tmp_path, *extra: str, ranks: int = 4) -> tuple[list[list[dict]], list[StepRecord]]:
    dump = tmp_path / "dump"
    torchrun([str(WORKER), str(tmp_path), str(STEPS)] + job_args(qwen_job, dump, "--training.steps", str(STEPS), "--training.max_norm", "1e9",
                                                                   *extra, config="qwen3_5_debug"), timeout=25 * ranks, ranks=ranks)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(ranks)], StepRecord.read(dump / "pipetune" / "steps.jsonl")


def _reference(weights: dict, batches, dtype, trained: bool) -> tuple[float, dict]:
    """Loss and gradients of the unsplit model with ``weights`` on the replicas' batches in ``dtype``
    (the ViT's blocks' too when ``trained``)."""
    model = qwen3_5_unsplit_model(weights, trained=trained, dtype=dtype)
    loss = sum(qwen3_5_unsplit_step(model, batch) for batch in batches)
    return loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _check_steps(ranks: list[list[dict]], records: list[StepRecord], replicas: int, *, trained: bool = False) -> None:
    """Every step: the replicas' batches partition the global batch; loss, gradients (joined over
    TP, after FSDP's reduction) and the clipped norm equal the unsplit model's on the whole batch
    from the same weights (``check_unsplit_step``; gradients at least 1e-4 relative: Gated
    DeltaNet's recurrence, summed in another order under TP, rounds more than attention)."""
    shapes = {k: v.shape for k, v in qwen3_5_unsplit_model(None, trained=False).state_dict().items()}
    assert sorted((r.step, r.replica) for r in records) == [(s, d) for s in range(1, STEPS + 1) for d in range(replicas)]
    for step in range(STEPS):
        at = [r[step] for r in ranks]
        batches = [next(a["batch"] for a in at if a["replica"] == d) for d in range(replicas)]
        assert len({b.num_label_tokens for b in batches}) == 1
        ids = [set(s for mb in b.micro_batches for s in mb.sample_ids.tolist()) for b in batches]
        assert sum(map(len, ids)) == len(set().union(*ids)) == 8  # a partition of the 8-sample global batch
        assert any(mb.num_images for b in batches for mb in b.micro_batches)

        loss = sum(r.loss for r in records if r.step == step + 1)
        exact = check_unsplit_step(at, batches, loss, shapes, lambda w, b, dtype: _reference(w, b, dtype, trained), step=step + 1,
                                   replicas=replicas, floor=1e-4)
        assert any(n.startswith("vision_encoder.merger.") for n in exact) and any(n.endswith(".attn.A_log") for n in exact)
        assert any(n.startswith("vision_encoder.layers.") for n in exact) == trained


@pytest.mark.timeout(250)
def test_qwen3_5_data_tensor_and_pipeline_parallel_steps_equal_the_unsplit_model(qwen_job, tmp_path, unsplit_backend):
    """DP 2 x TP 2 x PP 2 on 8 gloo ranks (FSDP over the replicas; Qwen3.5's own TP plan inside each
    stage: sequence parallel, Gated DeltaNet and full attention sharded by heads, the ViT by its
    linear layers; the ViT trained), 2 steps: the replicas' plans partition each global batch, and
    loss, every gradient (joined over TP after FSDP's reduction; the ViT's and merger's included)
    and the norm equal the unsplit model's."""
    ranks, records = _scale_out_job(qwen_job, tmp_path, "--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree",
                                    "2", "--pipetune.no-freeze_vision_encoder", "--pipetune.latency_table",
                                    str(qwen_job / "table_tp2_trained.json"), ranks=8)
    _check_steps(ranks, records, replicas=2, trained=True)


@pytest.mark.timeout(180)
def test_qwen3_5_hsdp_and_pipeline_parallel_steps_equal_the_unsplit_model(qwen_job, tmp_path, unsplit_backend):
    """HSDP (replicate 2 x shard 2) x PP 2 on 8 gloo ranks, 2 steps: the 4 replicas' plans partition
    each global batch, and loss, every gradient (reduced over both data-parallel axes) and the norm
    equal the unsplit model's."""
    ranks, records = _scale_out_job(qwen_job, tmp_path, "--parallelism.data_parallel_replicate_degree", "2",
                                    "--parallelism.data_parallel_shard_degree", "2", ranks=8)
    assert sorted({(a[0]["replica"], a[0]["stage"]) for a in ranks}) == [(d, s) for d in range(4) for s in range(2)]
    _check_steps(ranks, records, replicas=4)
