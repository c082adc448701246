"""One rank of a 2-process gloo run of TorchTitan's Muse Glimmer (``heavy_vit``: a 10-block ViT) in
DIP's separated layout, its model parts built as ``PipeTuneTrainer`` builds them (run by
tests/test_titan_separated.py, not by pytest).

usage: python titan_separated_worker.py DATA_DIR OUT_DIR OPTIONS_JSON  (RANK, WORLD_SIZE, MASTER_PORT in env)
Options: ``trained`` (train the ViT), ``sub_batch`` (B), ``seed`` (of the random plan order),
``search`` (run the separated planner's plan instead: its micro-batch size, ``B``, order, lead and
lag, found by ``pipetune.plan.separated.segment_search`` on an analytical H100 table of this model).

Both ranks build the whole model from one seed (the reference), then split it with the trainer's
``layout_fqns`` and TorchTitan's own splitter, cut each part's ``vision_encoder`` to the rank's
encoder chunks (``keep_encoder_chunks``, which the trainer's ``parallelize_fn`` wrapper applies
before materialisation; here after, on a copy of the reference's weights), run a separated plan
with strict message order, and compare every gradient with the unsplit model's own forward
(encoder inside) on the same batch. Writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from random_schedules import packed_separated_plan
from recorded_stream import RecordedStream
from titan_reference import unsplit_step
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.pipeline_parallel import _split_module

from pipetune.config import load_hardware
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.plan.layout.planner_config import PlannerConfig
from pipetune.packing import PackingConfig
from torchtitan_patches.data import DataLoaderConfig
from torchtitan_patches.runtime.executor import ImageShapes, PlanExecutor
from torchtitan_patches.models.muse_glimmer.spec import muse_glimmer_spec
from torchtitan_patches.models.model_spec import planning_model_config
from torchtitan_patches.models.muse_glimmer.stages import TitanStage, encoder_chunks, keep_encoder_chunks
from torchtitan_patches.titan.model_parts import VISION_MODULES, layout_fqns, local_encoder_chunks

SEQ = 512
GRID = 4  # patches per image side: 16 patches, 2x2 windows (the sparse blocks' permutation is not the identity), 4 tokens
CHUNKS = [(0, 3), (3, 6), (6, 8), (8, 10)]  # K = 2 segments of the 10 blocks on 2 ranks


def main() -> None:
    data, out, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=40))
    dist_utils.set_spmd_backend("partial_dtensor")  # plain tensors: no device mesh outside TorchTitan's trainer
    trained = bool(opts.get("trained"))
    spec = muse_glimmer_spec("heavy_vit")
    model = planning_model_config(spec, image_grid=GRID, encoder_frozen=not trained)
    torch.manual_seed(0)
    with torch.device("meta"):
        whole = spec.model.build()
    whole.to_empty(device="cpu")
    with torch.no_grad():
        whole.init_weights(buffer_device=None)
        for p in whole.parameters():  # Muse Glimmer zero-initialises its norm weights: at init only the final norm gets a gradient
            p.add_(torch.randn_like(p), alpha=0.05)
    whole.vision_encoder.requires_grad_(trained)

    vision = [m for m in VISION_MODULES if getattr(spec.model, m, None) is not None]
    fqns = layout_fqns(StageLayout.even(model.backbone.n_layers, world), vision, separated=True)
    part = _split_module(whole, fqns[rank])
    local = local_encoder_chunks(rank, world, CHUNKS)
    keep_encoder_chunks(part.vision_encoder, CHUNKS, local)
    stage = TitanStage(part, is_first=rank == 0, is_last=rank == world - 1)
    ex = PlanExecutor({rank: stage}, encoder_chunks(part, CHUNKS, local, image_grid=GRID), dim=model.backbone.dim, rank=rank,
                      image_shapes=ImageShapes.of(model.encoder), strict_order=True)

    cfg = DataLoaderConfig(data=data, gbs=12, max_seq_len=SEQ, packing=PackingConfig(max_seq_len=SEQ))
    ld = cfg.build(model)
    ld.stream = RecordedStream(len(ld.store), 12)  # the batch these checks were made on
    meta = ld.meta(0)
    B = opts.get("sub_batch", 2)
    if opts.get("search"):
        layout = StageLayout.even(model.backbone.n_layers, world).separated(model.encoder.n_layers, len(CHUNKS) // world, B)
        assert list(layout.encoder_chunks) == CHUNKS
        h100 = load_hardware("h100")
        cost = CostModel(analytical_table(model, h100, max_tokens=SEQ, max_images=64), layout)
        config = PlannerConfig(max_seq_len=SEQ, memory_bytes=h100.memory_bytes)
        if opts.get("spread"):  # the search at size 2, its micro-batches spread over one more than size 2 packs
            fewest = PackingConfig(mbs=2, max_seq_len=SEQ).build(model)(meta.table.lengths, meta.step).num_micro_batches
            config = replace(config, mode="reorder", mbs=2, min_micro_batches=fewest + 1)
        plan = config.build(model, cost).plan(meta)
        images = plan.shapes(meta).images
        B = plan.image_sub_batch
    else:
        plan, images = packed_separated_plan(np.random.default_rng(opts.get("seed", 0)), model, meta, ranks=world,
                                             segments=len(CHUNKS) // world, image_sub_batch=B, trained=trained, max_seq_len=SEQ)
    groups = [list(mb) for mb in plan.micro_batches]
    batch = ld.pack(meta, groups)
    res = ex.run(batch, plan)

    ref_loss = unsplit_step(whole, batch)
    ref = {n: p.grad for n, p in whole.named_parameters() if p.grad is not None}
    got = {n: p.grad for n, p in part.named_parameters() if p.grad is not None}
    errors = {n: float((g - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)) for n, g in got.items()}
    ranges = plan.image_ranges(images)
    result = {"errors": errors, "reference": sorted(ref), "zero_grads": sorted(n for n in got if not ref[n].any()), "loss": res.loss, "loss_ref": ref_loss, "chunks": local,
              "blocks": sorted(int(k) for k in part.vision_encoder.layers.keys()),
              "padded": sum(n < B for _, _, n in ranges), "order": list(plan.order),
              "ranks": [list(r) for r in plan.ranks], "micro_batches": len(plan.micro_batches), "mbs": plan.mbs,
              "fewest": fewest if opts.get("spread") else None}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
