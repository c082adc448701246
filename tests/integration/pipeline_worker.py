"""One rank of a gloo pipeline test (run by tests/test_pipeline_runtime.py, not by pytest).

usage: python pipeline_worker.py SCENARIO DATA_DIR OUT_DIR [OPTIONS_JSON]  (RANK, WORLD_SIZE, MASTER_PORT in env)
Writes OUT_DIR/rank{r}.json with what the scenario measured. Options: ``strict`` (every message
with one tag, so gloo matches by order as NCCL does), ``dtype`` (``fp32`` or ``bf16``), ``layout``
(``even``, ``uneven`` = 3+1 layers, ``two_per_rank`` = four 1-layer stages, V-shaped on 2 ranks),
``trained`` (train the vision encoder: its backward runs as the plan's own encoder backward
actions); separated scenarios: ``segments`` (K), ``sub_batch`` (B), ``seed`` (of the random order);
``interleaved_grads`` (any world size): ``chunks_per_rank`` (V), ``split`` (split backward), ``mbs``,
``gbs``, ``trained``, ``seed``, ``offload`` (activation offload of the first micro-batches in order,
every chunk; ``lead``: reload that many compute actions ahead).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.pipelining._backward import stage_backward_input
from random_schedules import packed_separated_plan
from recorded_stream import RecordedStream

from pipetune.config import load_model_config
from pipetune.cost import StageLayout
from pipetune.packing import PackingConfig
from pipetune.plan.plan import build_plan, plan_from_table
from pipetune.schedule import Action, Op, onto_ranks, place_encoders
from pipetune.schedule.offload import with_offload
from pipetune.schedule.schedules import UNIT_TIME, dual_pipe_v, list_scheduled, zbv_zero_bubble
from pipetune.schedule.lowering import Direction, MessageKind, Post, Wait, lower
from pipetune.schedule.table import ChunkStyle, Placement
from torchtitan_patches.data import DataLoaderConfig
from torchtitan_patches.models.packed_attention import varlen_metadata
from torchtitan_patches.models.reference.vlm import build_encoder_chunks, build_stages, build_vlm, token_loss_sum
from torchtitan_patches.runtime import executor as executor_module
from torchtitan_patches.runtime.executor import ImageShapes, PlanExecutor, PlanMismatchError
from torchtitan_patches.runtime.memory import SavedActivations, storage_bytes
from torchtitan_patches.runtime.reference import reference_step, whole_model_names

MAX_SEQ_LEN = 256
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LAYOUTS = {  # layer ranges, stage -> rank
    "even": ([(0, 2), (2, 4)], (0, 1)),
    "uneven": ([(0, 3), (3, 4)], (0, 1)),
    "two_per_rank": ([(0, 1), (1, 2), (2, 3), (3, 4)], (0, 1, 1, 0)),
}


def setup(rank: int, world: int, opts: dict | None = None):
    opts = opts or {}
    model = load_model_config("tiny")
    if opts.get("trained"):
        model = replace(model, encoder=replace(model.encoder, frozen=False))
    ranges, stage_rank = LAYOUTS[opts.get("layout", "even")] if world == 2 else (list(StageLayout.even(model.backbone.n_layers, world).layer_ranges), tuple(range(world)))
    local = [s for s, r in enumerate(stage_rank) if r == rank]
    encoder, stages = build_stages(model, ranges, local, max_seq_len=4 * MAX_SEQ_LEN, seed=0, attention_backend="sdpa")
    executor = PlanExecutor(stages, encoder, dim=model.backbone.dim, rank=rank, strict_order=opts.get("strict", False),
                            compute_dtype=DTYPES[opts.get("dtype", "fp32")])
    return model, stages, executor, stage_rank


def loader(model, data, gbs, groups_of):
    cfg = DataLoaderConfig(data=data, gbs=gbs, max_seq_len=MAX_SEQ_LEN, packing=PackingConfig(max_seq_len=MAX_SEQ_LEN))
    ld = cfg.build(model, packing_source=groups_of)
    ld.stream = RecordedStream(len(ld.store), gbs)  # the batches these scenarios' checks were made on
    return ld


def plan_for(model, meta, *, packer: str, mbs: int, order=None, encoder_before=None, stage_rank=(0, 1)):
    packing = PackingConfig(packer=packer, mbs=mbs, max_seq_len=MAX_SEQ_LEN).build(model)(meta.table.lengths, meta.step)
    groups = [meta.table.ids[g].tolist() for g in packing.groups()]
    m = len(groups)
    order = list(order) if order is not None else list(range(m))
    plan = build_plan(step=meta.step, micro_batches=groups, order=order, num_stages=len(stage_rank), encoder=True, mbs=mbs,
                      max_seq_len=MAX_SEQ_LEN, encoder_trained=not model.encoder.frozen)
    table = plan.table()
    if stage_rank != tuple(range(len(stage_rank))):
        table = onto_ranks(table, stage_rank)
    if encoder_before:
        table = place_encoders(table, encoder_before)
    return replace(plan, ranks=tuple(tuple(str(a) for a in r) for r in table.ranks), placement=table.placement).validate()


def batch_for(model, data, gbs, plan):
    return next(iter(loader(model, data, gbs, lambda meta: [list(mb) for mb in plan.micro_batches])))


def grads(stages, encoder=None) -> dict[str, torch.Tensor]:
    """Gradients by the whole model's parameter names (the encoder's, of its chunks by chunk index,
    prefixed ``encoder.``)."""
    out = {}
    for prefix, modules in (("", stages), ("encoder.", encoder or {})):
        for module in modules.values():
            names = whole_model_names(module)
            out.update({prefix + names[n]: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
    return out


def zero_grads(*modules) -> None:
    for m in modules:
        m.zero_grad(set_to_none=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error of a gradient tensor."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def equal_grads(rank, world, data, opts):
    """Plan a = original packing, mbs 1, packing order; plan b = balanced, mbs 2, non-monotone
    order, two encoders pre-computed; both against the single-process reference run in the same
    compute dtype. Records, per parameter, the norm-wise relative gradient error (the test sets
    the tolerance)."""
    model, stages, ex, stage_rank = setup(rank, world, opts)
    encoder = ex.encoder
    gbs = 12
    meta = loader(model, data, gbs, None).meta(0)
    plan_a = plan_for(model, meta, packer="original", mbs=1, stage_rank=stage_rank)
    m = plan_for(model, meta, packer="balanced", mbs=2).num_micro_batches
    order = [m - 1] + list(range(0, m - 1, 2)) + list(range(1, m - 1, 2))  # non-monotone
    plan_b = plan_for(model, meta, packer="balanced", mbs=2, order=order, encoder_before={order[-1]: 1, order[-2]: 0},
                      stage_rank=stage_rank)
    out = {"m_a": plan_a.num_micro_batches, "m_b": plan_b.num_micro_batches, "order_b": order, "stages": sorted(stages)}
    results = {}
    for name, plan in (("a", plan_a), ("b", plan_b)):
        batch = batch_for(model, data, gbs, plan)
        res = ex.run(batch, plan)
        results[name] = (res.loss, grads(stages, encoder), batch)
        out[f"precomputed_{name}"] = sum(t.precomputed for t in res.timeline)
        out[f"encoder_backward_{name}"] = sum(t.action.is_encoder and t.action.op is Op.BACKWARD for t in res.timeline)
        zero_grads(*stages.values(), *encoder.values())
    ref_encoder, whole = build_vlm(model, max_seq_len=4 * MAX_SEQ_LEN, seed=0, attention_backend="sdpa")
    ref_loss = reference_step(ref_encoder, whole, results["a"][2], DTYPES[opts.get("dtype", "fp32")])
    ref = grads({0: whole}, {0: ref_encoder})
    out["same_weights"] = all(torch.equal(p, dict(whole.named_parameters())[whole_model_names(st)[n]])
                              for st in stages.values() for n, p in st.named_parameters())
    out["worst_rel_a_ref"] = max(rel_err(g, ref[n]) for n, g in results["a"][1].items())
    out["worst_rel_b_ref"] = max(rel_err(results["b"][1][n], ref[n]) for n in results["a"][1])
    out.update(params=len(results["a"][1]), encoder_params=sum(n.startswith("encoder.") for n in results["a"][1]),
               loss_a=results["a"][0], loss_b=results["b"][0], loss_ref=ref_loss,
               same_ids=sorted(sum(results["a"][2].sample_ids, [])) == sorted(sum(results["b"][2].sample_ids, [])))
    return out


def varying_steps(rank, world, data, opts):
    """Five steps, each with its own mbs (so micro-batch count and lengths) and a random order."""
    model, stages, ex, _ = setup(rank, world, opts)
    opt = torch.optim.AdamW([p for st in stages.values() for p in st.parameters() if p.requires_grad], lr=1e-3)
    rng = np.random.default_rng(0)
    plans = {}

    def source(meta):
        mbs = [1, 3, 2, 4, 1][meta.step]
        m = plan_for(model, meta, packer="balanced", mbs=mbs).num_micro_batches
        plans[meta.step] = plan_for(model, meta, packer="balanced", mbs=mbs, order=rng.permutation(m).tolist(),
                                    encoder_before={0: 0} if m > 1 else None)
        return [list(g) for g in plans[meta.step].micro_batches]

    ld = DataLoaderConfig(data=data, gbs=16, max_seq_len=MAX_SEQ_LEN, packing=PackingConfig(max_seq_len=MAX_SEQ_LEN),
                          max_steps=5).build(model, packing_source=source)
    out = {"steps": []}
    for batch in ld:
        res = ex.run(batch, plans[batch.step])
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["steps"].append({"m": len(batch.micro_batches), "tokens": [mb.num_tokens for mb in batch.micro_batches],
                             "loss": res.loss, "overhead_s": res.overhead_s})
    return out


def mismatch(rank, world, data, opts):
    model, stages, ex, _ = setup(rank, world, opts)
    meta = loader(model, data, 12, None).meta(0)
    plan = plan_for(model, meta, packer="balanced", mbs=1 if rank == 0 else 2)
    batch = batch_for(model, data, 12, plan)
    try:
        ex.run(batch, plan)
    except PlanMismatchError as e:
        return {"error": str(e)}
    return {"error": None}


def content_mismatch(rank, world, data, opts):
    """Same plan and shapes on both ranks, but rank 1's token ids differ in one micro-batch (as
    when ranks read data sets with the same metadata and other content)."""
    model, stages, ex, _ = setup(rank, world, opts)
    meta = loader(model, data, 12, None).meta(0)
    plan = plan_for(model, meta, packer="balanced", mbs=2)
    batch = batch_for(model, data, 12, plan)
    if rank == 1:
        mb = batch.micro_batches[1]
        mb.tokens = (mb.tokens + 1) % model.backbone.vocab_size
    try:
        ex.run(batch, plan)
    except PlanMismatchError as e:
        return {"error": str(e)}
    return {"error": None}


def swapped_order(rank, world, data, opts):
    """Rank 1 posts its first two receives up front, in swapped order (a lowering bug). With tags gloo
    still pairs each message with its buffer; with ``strict`` (one tag) it pairs them by order,
    as NCCL does, and the step must fail rather than train."""
    import torchtitan_patches.runtime.executor as executor

    def swapped(table, r):
        steps = lower(table, r)
        if r != 1:
            return steps
        recvs = [t for s in steps if isinstance(s, Post) for t in s.transfers if t.direction is Direction.RECV][:2]
        rest = [Post(tuple(t for t in s.transfers if t not in recvs)) if isinstance(s, Post) else s for s in steps]
        return [Post((recvs[1], recvs[0]))] + [s for s in rest if not (isinstance(s, Post) and not s.transfers)]

    executor.lower = swapped
    model, stages, ex, _ = setup(rank, world, opts)
    meta = loader(model, data, 12, None).meta(0)
    plan = plan_for(model, meta, packer="original", mbs=1)
    batch = batch_for(model, data, 12, plan)
    res = ex.run(batch, plan)
    encoder, whole = build_vlm(model, max_seq_len=4 * MAX_SEQ_LEN, seed=0, attention_backend="sdpa")
    reference_step(encoder, whole, batch)
    ref = {n: p.grad for n, p in whole.named_parameters() if p.grad is not None}
    return {"worst_rel": max(rel_err(g, ref[n]) for n, g in grads(stages).items()), "loss": res.loss}


def interleaved_setup(rank: int, world: int, opts: dict):
    """The tiny model (``world * V`` layers if it has fewer) in ``world * V`` backbone chunks, chunk
    ``c`` on rank ``c mod world`` (TorchTitan's ``Interleaved1F1B`` layout), or V-shaped (``style``
    ``v``: chunks ``r`` and ``2 world - 1 - r`` on rank ``r``); every message on one tag; activation
    memory measured."""
    V, style = opts.get("chunks_per_rank", 2), ChunkStyle(opts.get("style", "loop"))
    model = load_model_config("tiny")
    model = replace(model, backbone=replace(model.backbone, n_layers=max(model.backbone.n_layers, V * world)),
                    encoder=replace(model.encoder, frozen=not opts.get("trained")))
    ranges = list(StageLayout.even(model.backbone.n_layers, V * world).layer_ranges)
    own = [c for c, r in enumerate(Placement.virtual(world, V, style).backbone) if r == rank]
    encoder, stages = build_stages(model, ranges, own, max_seq_len=4 * MAX_SEQ_LEN, seed=0, attention_backend="sdpa")
    ex = PlanExecutor(stages, encoder, dim=model.backbone.dim, rank=rank, strict_order=True, measure_activations=True)
    return model, stages, ex


def interleaved_plan(model, meta, world: int, opts: dict):
    """Balanced packing at ``mbs``, a random order (``seed``), the planner's interleaved 1F1B or
    zero-bubble table (``split``; its ``W`` placed by uneven durations, as the planner places them
    by a batch's latencies) of ``chunks_per_rank`` chunks per rank in ``style``, or torch's own V
    table (``torch_table``); a frozen encoder's last two forwards pre-computed; with ``offload``,
    every chunk of the first ``offload`` micro-batches in order (whose activations live longest)
    offloaded, each reloaded ``lead`` compute actions before its gradient action."""
    mbs = opts.get("mbs", 2)
    packing = PackingConfig(packer="balanced", mbs=mbs, max_seq_len=MAX_SEQ_LEN).build(model)(meta.table.lengths, meta.step)
    groups = [meta.table.ids[g].tolist() for g in packing.groups()]
    order = np.random.default_rng(opts.get("seed", 0)).permutation(len(groups)).tolist()
    trained = not model.encoder.frozen
    V, split = opts.get("chunks_per_rank", 2), opts.get("split", False)
    unit, chunk = np.indices((len(groups), V * world))
    ops = (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT) if split else (Op.FORWARD, Op.BACKWARD)
    uneven = {op: UNIT_TIME[op] * (1 + (5 * unit + 3 * chunk) % 4) for op in ops}  # W placed as by a batch's latencies
    table = list_scheduled(world, V, order, split_backward=split, encoder=True, encoder_trained=trained, times=uneven,
                           style=ChunkStyle(opts.get("style", "loop")))
    if opts.get("torch_table"):  # torch's own V table instead (the planner tries them too)
        table = {"ZBVZeroBubble": zbv_zero_bubble, "DualPipeV": dual_pipe_v}[opts["torch_table"]](world, order, encoder=True,
                                                                                                  encoder_trained=trained)
    if not trained and len(order) > 2:
        table = place_encoders(table, {order[-1]: 1, order[-2]: 0})
    if opts.get("offload"):
        table = with_offload(table, [(c, u) for u in order[:opts["offload"]] for c in range(table.num_stages)], lead=opts.get("lead", 1))
    return plan_from_table(table, step=meta.step, micro_batches=groups, order=order, mbs=mbs, max_seq_len=MAX_SEQ_LEN).validate()


def chunk_bytes_per_token(model, stages, encoder, mb) -> dict:
    """Activation bytes per token of one forward of each of this rank's chunks on micro-batch
    ``mb`` (its loss on the last chunk), and a trained encoder's per image: what the plan's memory
    model multiplies by each micro-batch's tokens (images). ``held``: per chunk and token, the
    output gradients torch's ``stage_backward_input`` keeps for the weight gradient (a split
    backward's memory beside the activations)."""
    inputs = [mb.tokens, mb.positions, mb.pixel_values]
    exclude = [*inputs, *(t for m in (*stages.values(), *([encoder] if encoder else [])) for t in (*m.parameters(), *m.buffers()))]
    kwargs = {"positions": mb.positions[None], "masks": varlen_metadata(mb.cu_seqlens, "cpu"), "image_spans": mb.image_spans}
    trained = encoder is not None and not model.encoder.frozen
    out = {}
    if encoder is not None:
        with SavedActivations(exclude) as saved, torch.set_grad_enabled(trained):
            feats = encoder(mb.pixel_values, mb.image_grids)
            if trained:
                out["encoder_per_image"] = saved.live_bytes() / mb.num_images
    for c, stage in stages.items():
        if stage.is_first:
            x = mb.tokens[None]
            extra = {"image_features": feats.detach().requires_grad_(trained)}
        else:
            x, extra = torch.randn(1, mb.num_tokens, model.backbone.dim, requires_grad=True), {}
        with SavedActivations(exclude) as saved:
            y = stage(x, **kwargs, **extra)
            if stage.is_last:
                y = token_loss_sum(y, mb.labels[None]) / mb.num_label_tokens
            out[c] = saved.live_bytes() / mb.num_tokens
        inputs = [t for t in (x, extra.get("image_features")) if t is not None and t.requires_grad]
        if inputs:
            _, groups = stage_backward_input([y], None if stage.is_last else [torch.ones_like(y)], inputs,
                                             (p for p in stage.parameters() if p.requires_grad))
            held = [g for group in groups for grads in group.get("grads") or () for g in grads or () if g is not None]
            out[f"held{c}"] = storage_bytes(held) / mb.num_tokens
        del y
    return out


def interleaved_grads(rank, world, data, opts):
    """An interleaved (``chunks_per_rank``) and/or split-backward plan against the single-process
    reference: per parameter the norm-wise relative gradient error; the activation memory the run
    measured and each chunk's bytes per token (for the test's prediction); the copies that ran and
    the saved bytes around them: per ``O``, before its forward (the action before it), after that
    and after the ``O``; per ``R``, before and after it."""
    model, stages, ex = interleaved_setup(rank, world, opts)
    gbs = opts.get("gbs", 12)
    meta = loader(model, data, gbs, None).meta(0)
    plan = interleaved_plan(model, meta, world, opts)
    batch = batch_for(model, data, gbs, plan)
    largest = max(batch.micro_batches, key=lambda mb: (mb.num_images > 0, mb.num_tokens))
    per_token = chunk_bytes_per_token(model, stages, ex.encoder.get(0), largest)
    res = ex.run(batch, plan)
    got = grads(stages, ex.encoder)
    ref_encoder, whole = build_vlm(model, max_seq_len=4 * MAX_SEQ_LEN, seed=0, attention_backend="sdpa")
    ref_loss = reference_step(ref_encoder, whole, batch)
    ref = grads({0: whole}, {0: ref_encoder})
    acts = [Action.parse(a) for a in plan.ranks[rank]]
    ran = [t.action for t in res.timeline]
    trace = [saved for saved, _ in res.activation_trace]  # trace[i]: before action i of the timeline, trace[i + 1]: after it
    offloads = [(str(a), str(ran[i - 1]), trace[i - 1], trace[i], trace[i + 1]) for i, a in enumerate(ran) if a.op is Op.OFFLOAD]
    reloads = [(str(a), trace[i], trace[i + 1]) for i, a in enumerate(ran) if a.op is Op.RELOAD]
    return {
        "stages": sorted(stages), "plan": plan.to_json(), "order": list(plan.order), "loss": res.loss, "loss_ref": ref_loss,
        "copies_ran": [str(a) for a in ran if a.op.is_copy], "offloads": offloads, "reloads": reloads,
        "errors": {n: rel_err(g, ref[n]) for n, g in got.items()}, "ref_params_here": sorted(n for n in ref if n in got) == sorted(got),
        "zero_grads": [n for n, g in got.items() if not g.abs().max() > 0],
        "ops": sorted({a.op.value for a in acts}), "encoder_backward": sum(a.is_encoder and a.op is Op.BACKWARD for a in acts),
        "precomputed": sum(t.precomputed for t in res.timeline),
        "activation_trace": res.activation_trace, "activation_peak": res.activation_peak_bytes, "bytes_per_token": per_token,
        "tokens": [mb.num_tokens for mb in batch.micro_batches], "images": [mb.num_images for mb in batch.micro_batches],
        "timeline": [str(t.action) for t in res.timeline],
    }


ENCODER_LAYERS = 5  # cut into 2 * K chunks: uneven for K = 2 (2+1+1+1 layers)


def separated_setup(rank: int, opts: dict):
    """The tiny model with a 5-layer encoder in DIP's separated layout on 2 ranks: backbone stage
    ``rank``, encoder chunks ``k`` with ``k mod 2 == rank`` of ``2 * K`` chunks."""
    model = load_model_config("tiny")
    model = replace(model, encoder=replace(model.encoder, n_layers=ENCODER_LAYERS, frozen=not opts.get("trained")))
    layout = StageLayout.even(model.backbone.n_layers, 2).separated(ENCODER_LAYERS, opts.get("segments", 2), opts.get("sub_batch", 2))
    n = len(layout.encoder_chunks)
    chunks = build_encoder_chunks(model, list(layout.encoder_chunks), [k for k in range(n) if k % 2 == rank], seed=0)
    _, stages = build_stages(model, list(layout.layer_ranges), [rank], max_seq_len=4 * MAX_SEQ_LEN, seed=0, attention_backend="sdpa",
                             colocated_encoder=False)
    ex = PlanExecutor(stages, chunks, dim=model.backbone.dim, rank=rank, image_shapes=ImageShapes.of(model.encoder),
                      strict_order=opts.get("strict", False), compute_dtype=DTYPES[opts.get("dtype", "fp32")])
    return model, stages, chunks, ex


def separated_plan(model, data, opts, gbs: int = 12):
    """Balanced packing at mbs 2, each micro-batch's images in sub-microbatches of ``sub_batch``,
    the actions of DIP's separated layout in a random valid order (``seed``)."""
    meta = loader(model, data, gbs, None).meta(0)
    return packed_separated_plan(np.random.default_rng(opts.get("seed", 0)), model, meta, ranks=2, segments=opts.get("segments", 2),
                                 image_sub_batch=opts.get("sub_batch", 2), trained=not model.encoder.frozen, max_seq_len=MAX_SEQ_LEN)


def noise_images(patches: torch.Tensor, rows: int) -> torch.Tensor:
    """Padding with large random images instead of zeros (to show that padding reaches nothing)."""
    return torch.cat([patches, 100 * torch.randn(rows - patches.shape[0], patches.shape[1])])


def separated_grads(rank, world, data, opts):
    """A separated-layout plan (encoder chunks on both ranks, padded image sub-microbatches, random
    order) against the single-process reference; then the same plan with the padding images full
    of noise, which must give bitwise the same loss and gradients."""
    model, stages, chunks, ex = separated_setup(rank, opts)
    plan, images = separated_plan(model, data, opts)
    batch = batch_for(model, data, 12, plan)
    res = ex.run(batch, plan)
    got = grads(stages, chunks)
    zero_grads(*stages.values(), *chunks.values())
    executor_module.pad_images = noise_images
    noisy = ex.run(batch, plan)
    got_noisy = grads(stages, chunks)
    ref_encoder, whole = build_vlm(model, max_seq_len=4 * MAX_SEQ_LEN, seed=0, attention_backend="sdpa")
    ref_loss = reference_step(ref_encoder, whole, batch, DTYPES[opts.get("dtype", "fp32")])
    ref = grads({0: whole}, {0: ref_encoder})
    ranges = plan.image_ranges(images)
    acts = [Action.parse(a) for a in plan.ranks[rank]]
    return {
        "chunks": sorted(chunks), "stages": sorted(stages), "sub_micro_batches": len(ranges),
        "padded": sum(n < plan.image_sub_batch for _, _, n in ranges), "order": list(plan.order),
        "encoder_actions": sum(a.is_encoder for a in acts), "encoder_backward": sum(a.is_encoder and a.op is Op.BACKWARD for a in acts),
        "params": len(got), "encoder_params": sum(n.startswith("encoder.") for n in got),
        "ref_params_here": sorted(n for n in ref if n in got) == sorted(got),
        "errors": {n: rel_err(g, ref[n]) for n, g in got.items()},
        "noise_equal": sorted(got) == sorted(got_noisy) and all(torch.equal(got[n], got_noisy[n]) for n in got),
        "loss": res.loss, "loss_noisy": noisy.loss, "loss_ref": ref_loss,
    }


def separated_swapped(rank, world, data, opts):
    """Rank 1 posts two receives from rank 0 of different sizes (an encoder activation and a
    backbone activation) first, in swapped order. Matched by tag, gloo pairs them with the right
    buffers; with ``strict`` (one tag) it pairs them by order, as NCCL does, and must fail."""
    def swapped(table, r):
        steps = lower(table, r)
        if r != 1:
            return steps
        recvs = [t for s in steps if isinstance(s, Post) for t in s.transfers if t.direction is Direction.RECV]
        first = recvs[0]
        other = next(t for t in recvs if t.message.kind is not first.message.kind
                     and MessageKind.FEATURES not in (t.message.kind, first.message.kind))
        rest = [Post(tuple(t for t in s.transfers if t not in (first, other))) if isinstance(s, Post) else s for s in steps]
        return [Post((other, first))] + [s for s in rest if not (isinstance(s, Post) and not s.transfers)]

    executor_module.lower = swapped
    model, stages, chunks, ex = separated_setup(rank, opts)
    plan, _ = separated_plan(model, data, opts)
    batch = batch_for(model, data, 12, plan)
    res = ex.run(batch, plan)
    ref_encoder, whole = build_vlm(model, max_seq_len=4 * MAX_SEQ_LEN, seed=0, attention_backend="sdpa")
    reference_step(ref_encoder, whole, batch)
    ref = grads({0: whole}, {0: ref_encoder})
    return {"worst_rel": max(rel_err(g, ref[n]) for n, g in grads(stages, chunks).items()), "loss": res.loss}


class _Recorded:
    """A work that logs, when waited on, which receive buffers its completion covers."""

    def __init__(self, works, recv_buffers, log):
        self.works, self.recv_buffers, self.log = works, recv_buffers, log

    def wait(self, *args):
        self.log.append(self.recv_buffers)
        for w in self.works:
            w.wait(*args)
        return True


def message_waits(rank, world, data, opts):
    """A plan on ``world`` ranks (a middle rank receives activations from one side and gradients
    from the other) with every point-to-point call recorded, and ``batch_isend_irecv`` returning one
    work for its whole batch as NCCL's does: per wait, the receive buffers it covers."""
    model, stages, ex, stage_rank = setup(rank, world, opts)
    meta = loader(model, data, 12, None).meta(0)
    plan = plan_for(model, meta, packer="balanced", mbs=1, stage_rank=stage_rank)
    batch = batch_for(model, data, 12, plan)
    waits = []

    def single(fn, recv):
        def call(tensor, *args, **kwargs):
            return _Recorded([fn(tensor, *args, **kwargs)], [id(tensor)] if recv else [], waits)
        return call

    def coalesced(ops):
        works = dist.batch_isend_irecv([dist.P2POp(real[op.op], op.tensor, group=op.group, tag=op.tag, group_peer=op.group_peer) for op in ops])
        return [_Recorded(works, [id(op.tensor) for op in ops if real[op.op] is dist.irecv], waits)] * len(ops)

    class P2POp:  # torch's checks its op against the real functions
        def __init__(self, op, tensor, group=None, tag=0, group_peer=None):
            self.op, self.tensor, self.group, self.tag, self.group_peer = op, tensor, group, tag, group_peer

    recorded = SimpleNamespace(**{k: getattr(dist, k) for k in dir(dist) if not k.startswith("__")})
    recorded.isend, recorded.irecv, recorded.batch_isend_irecv, recorded.P2POp = single(dist.isend, False), single(dist.irecv, True), coalesced, P2POp
    real = {recorded.isend: dist.isend, recorded.irecv: dist.irecv}
    executor_module.dist = recorded
    try:
        res = ex.run(batch, plan)
    finally:
        executor_module.dist = dist
    steps = lower(plan.table(), rank)
    mixed = [s for s in steps if isinstance(s, Post) and len({t.message.dst.op for t in s.transfers if t.direction is Direction.RECV}) > 1]
    return {"waits_covering": [len(w) for w in waits if w], "wait_steps": sum(isinstance(s, Wait) for s in steps),
            "posts_with_forward_and_backward_receives": len(mixed), "loss": res.loss}


def main() -> None:
    scenario, data, out = sys.argv[1:4]
    opts = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=opts.get("timeout_s", 40)))
    result = globals()[scenario](rank, world, data, opts)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
