"""Data parallelism in the loader: every data-parallel rank reads the global batch and yields the
share its replica's plan names, each replica planning its own share; over many steps and epochs no
sample is lost or repeated."""

import numpy as np
import pytest

from pipetune.config import load_hardware
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.data import make_mix, write_dataset
from pipetune.data.index import build_index
from pipetune.packing import PackingConfig
from pipetune.plan.mode import Mode
from pipetune.plan.layout.planner_config import PlannerConfig
from pipetune.plan.data_parallel.dp_balance import ShareCost
from pipetune.plan.data_parallel.replicas import ReplicaPlans, ReplicaShare, SharePlanner
from torchtitan_patches.data import DataLoaderConfig

SEQ, GBS, STEPS, ROWS, DP = 2048, 8, 200, 60, 2


class OwnPlan:
    """What ``PlanChannel`` does on one rank: its replica's lead plans the replica's share (here in
    the same process, from the global batch as its planner process reads it) and the rank receives
    the plan as JSON with the share's rows and the batch's totals, from which it reads its share."""

    def __init__(self, planner: SharePlanner):
        self.planner = planner

    def share(self, step, reader):
        made = self.planner.plan(reader(step))
        share = reader.rows(step, made.share.rows.tolist(), made.share.whole)
        plan = ReplicaPlans.from_json(made.plans.to_json()).plans[0].validate(share.table.ids)
        return share, [list(mb) for mb in plan.micro_batches]


@pytest.mark.parametrize("indexed", [False, True], ids=["data set", "index"])
def test_replicas_partition_every_global_batch_over_200_steps_and_many_epochs(tmp_path, tiny, indexed):
    write_dataset(make_mix("datamix2", ROWS, 3), tmp_path / "rows", {"mix": "datamix2"})
    data = build_index(tmp_path / "rows", tmp_path / "index", progress=False) and tmp_path / "index" if indexed else tmp_path / "rows"
    cost = CostModel(analytical_table(tiny, load_hardware("a100"), tp=1), StageLayout.even(tiny.backbone.n_layers, 2))
    planner = PlannerConfig(mode=Mode.BALANCED, mbs=1, max_seq_len=SEQ, memory_bytes=80 * 2**30).build(tiny, cost)
    config = DataLoaderConfig(data=data, gbs=GBS, max_seq_len=SEQ, seed=1, max_steps=STEPS, packing=PackingConfig(max_seq_len=SEQ))
    shares = [ReplicaShare(DP, r, ShareCost(cost, packed_tokens=SEQ)) for r in range(DP)]
    loaders = [config.build(tiny, packing_source=OwnPlan(SharePlanner(planner, shares[r])), dp_rank=r, dp_size=DP) for r in range(DP)]
    stream_rows = []
    for step, batches in enumerate(zip(*loaders)):
        meta = loaders[0].meta(step)
        shares = [sorted(s for mb in b.micro_batches for s in mb.sample_ids.tolist()) for b in batches]
        assert not set(shares[0]) & set(shares[1]), f"step {step}: a sample in both replicas"
        assert sorted(shares[0] + shares[1]) == sorted(meta.table.ids.tolist()), f"step {step}: a sample lost"
        assert all(b.num_label_tokens == int(meta.table.label_tokens.sum()) for b in batches)  # the global normaliser
        stream_rows += meta.rows.tolist()
    assert step == STEPS - 1
    epochs = len(stream_rows) // ROWS
    assert epochs >= 25
    for e in range(epochs):  # the global batches, replica shares together, hold every row once per epoch
        assert np.array_equal(np.sort(stream_rows[e * ROWS:(e + 1) * ROWS]), np.arange(ROWS))
