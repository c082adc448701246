"""TorchTitan's Muse Glimmer in DIP's separated layout on 2 gloo ranks: its 10-block ViT cut into 4
chunks (two per rank, each rank's ``vision_encoder`` holding only its blocks), its model parts
split as ``PipeTuneTrainer`` splits them, image sub-microbatches padded to a fixed size, strict
message order: the same loss and gradients as the unsplit TorchTitan model's own forward."""

import json
from pathlib import Path

import pytest

from launch import forked_ranks

WORKER = Path(__file__).with_name("titan_separated_worker.py")
pytestmark = pytest.mark.timeout(120)


def _run(data: Path, out: Path, timeout: float = 90.0, **opts) -> list[dict]:
    for r, (code, log) in enumerate(forked_ranks([str(WORKER), str(data), str(out), json.dumps(opts)], timeout, ranks=2)):
        assert code == 0, f"rank {r} failed:\n{log[-3000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("trained,sub_batch,seed", [(True, 2, 0), (False, 4, 1)])
def test_separated_muse_glimmer_gives_the_unsplit_models_gradients(datamix2_dir, tmp_path, trained, sub_batch, seed):
    """Every parameter's gradient (the ViT's blocks, embedding and final norm too when trained) and
    the loss equal the unsplit model's (weights perturbed from TorchTitan's init, whose zero norm
    weights would leave every gradient but the final norm's zero); none of the compared gradients
    is zero."""
    r0, r1 = _run(datamix2_dir, tmp_path, trained=trained, sub_batch=sub_batch, seed=seed)
    assert r0["chunks"] == [0, 2] and r1["chunks"] == [1, 3]
    assert r0["blocks"] == [0, 1, 2, 6, 7] and r1["blocks"] == [3, 4, 5, 8, 9]  # each part holds its chunks' blocks only
    assert r0["padded"] > 0 and r0["order"] != sorted(r0["order"])
    _assert_unsplit_gradients(r0, r1, trained)


def _assert_unsplit_gradients(r0: dict, r1: dict, trained: bool) -> None:
    """Every gradient of the unsplit model is compared on one rank or the other (the ViT's blocks
    exactly when trained), none is zero, each is within 1e-4, and the loss is the unsplit one."""
    compared = set(r0["errors"]) | set(r1["errors"])
    assert compared == set(r0["reference"])
    assert any(n.startswith("vision_encoder.layers.") for n in compared) == trained
    for r in (r0, r1):
        assert not r["zero_grads"]
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] < 1e-4, f"{worst}: relative gradient error {r['errors'][worst]:.2e}"
    assert r1["loss"] == pytest.approx(r1["loss_ref"], rel=1e-5)


@pytest.mark.parametrize("trained", [True, False])
def test_the_separated_search_s_plans_give_the_unsplit_models_gradients(datamix2_dir, tmp_path, trained):
    """The plan ``SeparatedPlanner`` finds for the batch (its micro-batch size, ``B``, order, lead
    and lag) runs in strict message order with the unsplit model's loss and gradients."""
    from pipetune.schedule.table import Action

    r0, r1 = _run(datamix2_dir, tmp_path, trained=trained, sub_batch=4, search=True)
    assert r0["ranks"] == r1["ranks"] and r0["order"] == r1["order"]
    ranks = [[Action.parse(a) for a in r] for r in r0["ranks"]]
    assert all(any(a.is_encoder for a in r) and any(not a.is_encoder for a in r) for r in ranks)
    if trained:  # encoder backwards wait on the backbone's, so the two interleave
        assert any(a.is_encoder and not b.is_encoder and c.is_encoder for r in ranks for a, b, c in zip(r, r[1:], r[2:]))
    _assert_unsplit_gradients(r0, r1, trained)


def test_a_separated_plan_spread_over_more_micro_batches_gives_the_unsplit_models_gradients(datamix2_dir, tmp_path):
    """The search at size 2 with the batch spread over one more micro-batch than size 2 packs (a
    count the pipetune search also tries) runs in strict message order with the unsplit model's
    loss and gradients, the ViT trained."""
    r0, r1 = _run(datamix2_dir, tmp_path, trained=True, sub_batch=4, search=True, spread=True)
    assert r0["mbs"] == 2 and r0["micro_batches"] == r0["fewest"] + 1
    _assert_unsplit_gradients(r0, r1, True)


def test_the_trainers_parallelize_wrapper_cuts_each_part_to_its_encoder_chunks():
    """What ``PipeTuneTrainer`` hands TorchTitan for a separated job, on the meta device: every
    stage's fqns keep ``vision_encoder`` (a nested fqn would drop it), and the ``parallelize_fn``
    wrapper cuts each rank's part to its chunks' blocks, embedding and final norm before
    TorchTitan materialises it."""
    from types import SimpleNamespace

    import torch
    from torchtitan.distributed.pipeline_parallel import _split_module

    from pipetune.cost import StageLayout
    from torchtitan_patches.models.muse_glimmer.spec import muse_glimmer_spec
    from torchtitan_patches.titan.model_parts import VISION_MODULES, for_pipetune, layout_fqns

    spec = muse_glimmer_spec("heavy_vit")
    with torch.device("meta"):
        whole = spec.model.build()
    fqns = layout_fqns(StageLayout.even(8, 2), list(VISION_MODULES), separated=True)
    assert all(f[0] == "vision_encoder" for f in fqns) and "vision_adapter" in fqns[0] and "vision_adapter" not in fqns[1]
    assert _split_module(whole, ["vision_encoder.layers.3"]).vision_encoder is None  # why the trainer cuts the encoder itself
    seen = []

    def parallelize(model, *, parallel_dims, skip_dp=False, **kwargs):
        seen.append(skip_dp)
        return model

    chunks = ((0, 3), (3, 6), (6, 8), (8, 10))
    wrapped = for_pipetune(parallelize, chunks)
    for rank, blocks in ((0, [0, 1, 2, 6, 7]), (1, [3, 4, 5, 8, 9])):
        dims = SimpleNamespace(pp=2, dp_enabled=False, tp_enabled=False, get_mesh=lambda name, r=rank: SimpleNamespace(get_local_rank=lambda: r))
        part = wrapped(_split_module(whole, fqns[rank]), parallel_dims=dims, ac_config=None, dump_folder="")  # TorchTitan's keywords
        enc = part.vision_encoder
        assert sorted(int(k) for k in enc.layers.keys()) == blocks
        assert (enc.conv1_linear is not None, enc.positional_embedding_vlm is not None, enc.ln_post is not None) == (rank == 0, rank == 0,
                                                                                                                        rank == 1)
        assert all(p.is_meta for p in enc.parameters())
    assert seen == [True, True]
