"""One rank of a 2-process gloo pipeline test (run by tests/test_pipeline_runtime.py, not by pytest).

usage: python pipeline_worker.py SCENARIO DATA_DIR OUT_DIR  (RANK, WORLD_SIZE, MASTER_PORT in env)
Writes OUT_DIR/rank{r}.json with what the scenario measured.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from pipetune.config import load_model_config
from pipetune.cost import StageLayout
from pipetune.packing import PackingConfig
from pipetune.plan.plan import build_plan
from torchtitan_patches.data import DataLoaderConfig
from torchtitan_patches.model.vlm import build_vlm, split_backbone
from torchtitan_patches.pipeline.executor import PlanExecutor, PlanMismatchError
from torchtitan_patches.pipeline.reference import reference_step, whole_model_names

MAX_SEQ_LEN = 256


def setup(rank: int, world: int):
    model = load_model_config("tiny")
    layout = StageLayout.even(model.backbone.n_layers, world)
    encoder, whole = build_vlm(model, max_seq_len=4 * MAX_SEQ_LEN, seed=0, attention_backend="sdpa")
    stage = split_backbone(whole, list(layout.layer_ranges))[rank]
    executor = PlanExecutor({rank: stage}, encoder if rank == 0 else None, dim=model.backbone.dim, rank=rank)
    return model, stage, executor


def loader(model, data, gbs, groups_of):
    cfg = DataLoaderConfig(data=data, gbs=gbs, max_seq_len=MAX_SEQ_LEN, packing=PackingConfig(max_seq_len=MAX_SEQ_LEN))
    return cfg.build(model, packing_source=groups_of)


def plan_for(model, meta, *, packer: str, mbs: int, order=None, encoder_before=None, world=2):
    packing = PackingConfig(packer=packer, mbs=mbs, max_seq_len=MAX_SEQ_LEN).build(model)(meta.table.lengths, meta.step)
    groups = [meta.table.ids[g].tolist() for g in packing.groups()]
    m = len(groups)
    return build_plan(step=meta.step, micro_batches=groups, order=order if order is not None else range(m), num_stages=world,
                      encoder=True, mbs=mbs, max_seq_len=MAX_SEQ_LEN, encoder_before=encoder_before)


def batch_for(model, data, gbs, plan):
    return next(iter(loader(model, data, gbs, lambda meta: [list(mb) for mb in plan.micro_batches])))


def grads(stage) -> dict[str, torch.Tensor]:
    names = whole_model_names(stage)
    return {names[n]: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}


def equal_grads(rank, world, data):
    model, stage, ex = setup(rank, world)
    gbs = 12
    meta = loader(model, data, gbs, None).meta(0)
    plan_a = plan_for(model, meta, packer="original", mbs=1)
    m = plan_for(model, meta, packer="balanced", mbs=2).num_micro_batches
    order = [m - 1] + list(range(0, m - 1, 2)) + list(range(1, m - 1, 2))  # non-monotone
    plan_b = plan_for(model, meta, packer="balanced", mbs=2, order=order, encoder_before={order[-1]: 1, order[-2]: 0})
    out = {"m_a": plan_a.num_micro_batches, "m_b": plan_b.num_micro_batches, "order_b": order}
    results = {}
    for name, plan in (("a", plan_a), ("b", plan_b)):
        batch = batch_for(model, data, gbs, plan)
        res = ex.run(batch, plan)
        results[name] = (res.loss, grads(stage), batch)
        out[f"precomputed_{name}"] = sum(t.precomputed for t in res.timeline)
        stage.zero_grad(set_to_none=True)
    encoder, whole = build_vlm(model, max_seq_len=4 * MAX_SEQ_LEN, seed=0, attention_backend="sdpa")
    ref_loss = reference_step(encoder, whole, results["a"][2])
    ref = {n: p.grad for n, p in whole.named_parameters() if p.grad is not None}
    worst = 0.0
    for n, g in results["a"][1].items():
        for other in (results["b"][1][n], ref[n]):
            assert torch.allclose(g, other, rtol=1e-4, atol=1e-7), n
            worst = max(worst, float(((g - other).abs() / (other.abs() + 1e-12)).max()))
    out.update(params=len(results["a"][1]), worst_rel=worst, loss_a=results["a"][0], loss_b=results["b"][0], loss_ref=ref_loss,
               same_ids=sorted(sum(results["a"][2].sample_ids, [])) == sorted(sum(results["b"][2].sample_ids, [])))
    return out


def varying_steps(rank, world, data):
    """Five steps, each with its own mbs (so micro-batch count and lengths) and a random order."""
    model, stage, ex = setup(rank, world)
    opt = torch.optim.AdamW([p for p in stage.parameters() if p.requires_grad], lr=1e-3)
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


def mismatch(rank, world, data):
    model, stage, ex = setup(rank, world)
    meta = loader(model, data, 12, None).meta(0)
    plan = plan_for(model, meta, packer="balanced", mbs=1 if rank == 0 else 2)
    batch = batch_for(model, data, 12, plan)
    try:
        ex.run(batch, plan)
    except PlanMismatchError as e:
        return {"error": str(e)}
    return {"error": None}


def main() -> None:
    scenario, data, out = sys.argv[1:4]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    result = globals()[scenario](rank, world, data)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
