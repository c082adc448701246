"""Gloo ranks executing plans: equal gradients (strict message order, fp32 and bf16, even, uneven and
multi-stage layouts, DIP's separated layout with padded image sub-microbatches, interleaved and
split-backward plans on 2 and 4 ranks with their activation memory, with and without activation
offload), varying shapes, fail-fast on inconsistent plans or data."""

import json
import re
import socket
from pathlib import Path

from dataclasses import replace

import numpy as np
import pytest

from launch import forked_ranks

WORKER = Path(__file__).with_name("pipeline_worker.py")
pytestmark = pytest.mark.timeout(150)  # on top of each rank's own timeout (run_ranks) and its gloo timeout


def run_ranks(scenario: str, data: Path, out: Path, timeout: float = 60.0, expect_ok: bool = True, world: int = 2, **opts) -> list:
    """The ``world`` ranks of ``scenario`` (forked: ``launch.forked_ranks``); a rank still running
    after ``timeout`` seconds (a hang) fails the test. With ``expect_ok=False``, returns each rank's
    exit code (None: killed after the timeout)."""
    runs = forked_ranks([str(WORKER), scenario, str(data), str(out), json.dumps(opts)], timeout, ranks=world, hang_ok=not expect_ok)
    if not expect_ok:
        return [code for code, _ in runs]
    for r, (code, log) in enumerate(runs):
        assert code == 0, f"rank {r} failed:\n{log[-3000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


# fp32: the same maths, summed in another order (observed <= 3e-7); bf16: see test_bf16_gradients_match_the_bf16_reference
FP32_TOL = 2e-5


@pytest.mark.parametrize("layout", ["even", "uneven", "two_per_rank"])
def test_reordered_repacked_precomputed_plan_gives_the_baseline_gradients(datamix2_dir, tmp_path, layout):
    """original (mbs 1, packing order) vs pipetune-style (mbs 2, other packing, non-monotone order,
    two encoders pre-computed) vs the single-process reference, with every message on one tag
    (``strict_order``: gloo then matches by posting order, as NCCL does, so an order mismatch
    fails or hangs): same loss, same gradients on every parameter. Layouts: 2+2 layers, 3+1
    layers (uneven), and four 1-layer stages V-shaped on two ranks (two stages per rank)."""
    r0, r1 = run_ranks("equal_grads", datamix2_dir, tmp_path, strict=True, layout=layout)
    assert r0["m_a"] != r0["m_b"] and sorted(r0["order_b"]) != r0["order_b"]
    assert r0["precomputed_a"] == 0 and r0["precomputed_b"] >= 2
    assert r0["params"] > 0 and r1["params"] > 0 and r0["same_ids"]
    assert r0["same_weights"] and r1["same_weights"]  # stages built alone hold the reference's weights
    if layout == "two_per_rank":
        assert r0["stages"] == [0, 3] and r1["stages"] == [1, 2]
    for r in (r0, r1):
        assert r["worst_rel_a_ref"] < FP32_TOL and r["worst_rel_b_ref"] < FP32_TOL
    last = r0 if layout == "two_per_rank" else r1
    assert last["loss_a"] == pytest.approx(last["loss_ref"], rel=1e-5)
    assert last["loss_b"] == pytest.approx(last["loss_ref"], rel=1e-5)


@pytest.mark.parametrize("layout", ["even", "two_per_rank"])
def test_trained_encoder_backward_as_its_own_action_gives_the_baseline_gradients(datamix2_dir, tmp_path, layout):
    """A trained vision encoder: stage 0's backward stops at the image features and each ``E0B``
    action back-propagates their gradient through the encoder (after an early, pre-computed
    ``E0F`` too). Every parameter's gradient, the encoder's included, equals the reference's."""
    r0, r1 = run_ranks("equal_grads", datamix2_dir, tmp_path, strict=True, layout=layout, trained=True)
    holder = r0  # the encoder sits beside stage 0, on rank 0
    assert holder["encoder_params"] > 0 and holder["encoder_backward_a"] == holder["m_a"]
    assert holder["precomputed_b"] >= 2
    for r in (r0, r1):
        assert r["worst_rel_a_ref"] < FP32_TOL and r["worst_rel_b_ref"] < FP32_TOL


def test_strict_order_catches_a_wrong_message_order(datamix2_dir, tmp_path):
    """Negative control for the strict mode: rank 1 posts two receives in swapped order. Matched by
    tag, gloo hides the bug (gradients still right); with one tag for every message the run fails
    (gloo refuses the wrongly sized message) instead of training on swapped activations."""
    tagged = run_ranks("swapped_order", datamix2_dir, tmp_path)
    assert tagged[1]["worst_rel"] < FP32_TOL
    (tmp_path / "rank1.json").unlink()
    codes = run_ranks("swapped_order", datamix2_dir, tmp_path, timeout=45, expect_ok=False, strict=True)
    assert any(c != 0 for c in codes), codes  # both ranks completing would mean gloo matched by tag after all


def test_bf16_gradients_match_the_bf16_reference(datamix2_dir, tmp_path):
    """bf16 compute (autocast; fp32 master weights, gradients and loss), strict order, four stages
    on two ranks (three stage boundaries), against the reference under the same autocast.

    Tolerance: the pipeline rounds activations and their gradients to bf16 where they cross a
    stage boundary (its messages are bf16), which the one-process reference does not; each
    rounding is up to 2^-9 relative (bf16 keeps 8 significant bits) and the layers behind it
    amplify it. Measured on this model (worst norm-wise relative error over parameter tensors):
    with fp32 messages the bf16 pipeline equals the bf16 reference exactly for plan a and within
    2.5e-3 for plan b (other packing, so other bf16 matmul shapes); with bf16 messages 1.2e-2 with
    one boundary and 1.5e-2 with three. We allow 3e-2, twice that. fp32 runs agree to 3e-7, and
    a wrong message, order or loss scaling gives errors of order 1."""
    r0, r1 = run_ranks("equal_grads", datamix2_dir, tmp_path, strict=True, dtype="bf16", layout="two_per_rank")
    for r in (r0, r1):
        assert r["worst_rel_a_ref"] < 3e-2 and r["worst_rel_b_ref"] < 3e-2, r
    assert r0["loss_a"] == pytest.approx(r0["loss_ref"], rel=1e-3)
    assert r0["loss_b"] == pytest.approx(r0["loss_ref"], rel=1e-3)


def test_consecutive_steps_with_different_counts_and_lengths(datamix2_dir, tmp_path):
    r0, r1 = run_ranks("varying_steps", datamix2_dir, tmp_path, strict=True)
    counts = [s["m"] for s in r1["steps"]]
    assert len(counts) == 5 and len(set(counts)) >= 4
    assert len({tuple(s["tokens"]) for s in r1["steps"]}) == 5
    losses = [s["loss"] for s in r1["steps"]]
    assert all(0 < x < 10 for x in losses) and losses[-1] < losses[0]


def test_inconsistent_plans_fail_fast_with_a_clear_error(datamix2_dir, tmp_path):
    r0, r1 = run_ranks("mismatch", datamix2_dir, tmp_path, timeout=50)
    for r in (r0, r1):
        assert "the ranks of replica 0 disagree about the plan or batch" in r["error"]
        assert "rank 0: " in r["error"] and "rank 1: " in r["error"]


def test_ranks_with_other_data_content_fail_naming_the_micro_batch(datamix2_dir, tmp_path):
    """Same plan and shapes, other token ids on rank 1: both ranks raise before any message."""
    r0, r1 = run_ranks("content_mismatch", datamix2_dir, tmp_path, timeout=50)
    for r in (r0, r1):
        assert r["error"] is not None and "batch content: micro-batch 1" in r["error"] and "on rank 1" in r["error"]


def test_several_stages_on_one_rank_hand_over_locally(datamix2_dir):
    """World of one rank holding all four stages (as DIP's several chunks per rank): stage
    boundaries on a rank pass tensors without messages, and gradients match the reference."""
    import datetime

    import torch
    import torch.distributed as dist

    from pipetune.config import load_model_config
    from pipetune.cost import StageLayout
    from pipetune.packing import PackingConfig
    from pipetune.plan.plan import IterationPlan
    from pipetune.schedule import Placement, one_f_one_b
    from torchtitan_patches.data import DataLoaderConfig
    from torchtitan_patches.models.reference.vlm import build_stages, build_vlm
    from torchtitan_patches.runtime.executor import PlanExecutor
    from torchtitan_patches.runtime.reference import reference_step, whole_model_names

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        model = load_model_config("tiny")
        encoder, stages = build_stages(model, list(StageLayout.even(4, 4).layer_ranges), [0, 1, 2, 3], max_seq_len=1024, seed=0,
                                       attention_backend="sdpa")
        loader = DataLoaderConfig(data=datamix2_dir, gbs=8, max_seq_len=256, packing=PackingConfig(mbs=1, max_seq_len=256))
        batch = next(iter(loader.build(model)))
        m = len(batch.micro_batches)
        table = one_f_one_b(4, list(range(m))[::-1], encoder=True)
        merged = tuple(a for r in table.ranks for a in r)
        plan = IterationPlan(step=0, mode=None, mbs=1, max_seq_len=256, micro_batches=tuple(tuple(x) for x in batch.sample_ids),
                             order=tuple(range(m))[::-1], ranks=(tuple(str(a) for a in _serial(merged)),),
                             placement=Placement((0, 0, 0, 0), (0,)), sub_mb_parent=tuple(range(m)), image_sub_batch=0,
                             predicted_s=0.0, lower_bound_s=0.0, peak_bytes=(), estimate=False).validate()
        res = PlanExecutor(stages, encoder, dim=model.backbone.dim, rank=0, strict_order=True).run(batch, plan)
        ref_encoder, ref_whole = build_vlm(model, max_seq_len=1024, seed=0, attention_backend="sdpa")
        ref_loss = reference_step(ref_encoder, ref_whole, batch)
        ref = dict(ref_whole.named_parameters())
        for stage in stages.values():
            for name, p in stage.named_parameters():
                if p.grad is not None:
                    torch.testing.assert_close(p.grad, ref[whole_model_names(stage)[name]].grad, rtol=1e-4, atol=1e-7)
        assert res.loss == pytest.approx(ref_loss, rel=1e-5)
    finally:
        dist.destroy_process_group()


def _serial(actions):
    """One rank running four stages: every action once, each after what it depends on (GPipe-like)."""
    from pipetune.schedule import Op

    fwd = [a for a in actions if a.op is Op.FORWARD]
    bwd = sorted((a for a in actions if a.op is Op.BACKWARD), key=lambda a: -a.chunk)
    return sorted(fwd, key=lambda a: (not a.is_encoder, a.chunk)) + bwd


@pytest.mark.parametrize("trained,sub_batch,seed", [(False, 2, 0), (True, 2, 1), (True, 3, 2)])
def test_separated_plan_gives_the_reference_loss_and_gradients(datamix2_dir, tmp_path, trained, sub_batch, seed):
    """DIP's separated layout on 2 ranks, every message on one tag (``strict_order``): a 5-layer
    encoder cut into 4 chunks (2+1+1+1 layers, two per rank), each micro-batch's images in
    sub-microbatches of ``sub_batch`` (the last padded), the plan's actions in a random valid order
    (micro-batches out of order, chunks interleaved): the loss and every parameter's gradient (the
    encoder's too when trained) equal the single-process reference's. Padding reaches nothing:
    the same plan with the padding images full of large noise gives bitwise the same loss and
    gradients."""
    r0, r1 = run_ranks("separated_grads", datamix2_dir, tmp_path, strict=True, trained=trained, sub_batch=sub_batch, seed=seed,
                       segments=2)
    assert r0["chunks"] == [0, 2] and r1["chunks"] == [1, 3] and r0["stages"] == [0] and r1["stages"] == [1]
    assert r0["padded"] > 0 and r0["sub_micro_batches"] > len(r0["order"])  # images split and padded
    assert r0["order"] != sorted(r0["order"])
    for r in (r0, r1):
        assert r["ref_params_here"] and max(r["errors"].values()) < FP32_TOL, r
        assert (r["encoder_params"] > 0) == trained and (r["encoder_backward"] > 0) == trained
        assert r["noise_equal"]
    assert r1["loss"] == pytest.approx(r1["loss_ref"], rel=1e-5) and r1["loss_noisy"] == r1["loss"]


def test_separated_plan_in_bf16_matches_the_bf16_reference(datamix2_dir, tmp_path):
    """bf16 compute on the separated layout (trained encoder): encoder activations and features
    are bf16 messages (three encoder chunk boundaries, one feature hand-over, one backbone
    boundary), against the reference under the same autocast; tolerance as
    ``test_bf16_gradients_match_the_bf16_reference`` (measured worst 1.4e-2). Left out: the
    ViT's key biases, whose gradient is zero in exact arithmetic (a softmax does not change when a
    constant is added to all of a query's scores), so both sides hold only rounding noise
    (relative error of order 1 in bf16, 2e-7 in fp32)."""
    r0, r1 = run_ranks("separated_grads", datamix2_dir, tmp_path, strict=True, trained=True, sub_batch=2, seed=3, dtype="bf16")
    for r in (r0, r1):
        errors = {n: e for n, e in r["errors"].items() if not n.endswith("attn.wk.bias")}
        assert len(errors) > 0.9 * len(r["errors"]) and max(errors.values()) < 3e-2, r
        assert r["noise_equal"]
    assert r1["loss"] == pytest.approx(r1["loss_ref"], rel=1e-3)


def test_strict_order_catches_a_wrong_message_order_in_a_separated_plan(datamix2_dir, tmp_path):
    """Negative control for separated plans: rank 1 posts an encoder activation's and a backbone
    activation's receive first, swapped. Matched by tag, gloo hides it (gradients right); with
    one tag for every message gloo matches by order, as NCCL does, and the step fails."""
    tagged = run_ranks("separated_swapped", datamix2_dir, tmp_path)
    assert tagged[1]["worst_rel"] < FP32_TOL and tagged[0]["worst_rel"] < FP32_TOL
    (tmp_path / "rank1.json").unlink()
    codes = run_ranks("separated_swapped", datamix2_dir, tmp_path, timeout=25, expect_ok=False, strict=True, timeout_s=5)
    assert any(c != 0 for c in codes), codes


def _one_rank_separated(datamix2_dir, *, trained: bool):
    """A separated plan on one rank holding the backbone and both chunks of a 3-layer encoder (all
    hand-overs local), images in sub-microbatches of 2; the model, batch and plan."""
    from dataclasses import replace

    import numpy as np

    from pipetune.config import load_model_config
    from pipetune.packing import PackingConfig
    from pipetune.plan.plan import plan_from_table
    from random_schedules import separated_table
    from torchtitan_patches.data import DataLoaderConfig

    model = load_model_config("tiny")
    model = replace(model, encoder=replace(model.encoder, n_layers=3, frozen=not trained))
    batch = next(iter(DataLoaderConfig(data=datamix2_dir, gbs=8, max_seq_len=256, packing=PackingConfig(mbs=2, max_seq_len=256)).build(model)))
    images = [mb.num_images for mb in batch.micro_batches]
    table = separated_table(np.random.default_rng(0), ranks=1, segments=2, images_per_mb=images, image_sub_batch=2, trained=trained)
    plan = plan_from_table(table, step=0, micro_batches=batch.sample_ids, order=range(len(images)), mbs=2, max_seq_len=256,
                           image_sub_batch=2).validate()
    return model, batch, plan


def _world_of_one():
    import datetime

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    return dist


def test_separated_plan_on_one_rank_hands_over_locally(datamix2_dir):
    """Encoder chunks and the backbone on one rank: encoder activations and image features pass
    between chunks without messages; a trained encoder's gradients equal the reference's."""
    import torch

    from torchtitan_patches.models.reference.vlm import build_encoder_chunks, build_stages, build_vlm
    from torchtitan_patches.runtime.executor import ImageShapes, PlanExecutor
    from torchtitan_patches.runtime.reference import reference_step, whole_model_names

    model, batch, plan = _one_rank_separated(datamix2_dir, trained=True)
    dist = _world_of_one()
    try:
        chunks = build_encoder_chunks(model, [(0, 1), (1, 3)], [0, 1], seed=0)
        _, stages = build_stages(model, [(0, 4)], [0], max_seq_len=1024, seed=0, attention_backend="sdpa", colocated_encoder=False)
        res = PlanExecutor(stages, chunks, dim=model.backbone.dim, rank=0, strict_order=True,
                           image_shapes=ImageShapes.of(model.encoder)).run(batch, plan)
        ref_encoder, ref_whole = build_vlm(model, max_seq_len=1024, seed=0, attention_backend="sdpa")
        assert res.loss == pytest.approx(reference_step(ref_encoder, ref_whole, batch), rel=1e-5)
        ref = {**{f"encoder.{n}": p for n, p in ref_encoder.named_parameters()}, **dict(ref_whole.named_parameters())}
        pieces = [("encoder.", c) for c in chunks.values()] + [("", stages[0])]
        for prefix, module in pieces:
            for name, p in module.named_parameters():
                torch.testing.assert_close(p.grad, ref[prefix + whole_model_names(module)[name]].grad, rtol=1e-4, atol=1e-7)
    finally:
        dist.destroy_process_group()


def test_a_model_built_for_another_layout_is_refused_before_any_message(datamix2_dir):
    """The executor checks the plan against the chunks this rank holds: a separated plan on a model
    built co-located, on a model whose encoder is cut into other chunks, on chunks of two cuts
    that skip a layer, or without the message shapes of the encoder, is a ``PlanError`` naming
    what is wrong, not a hang or a wrong model."""
    from pipetune.plan.plan import PlanError
    from torchtitan_patches.models.reference.vlm import build_encoder_chunks, build_stages
    from torchtitan_patches.runtime.executor import ImageShapes, PlanExecutor, PlanMismatchError

    model, batch, plan = _one_rank_separated(datamix2_dir, trained=False)
    encoder, stages = build_stages(model, [(0, 4)], [0], max_seq_len=1024, seed=0, attention_backend="sdpa")
    shapes = ImageShapes.of(model.encoder)
    with pytest.raises(PlanError, match="encoder chunks \\[0, 1\\] on rank 0, which holds encoder chunks \\[0\\]"):
        PlanExecutor(stages, encoder, dim=model.backbone.dim, rank=0, image_shapes=shapes).run(batch, plan)
    whole_as_two = {0: encoder, 1: build_encoder_chunks(model, [(0, 1), (1, 3)], [1])[1]}
    with pytest.raises(PlanError, match="encoder chunk 0 is its first chunk, but this rank's is the whole module"):
        PlanExecutor(stages, whole_as_two, dim=model.backbone.dim, rank=0, image_shapes=shapes).run(batch, plan)
    chunks = build_encoder_chunks(model, [(0, 1), (1, 3)], [0, 1])
    with pytest.raises(PlanError, match="give the executor image_shapes"):
        PlanExecutor(stages, chunks, dim=model.backbone.dim, rank=0).run(batch, plan)
    two_cuts = {0: chunks[0], 1: build_encoder_chunks(model, [(0, 2), (2, 3)], [1])[1]}  # layers 0, then 2: layer 1 never runs
    dist = _world_of_one()
    try:
        with pytest.raises(PlanMismatchError, match="do not cut the encoder into consecutive layer ranges \\(rank 0: \\{0: \\(0, 1\\), 1: \\(2, 3\\)"):
            PlanExecutor(stages, two_cuts, dim=model.backbone.dim, rank=0, image_shapes=shapes).run(batch, plan)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("moved,before,message", [("R", None, "(0B0): needs 0R0"), ("O", "F", "(0O0): needs 0F0")])
def test_an_offload_plan_with_misplaced_copies_is_refused_before_any_message(datamix2_dir, moved, before, message):
    """A plan whose ``R`` comes after the backward that needs it (moved to the end of the list), or
    whose ``O`` comes before its forward, is a ``ScheduleError`` naming the action when the executor lowers it,
    before any message or collective."""
    from pipetune.schedule import Action, Op, ScheduleError
    from pipetune.schedule.offload import with_offload
    from torchtitan_patches.models.reference.vlm import build_encoder_chunks, build_stages
    from torchtitan_patches.runtime.executor import ImageShapes, PlanExecutor

    model, batch, plan = _one_rank_separated(datamix2_dir, trained=False)
    acts = list(with_offload(plan.table(), [(0, 0)]).ranks[0])
    copy = acts.pop(acts.index(Action(0, Op(moved), 0)))
    acts.insert(acts.index(Action(0, Op(before), 0)) if before else len(acts), copy)
    bad = replace(plan, ranks=(tuple(str(a) for a in acts),))
    chunks = build_encoder_chunks(model, [(0, 1), (1, 3)], [0, 1], seed=0)
    _, stages = build_stages(model, [(0, 4)], [0], max_seq_len=1024, seed=0, attention_backend="sdpa", colocated_encoder=False)
    ex = PlanExecutor(stages, chunks, dim=model.backbone.dim, rank=0, image_shapes=ImageShapes.of(model.encoder))
    with pytest.raises(ScheduleError, match=re.escape(message)):
        ex.run(batch, bad)  # no process group: a collective would fail


def test_each_wait_blocks_on_its_own_message_only(datamix2_dir, tmp_path):
    """Three ranks, 1F1B, strict order: the middle rank posts receives of a forward's activation and
    of a backward's gradient together. With ``batch_isend_irecv`` made to return one work per batch
    (as NCCL's does), a wait must still cover exactly its own receive. (The former executor, one
    ``batch_isend_irecv`` per post, fails here: its waits cover the whole post, and this plan then
    hangs until gloo's timeout.)"""
    ranks = run_ranks("message_waits", datamix2_dir, tmp_path, world=3, strict=True)
    assert ranks[1]["posts_with_forward_and_backward_receives"] > 0  # the case the old grouping got wrong
    for r, res in enumerate(ranks):
        assert res["waits_covering"] == [1] * res["wait_steps"], f"rank {r}"
    assert ranks[2]["loss"] > 0


def _activation_peaks(plan, ranks: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, the peaks the simulator predicts for ``plan``'s table: of saved activations alone,
    and with a split backward's held output gradients (``Buffer.WEIGHT_GRAD``, from ``I`` to
    ``W``). Each chunk's bytes are its measured bytes per token x the micro-batch's tokens (a
    trained encoder's per image x images), so only lifetimes are checked; the held bytes per token
    are also checked against the cost model's count of weight-operation outputs."""
    from pipetune.config import load_hardware, load_model_config
    from pipetune.cost import CostModel, MicroBatchShapes, StageLayout, analytical_table
    from pipetune.simulate.simulator import Latencies, simulate

    table = plan.table()
    m, S = plan.num_micro_batches, plan.num_stages
    per = {k: v for r in ranks for k, v in r["bytes_per_token"].items()}
    tokens, images = np.array(ranks[0]["tokens"], float), np.array(ranks[0]["images"], float)
    saved = tokens[:, None] * np.array([per[str(c)] for c in range(S)])[None, :]
    held = tokens[:, None] * np.array([per.get(f"held{c}", 0.0) for c in range(S)])[None, :]
    encoder = images * per.get("encoder_per_image", 0.0)
    lat = Latencies(np.ones((m, S)), 2 * np.ones((m, S)), activation_bytes=saved,
                    encoder_activation_bytes=encoder if plan.placement.encoder_trained else None)
    if table.split_backward:
        model = load_model_config("tiny")  # as the worker builds it
        model = replace(model, backbone=replace(model.backbone, n_layers=max(model.backbone.n_layers, S)),
                        encoder=replace(model.encoder, frozen=not plan.placement.encoder_trained))
        cost = CostModel(analytical_table(model, load_hardware("a100"), tp=1),
                         StageLayout.even(model.backbone.n_layers, S, chunks_per_rank=S // len(table.ranks), style=plan.placement.style))
        j = max(range(m), key=lambda k: (images[k] > 0, tokens[k]))  # the micro-batch the worker measured on
        one = MicroBatchShapes(tokens[[j]], np.array([0]), tokens[[j]].astype(np.int64), images[[j]].astype(np.int64))
        counted = cost.stage_costs(one).weight_grad_bytes[0] / tokens[j] * 4 / cost.dtype_bytes  # the worker runs fp32
        measured = np.array([per.get(f"held{c}", 0.0) for c in range(S)])
        np.testing.assert_allclose(measured, counted, rtol=0.02, err_msg="held bytes per token vs the cost model's count")
    return simulate(table, lat).peak_bytes, simulate(table, replace(lat, weight_grad_bytes=held)).peak_bytes


def _offload_frees(plan, ranks: list[dict]) -> None:
    """Offloaded activations as the runtime's tracker sees them (the simulator's copies are not
    compared here): each ``O``, right after its forward, drops the live saved bytes by what that
    forward saved (all of it when the chunk's input came as a message; chunk 0 keeps the image
    features, a chunk fed by a hand-over on its own rank keeps that input: they are other buffers),
    within 5 % of the chunk's bytes per token times the micro-batch's tokens (what the memory model
    charges), and its ``R`` takes exactly as many bytes back."""
    from pipetune.schedule import Action, Op

    per = {k: v for r in ranks for k, v in r["bytes_per_token"].items()}
    tokens = ranks[0]["tokens"]
    for r, res in enumerate(ranks):
        reloaded = {a: after - before for a, before, after in res["reloads"]}
        assert len(reloaded) == len(res["offloads"]) > 0
        for o, f, before_f, after_f, after_o in res["offloads"]:
            a = Action.parse(o)
            saved, freed = after_f - before_f, after_f - after_o
            assert f == str(Action(a.chunk, Op.FORWARD, a.unit)), f"rank {r}: {o} right after its forward"
            by_message = a.chunk > 0 and plan.placement.backbone[a.chunk - 1] != r
            assert freed == saved if by_message else 0.9 * saved < freed <= saved, f"rank {r}: {o} freed {freed} of {saved}"
            assert freed == pytest.approx(per[str(a.chunk)] * tokens[a.unit], rel=0.05), f"rank {r}: {o}"
            assert reloaded[str(Action(a.chunk, Op.RELOAD, a.unit))] == freed, f"rank {r}: {o}"


@pytest.mark.parametrize("world,chunks,split,trained,seed,style", [
    (2, 1, False, False, 0, "loop"),  # 1F1B from the list scheduler (memory reference)
    (2, 2, False, False, 0, "loop"),  # interleaved, encoders pre-computed
    (2, 1, True, True, 3, "loop"),  # ZB-H1, trained encoder
    (2, 2, True, False, 2, "loop"),  # interleaved zero-bubble
    (2, 2, True, True, 3, "loop"),
    (4, 2, False, True, 4, "loop"),
    (4, 2, True, False, 5, "loop"),
    (2, 2, True, False, 6, "v"),  # V-shaped zero-bubble, encoders pre-computed
    (2, 2, False, True, 7, "v"),  # V-shaped whole backwards, trained encoder
    (4, 2, True, True, 8, "v"),
    (4, 2, False, False, 9, "v"),
    (2, 2, True, True, 10, "DualPipeV"),  # torch's V tables, as the planner may pick them
    (2, 2, True, False, 11, "ZBVZeroBubble"),
    (2, 1, False, False, 12, "loop+offload"),  # activation offload: every chunk of the first two micro-batches in order
    (2, 2, True, True, 13, "loop+offload"),
    (4, 2, True, False, 14, "loop+offload"),
    (4, 2, False, True, 15, "v+offload"),  # V: the last rank's second chunk gets its input by hand-over, not by message
])
def test_interleaved_and_split_backward_plans_give_the_reference_gradients(datamix2_dir, tmp_path, world, chunks, split, trained, seed,
                                                                            style):
    """Virtual stages (``chunks`` backbone chunks per rank, chunk c on rank c mod P; or V-shaped,
    chunks r and 2P - 1 - r on rank r, the first and last chunk and the encoder on rank 0) and split
    backward (every backbone backward an ``I`` then a ``W``, torch's ``stage_backward_input`` /
    ``stage_backward_weight``), alone and together, on 2 and 4 gloo ranks, with a random
    micro-batch order, every message on one tag (gloo matches by order, as NCCL does): the loss and
    every parameter's gradient (the encoder's when trained; none zero) equal the single-process
    reference's, and the table passes the in-order transport simulation. ``+offload``: the same with
    every chunk of the first two micro-batches offloaded (``O`` after the forward, ``R`` one compute
    action ahead of the gradient action): the copies ran, in the plan's order.

    Memory, measured per action (``measure_activations``): the saved activations' peak on every
    rank is within 10 % of the simulator's prediction for the same table (they live from ``F`` to
    ``B``, or to ``W``); with a split backward the runtime also holds, from ``I`` to ``W``, the
    output gradients of every weight's operation (torch's parameter groups): the whole measured
    peak is within 10 % of the simulator's with those buffers, whose size per token the cost model
    counts. With offload, what each ``O`` frees and its ``R`` takes back instead (``_offload_frees``):
    the simulator does not model copies yet."""
    from pipetune.plan.plan import IterationPlan
    from unit.test_lowering_fifo import check

    style, _, offload = style.partition("+")
    torch_table = style if style in ("DualPipeV", "ZBVZeroBubble") else None
    style = "v" if torch_table else style
    ranks = run_ranks("interleaved_grads", datamix2_dir, tmp_path, world=world, timeout=90, chunks_per_rank=chunks, split=split,
                      trained=trained, seed=seed, style=style, torch_table=torch_table, offload=2 if offload else 0)
    plan = IterationPlan.from_json(ranks[0]["plan"])
    check(plan.table())
    assert plan.order != tuple(sorted(plan.order)) and plan.num_micro_batches >= world
    assert plan.placement.style.value == (style if chunks > 1 else "loop")
    if torch_table:
        from pipetune.schedule.schedules import dual_pipe_v, zbv_zero_bubble

        backbone = lambda t: [[a for a in r if not a.is_encoder] for r in t.ranks]  # noqa: E731
        assert backbone(plan.table()) == backbone({"DualPipeV": dual_pipe_v, "ZBVZeroBubble": zbv_zero_bubble}[torch_table](world, plan.order))
    for r, res in enumerate(ranks):
        assert res["stages"] == ([r, 2 * world - 1 - r] if style == "v" else list(range(r, chunks * world, world)))
        want = ({"F", "I", "W"} | ({"B"} if trained and r == 0 else set())) if split else {"F", "B"}
        assert set(res["ops"]) == want | ({"O", "R"} if offload else set())
        assert res["copies_ran"] == [a for a in plan.ranks[r] if a[-2] in "OR"] and (len(res["copies_ran"]) > 0) == bool(offload)
        assert res["ref_params_here"] and not res["zero_grads"] and max(res["errors"].values()) < FP32_TOL, res["errors"]
    assert (ranks[0]["encoder_backward"] > 0) == trained
    assert (ranks[0]["precomputed"] >= 2) == (not trained)
    last = ranks[plan.placement.backbone[-1]]  # the loss's rank: rank 0 in a V
    assert last["loss"] == pytest.approx(last["loss_ref"], rel=1e-5)
    if offload:
        _offload_frees(plan, ranks)
    else:
        simulated, with_held = _activation_peaks(plan, ranks)
    for r, res in enumerate(ranks):
        trace = np.array(res["activation_trace"])
        if not offload:
            assert trace[:, 0].max() == pytest.approx(simulated[r], rel=0.1), f"rank {r}: saved activations"
            assert res["activation_peak"] == pytest.approx(with_held[r], rel=0.1), f"rank {r}: saved activations and held gradients"
        assert (trace[:, 1].max() > 0) == split and trace[-1].sum() < 0.02 * trace[:, 0].max()  # all freed by the step's end
