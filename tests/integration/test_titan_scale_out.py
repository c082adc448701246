"""pipetune's trainer beside TorchTitan's data parallelism (FSDP) on 4 gloo ranks: every replica
runs its own plan of its share of the global batch, and each step's loss and gradients equal the
unsplit model's on the whole global batch."""

from pathlib import Path

import pytest
import torch

from configs import config_registry
from pipetune.records import StepRecord
from titan_jobs import job_args, torchrun
from titan_reference import unsplit_step

pytestmark = pytest.mark.timeout(170)
WORKER = Path(__file__).with_name("titan_dp_worker.py")
STEPS = 3


def _unsplit(weights: dict, micro_batches: list, normaliser: int) -> tuple[float, dict]:
    """Loss and gradients of the unsplit TorchTitan model on ``micro_batches`` (single process)."""
    from types import SimpleNamespace

    spec = config_registry.muse_glimmer_mm().model_spec
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.load_state_dict(weights, strict=True)
    model.vision_encoder.requires_grad_(False)
    loss = unsplit_step(model, SimpleNamespace(micro_batches=micro_batches, num_label_tokens=normaliser))
    return loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_data_parallel_steps_equal_the_unsplit_model_on_the_global_batch(job, tmp_path, monkeypatch):
    """DP 2 x PP 2 with FSDP, 3 steps: the replicas' plans partition each global batch, and every
    step's loss (summed over replicas) and every parameter's gradient (after FSDP's reduction)
    equal the unsplit model's on the whole batch from the same weights."""
    from torchtitan.distributed import utils as dist_utils

    monkeypatch.setattr(dist_utils, "_spmd_backend", "partial_dtensor")
    dump = tmp_path / "dump"
    torchrun([str(WORKER), str(tmp_path), str(STEPS)] + job_args(
        job, dump, "--training.steps", str(STEPS), "--parallelism.data_parallel_shard_degree", "2", "--training.max_norm", "1e9"),
        timeout=160, ranks=4)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    records = StepRecord.read(dump / "pipetune" / "steps.jsonl")
    assert sorted((r.step, r.replica) for r in records) == [(s, d) for s in range(1, STEPS + 1) for d in range(2)]
    # ranks: pp-major mesh (pp, dp): rank 2 * stage + replica
    for step in range(STEPS):
        batches = [ranks[replica][step]["batch"] for replica in range(2)]
        assert batches[0].step == batches[1].step and batches[0].num_label_tokens == batches[1].num_label_tokens
        ids = [set(s for mb in b.micro_batches for s in mb.sample_ids.tolist()) for b in batches]
        assert not ids[0] & ids[1] and len(ids[0] | ids[1]) == 8  # a partition of the 8-sample global batch
        assert sum(mb.num_label_tokens for b in batches for mb in b.micro_batches) == batches[0].num_label_tokens
        weights = {k: v for r in ranks for k, v in r[step]["weights"].items()}
        loss, reference = _unsplit(weights, [mb for b in batches for mb in b.micro_batches], batches[0].num_label_tokens)
        mine = [r for r in records if r.step == step + 1]
        assert sum(r.loss for r in mine) == pytest.approx(loss, rel=1e-5)
        assert not [k for k, g in reference.items() if not g.abs().max() > 0], "a gradient is zero: the comparison would prove nothing"
        for stage in range(2):
            for replica in range(2):
                grads = ranks[2 * stage + replica][step]["grads"]
                for name, g in grads.items():
                    err = float((g - reference[name]).norm() / reference[name].norm())
                    assert err < 1e-4, f"step {step + 1}, rank {2 * stage + replica}: {name}: relative gradient error {err:.2e}"
        assert {k for r in (0, 2) for k in ranks[r][step]["grads"]} == set(reference)


def test_data_parallel_job_resumes_as_if_uninterrupted(job, tmp_path):
    """DP 2 x PP 2, checkpoints at steps 2 and 4 (FSDP-sharded weights and optimizer, each data-
    parallel rank's loader state, rank 0's learning); restarted as if it had died before the step-4
    checkpoint, it trains steps 3 and 4 exactly as the first run did, replica by replica."""
    import shutil

    dump = tmp_path / "job"
    run = ["-m", "torchtitan.train", *job_args(job, dump, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2",
                                               "--parallelism.data_parallel_shard_degree", "2")]
    torchrun(run, timeout=160, ranks=4)
    first = StepRecord.read(dump / "pipetune" / "steps.jsonl")
    shutil.rmtree(dump / "checkpoint" / "step-4")
    (dump / "pipetune" / "steps.jsonl").unlink()
    assert "Training starts at step 3" in torchrun(run, timeout=160, ranks=4)
    resumed = StepRecord.read(dump / "pipetune" / "steps.jsonl")
    key = lambda r: (r.step, r.replica)  # noqa: E731
    assert sorted(map(key, resumed)) == [(s, d) for s in (3, 4) for d in range(2)]
    for x, y in zip(sorted((r for r in first if r.step > 2), key=key), sorted(resumed, key=key)):
        assert (x.batch, x.samples, x.order) == (y.batch, y.samples, y.order)
        assert x.loss == y.loss, f"step {x.step} replica {x.replica}: loss {x.loss} uninterrupted, {y.loss} resumed"


def test_bf16_job_trains_within_bf16_tolerance_of_fp32(job, tmp_path):
    """The same DP 2 x PP 2 job in bf16 (``training.mixed_precision_param``: FSDP computes with
    bf16 weights, messages are bf16) trains 3 steps whose losses stay within bf16's precision of
    the fp32 job's. Its latency table is the fp32 one relabelled bf16: this checks numerics, not
    planning."""
    import json

    table = json.loads((job / "table.json").read_text())
    (tmp_path / "table_bf16.json").write_text(json.dumps({**table, "dtype": "bfloat16"}))
    losses = {}
    for dtype, path in (("float32", job / "table.json"), ("bfloat16", tmp_path / "table_bf16.json")):
        dump = tmp_path / dtype
        torchrun(["-m", "torchtitan.train", *job_args(job, dump, "--training.steps", "3", "--parallelism.data_parallel_shard_degree", "2",
                                                       "--training.mixed_precision_param", dtype, "--pipetune.latency_table", str(path),
                                                       "--pipetune.mode", "balanced", "--pipetune.mbs", "1")], timeout=160, ranks=4)
        records = StepRecord.read(dump / "pipetune" / "steps.jsonl")
        losses[dtype] = [sum(r.loss for r in records if r.step == s) for s in (1, 2, 3)]
    assert losses["float32"] != losses["bfloat16"]  # the bf16 job did compute in bf16
    for a, b in zip(losses["float32"], losses["bfloat16"]):
        assert b == pytest.approx(a, rel=2e-2)
