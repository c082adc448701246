import functools
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, MicroBatchShapes, StageLayout, analytical_table
from pipetune.data import BatchStream, batch_meta, make_mix
from pipetune.packing import PackingConfig
from pipetune.plan import IterationPlan, Mode, PlanError
from pipetune.plan.layout.planner_config import PlannerConfig
from pipetune.serve.async_planner import AsyncPlanner
from pipetune.plan.data_parallel.dp_balance import ShareCost
from pipetune.serve.plan_source import PlanSource
from pipetune.plan.data_parallel.replicas import ReplicaShare, SharePlanner
from pipetune.schedule import Schedule, one_f_one_b
from pipetune.simulate import Latencies, simulate
from image_sizing import square_images

A100 = load_hardware("a100")


@pytest.fixture(scope="module")
def setup13b():
    model = load_model_config("13b")
    cost = CostModel(analytical_table(model, A100, tp=4), StageLayout.even(40, 4))
    return model, cost


@functools.cache
def mix_rows(mix, seed):
    """The mix's 20k rows, made once: the tests only read them."""
    return make_mix(mix, 20_000, seed)


def metas(mix, gbs=128, n=6, seed=0, max_seq_len=8192, overlong="truncate"):
    table = mix_rows(mix, seed)
    stream = BatchStream(num_rows=len(table), gbs=gbs, seed=seed)
    return [batch_meta(table, stream, s, images=square_images(576), max_seq_len=max_seq_len, overlong=overlong) for s in range(n)]


def planner(setup, **kw):
    model, cost = setup
    return PlannerConfig(**{"max_seq_len": 8192, "memory_bytes": A100.memory_bytes, **kw}).build(model, cost)


@pytest.mark.parametrize("mix", ["datamix1", "datamix2", "datamix3"])
def test_searched_plans_are_never_slower_than_balanced(setup13b, mix):
    balanced = planner(setup13b, mode="balanced")
    searched = {m: planner(setup13b, mode=m) for m in ("reorder", "pipetune")}
    for meta in metas(mix):
        b = balanced.plan(meta)
        for m, p in searched.items():
            plan = p.plan(meta)
            assert plan.predicted_s <= b.predicted_s + 1e-9, (m, meta.step)
            assert plan.lower_bound_s <= plan.predicted_s + 1e-9


def test_predicted_time_is_what_the_plan_simulates_to(setup13b):
    """The plan's own action table, re-simulated from scratch, gives its predicted time."""
    model, cost = setup13b
    for meta in metas("datamix3", n=3):
        plan = planner(setup13b).plan(meta)
        by_id = {int(s): k for k, s in enumerate(meta.table.ids)}
        from pipetune.packing import Packing

        packing = Packing.from_groups([[by_id[s] for s in mb] for mb in plan.micro_batches], plan.mbs * 8192)
        lat = Latencies.from_costs(cost.stage_costs(MicroBatchShapes.from_packing(meta.table, packing)))
        assert simulate(plan.table(), lat).makespan == pytest.approx(plan.predicted_s)


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("overlong", ["truncate", "reject"])
def test_plans_cover_the_batch_exactly(setup13b, mode, overlong):
    p = planner(setup13b, mode=mode)
    for meta in metas("datamix1", n=4, max_seq_len=2048, overlong=overlong):
        plan = PlannerConfig(mode=mode, max_seq_len=2048, memory_bytes=A100.memory_bytes).build(*setup13b).plan(meta)
        ids = plan.sample_ids()
        assert sorted(ids) == sorted(meta.table.ids.tolist()) and len(ids) == len(set(ids))
        plan.validate(meta.table.ids)
    assert p.max_mbs >= 1


def test_modes_do_what_their_names_say(setup13b):
    meta = metas("datamix2", n=1)[0]
    plans = {m: planner(setup13b, mode=m).plan(meta) for m in Mode}
    fixed = planner(setup13b).max_mbs
    for m in ("original", "balanced", "reorder"):
        assert plans[m].mbs == fixed
    for m in ("original", "balanced"):
        assert list(plans[m].order) == list(range(plans[m].num_micro_batches))
        natural = one_f_one_b(4, range(plans[m].num_micro_batches), encoder=True)  # no pre-computation
        assert plans[m].table().ranks == natural.ranks
    assert plans["balanced"].micro_batches == planner(setup13b, mode="reorder").plan(meta).micro_batches
    lengths = meta.table.lengths
    orig = PackingConfig(packer="original", mbs=fixed, max_seq_len=8192).build(setup13b[0])(lengths, meta.step)
    assert [list(g) for g in plans["original"].micro_batches] == [meta.table.ids[g].tolist() for g in orig.groups()]


def test_json_round_trip_and_rejection(setup13b):
    plan = planner(setup13b).plan(metas("datamix2", n=1)[0])
    back = IterationPlan.from_json(plan.to_json())
    assert back == plan and back.mode is Mode.PIPETUNE
    raw = json.loads(plan.to_json())
    raw["order"] = raw["order"][:-1]
    with pytest.raises(PlanError, match="not a permutation"):
        IterationPlan.from_json(json.dumps(raw))
    raw = json.loads(plan.to_json())
    raw["version"] = 1  # plans before chunk placements and sub-microbatches
    with pytest.raises(PlanError, match="version-2"):
        IterationPlan.from_json(json.dumps(raw))
    for edit, message in (
        (lambda r: r["ranks"][0].pop(), "missing"),
        (lambda r: r.pop("placement"), "malformed: KeyError: 'placement'"),
        (lambda r: r["placement"].update(encoder=[5]), "chunks must sit on ranks 0..R-1"),
        (lambda r: r["placement"].update(encoder=[3]), "a separated plan needs image_sub_batch >= 1"),
        (lambda r: r["ranks"][0].__setitem__(0, "0E0"), "not an action: '0E0'"),
        (lambda r: r.update(sub_mb_parent=r["sub_mb_parent"][:-1]), "one sub-microbatch per micro-batch"),
        (lambda r: r.update(image_sub_batch=4), "one sub-microbatch per micro-batch"),
        (lambda r: r.update(peak_bytes=[1.0]), "peak_bytes has 1 entries for 4 ranks"),
        (lambda r: r["ranks"][0].insert(0, "E0B0"), "a frozen encoder has no backward actions"),
        (lambda r: r.update(mode="fastest"), "malformed: ValueError: 'fastest' is not a valid Mode"),
    ):
        raw = json.loads(plan.to_json())
        edit(raw)
        with pytest.raises(PlanError, match=message):
            IterationPlan.from_json(json.dumps(raw))
    with pytest.raises(PlanError, match="does not cover the batch"):
        plan.validate([1, 2, 3])
    with pytest.raises(PlanError, match="not JSON"):
        IterationPlan.from_json("{")


def test_planner_config_names_what_it_does_not_know(setup13b):
    assert planner(setup13b, schedule="gpipe").config.schedule is Schedule.GPIPE
    with pytest.raises(ValueError, match=r"unknown schedule 'pipedream'; known: \['1f1b', 'gpipe', 'serial'\]"):
        planner(setup13b, schedule="pipedream")
    with pytest.raises(ValueError, match="'fast' is not a valid Mode"):
        planner(setup13b, mode="fast")


def test_same_seed_same_plans(setup13b):
    a = [planner(setup13b, seed=3).plan(m) for m in metas("datamix3", n=3)]
    b = [planner(setup13b, seed=3).plan(m) for m in metas("datamix3", n=3)]
    strip = lambda p: json.loads(p.to_json()) | {"search_s": 0}  # noqa: E731
    assert [strip(p) for p in a] == [strip(p) for p in b]


def test_deadline_gives_the_balanced_fallback_at_the_last_good_mbs(setup13b):
    p = planner(setup13b)
    ms = metas("datamix2", n=2)
    first = p.plan(ms[0])
    late = p.plan(ms[1], deadline=time.perf_counter() - 1)
    assert late.fallback and late.mode == "pipetune" and late.mbs == first.mbs
    assert list(late.order) == list(range(late.num_micro_batches))
    balanced = planner(setup13b, mode="balanced", mbs=first.mbs).plan(ms[1])
    assert late.micro_batches == balanced.micro_batches
    assert late.predicted_s == pytest.approx(balanced.predicted_s)


def test_async_planner_plans_ahead_and_honours_its_budget(setup13b):
    ms = metas("datamix2", n=5)

    def start(budget_s, lookahead):
        return AsyncPlanner(planner(setup13b), ms.__getitem__, budget_s=budget_s, lookahead=lookahead)

    with ThreadPoolExecutor(2) as pool:  # both processes start at once
        ap, hurried = pool.map(start, (None, 0.0), (2, 0))
    groups = ap(ms[0])
    assert sorted(ap._requests) == [1, 2]  # the next two steps queued, their metadata read in the process
    plan = ap.pop(0)
    assert [list(mb) for mb in plan.micro_batches] == groups and not plan.fallback
    with pytest.raises(PlanError, match="no plan for step 0"):
        ap.pop(0)
    assert ap.state_dict() == {"last_mbs": plan.mbs}
    ap(ms[1])
    assert ap.pop(1).micro_batches == planner(setup13b).plan(ms[1]).micro_batches
    ap.close()
    hurried(ms[3])
    assert hurried.pop(3).fallback and not hurried._requests  # no look-ahead: only the asked step is planned
    hurried.close()


def stripped(plan) -> list[dict]:
    """A plan (or a replica's ``SharePlan``) as JSON, less its search time: equal searches differ only there."""
    return [json.loads(p.to_json()) | {"search_s": 0} for p in (plan.plans.plans if hasattr(plan, "share") else (plan,))]


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_planner_process_plans_what_the_planner_plans(setup13b, replicas):
    ms = metas("datamix2", n=6)
    share = ReplicaShare(replicas, replicas - 1, ShareCost(setup13b[1], packed_tokens=8192))
    local = SharePlanner(planner(setup13b, seed=3), share)
    ap = AsyncPlanner(SharePlanner(planner(setup13b, seed=3), share), ms.__getitem__, lookahead=2)
    assert [stripped(ap.plan(m)) for m in ms[:3]] == [stripped(local.plan(m)) for m in ms[:3]]
    ap.close()
    assert ap._proc.poll() is not None and not ap._reader.is_alive()  # no child process left
    with pytest.raises(PlanError, match=r"planner process \(pid \d+\) was closed; no plan for step 3"):
        ap.plan(ms[3])


def test_the_planner_process_takes_cost_and_correction_from_the_next_search_on(setup13b):
    model, cost = setup13b
    ms = metas("datamix2", n=3)
    per_call = CostModel(replace(cost.table, overhead={"fwd_s": 0.05, "bwd_s": 0.05}), cost.layout)  # favours fewer micro-batches
    local, ap = planner(setup13b), AsyncPlanner(planner(setup13b), ms.__getitem__, lookahead=0)
    assert stripped(ap.plan(ms[0])) == stripped(local.plan(ms[0]))
    for p in (ap, local):
        p.set_cost(per_call)
    costed = ap.plan(ms[1])
    assert stripped(costed) == stripped(local.plan(ms[1])) and costed.mbs != planner(setup13b).plan(ms[1]).mbs
    for p in (ap, local):
        p.set_correction({costed.mbs: 1.5})
    corrected = ap.plan(ms[2])
    assert stripped(corrected) == stripped(local.plan(ms[2])) and corrected.mbs != costed.mbs
    ap.close()


def test_the_planner_process_reraises_a_search_error_and_carries_on(setup13b):
    ms = metas("datamix2", n=2)
    ap = AsyncPlanner(planner(setup13b), ms.__getitem__, lookahead=0)
    ap.set_correction({1: "slow"})  # not a number: the search fails when it compares sizes
    with pytest.raises(TypeError, match="can't multiply sequence") as e:
        ap.plan(ms[0])
    assert "raised in the pipetune planner process" in "".join(e.value.__notes__)
    ap.set_correction({})
    assert not ap.plan(ms[1]).fallback
    ap.close()


def test_a_loaded_state_sets_the_fallback_size_in_the_process(setup13b):
    ms = metas("datamix2", n=3)
    ap = AsyncPlanner(planner(setup13b), ms.__getitem__, budget_s=0.0, lookahead=1)
    assert ap.plan(ms[0]).mbs == ap.planner.max_mbs  # queues step 1 too, which loading drops
    ap.load_state_dict({"last_mbs": 2})
    plan = ap.plan(ms[1])
    assert plan.fallback and plan.mbs == 2 and ap.state_dict() == {"last_mbs": 2}
    ap.close()


@pytest.mark.timeout(60)
def test_a_killed_planner_process_is_a_plan_error(setup13b):
    ms = metas("datamix2", n=2)
    ap = AsyncPlanner(planner(setup13b), ms.__getitem__, lookahead=0)
    ap.plan(ms[0])
    os.kill(ap._proc.pid, signal.SIGKILL)
    with pytest.raises(PlanError, match=r"planner process \(pid \d+\) exited with code -9 .*; no plan for step 1$"):
        ap.plan(ms[1])
    ap.close()


@pytest.mark.timeout(60)
def test_a_stuck_planner_process_times_out_and_close_ends_it(setup13b):
    ms = metas("datamix2", n=1)
    ap = AsyncPlanner(planner(setup13b), ms.__getitem__, budget_s=0.0, lookahead=0)
    ap.grace_s = 0.5  # once started
    os.kill(ap._proc.pid, signal.SIGSTOP)
    with pytest.raises(PlanError, match=r"did not finish planning step 0 within its budget \(0.0 s\) \+ 0.5 s"):
        ap.plan(ms[0])
    ap.close()
    assert ap._proc.poll() == -signal.SIGKILL and not ap._reader.is_alive()


def test_precompute_fills_stage0_gaps_and_helps(setup13b):
    """On DataMix3 (many images) the search moves encoders into stage 0's idle gaps, and the plan
    is faster than the best plan without pre-computation."""
    model, cost = setup13b
    cfg = dict(max_seq_len=8192, memory_bytes=A100.memory_bytes)
    meta = metas("datamix3", n=1)[0]
    with_pre = PlannerConfig(**cfg).build(model, cost).plan(meta)
    without = PlannerConfig(**cfg, precompute=False).build(model, cost).plan(meta)
    r = simulate(with_pre.table(), Latencies.uniform(with_pre.num_micro_batches, 4, 1, 2, t_e=0.1))
    assert sum(t.precomputed for t in r.actions) >= 2
    assert with_pre.predicted_s < without.predicted_s
    assert not any(t.precomputed for t in simulate(without.table(), Latencies.uniform(without.num_micro_batches, 4, 1, 2)).actions)


def test_memory_limits(setup13b):
    model, cost = setup13b
    p = planner(setup13b)
    budget = A100.memory_bytes * 0.9
    for meta in metas("datamix3", n=3):
        plan = p.plan(meta)
        assert max(plan.peak_bytes) <= budget
    with pytest.raises(ValueError, match="no micro-batch size fits"):
        PlannerConfig(max_seq_len=8192, memory_bytes=16e9).build(model, cost)


def test_plan_cli_json(capsys):
    from pipetune.cli.main import main

    assert main(["plan", "--model", "13b", "--tp", "4", "--pp", "4", "--gbs", "64", "--mix", "datamix1",
                 "--samples", "5000", "--iters", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for mode in ("original", "balanced", "reorder", "pipetune"):
        assert {"mean_iter_s", "search_ms_p50", "search_ms_p99", "lower_bound_s"} <= set(out[mode])
    assert out["pipetune"]["mean_iter_s"] <= out["balanced"]["mean_iter_s"]


def test_plan_cli_accepts_any_model_file_and_data_dir(tmp_path, datamix2_dir, capsys):
    from pipetune.cli.main import main

    f = tmp_path / "m.toml"
    f.write_text('name = "mine"\nencoder = "siglip_so400m"\n[backbone]\nn_layers=8\ndim=1024\nffn_dim=2816\n'
                 'n_heads=8\nn_kv_heads=4\nvocab_size=32000\n')
    assert main(["plan", "--model-config", str(f), "--tp", "1", "--pp", "2", "--gbs", "32", "--max-seq-len", "4096",
                 "--data", str(datamix2_dir), "--iters", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["model"] == "mine"


def test_async_planner_drives_the_dataloader(datamix2_dir):
    from torchtitan_patches.data import DataLoaderConfig

    tiny = load_model_config("tiny")
    cost = CostModel(analytical_table(tiny, load_hardware("h100")), StageLayout.even(4, 2))
    loader = DataLoaderConfig(data=datamix2_dir, gbs=16, max_seq_len=512, max_steps=4,
                              packing=PackingConfig(mbs=2, max_seq_len=512), num_workers=1, prefetch_factor=2).build(tiny)
    ap = AsyncPlanner(PlannerConfig(max_seq_len=512, memory_bytes=1e9, max_mbs=4).build(tiny, cost), loader.reader, lookahead=2)
    loader.packing_source = ap
    for batch in loader:
        plan = ap.pop(batch.step)
        assert batch.sample_ids == [list(mb) for mb in plan.micro_batches]
        assert not plan.fallback and plan.estimate
    ap.close()


def test_best_static_is_never_slower_than_a_fixed_mbs_mode_it_covers():
    from pipetune.config import load_hardware, load_model_config
    from pipetune.cost import CostModel, StageLayout, analytical_table
    from pipetune.data import make_mix
    from pipetune.plan.layout.compare import compare_modes

    model = load_model_config("3b")
    cost = CostModel(analytical_table(model, load_hardware("a100"), tp=2), StageLayout.even(model.backbone.n_layers, 4))
    data = make_mix("datamix2", 2000, 0)
    kw = dict(gbs=64, max_seq_len=4096, memory_bytes=80 * 2**30, iters=3, modes=("original", "balanced"))
    best = compare_modes(model, cost, data, **kw)["best-static"].iter_s.mean()
    fixed = [compare_modes(model, cost, data, mbs=k, best_static=False, **kw) for k in (1, 2, 3)]
    for run in fixed:
        for mode in ("original", "balanced"):
            assert best <= run[mode].iter_s.mean() + 1e-12


def test_a_batch_of_few_tokens_is_also_spread_over_more_micro_batches(setup13b):
    """DataMix1's short samples fill about as many 8k-token rows as PP 4 has ranks. pipetune also
    times each batch spread over P and 2P micro-batches and keeps that where it simulates faster:
    never slower than the same search without those counts, faster on some batches, and every
    sample still in exactly one micro-batch."""
    model, _ = setup13b
    tuned, plain = planner(setup13b), planner(setup13b)
    plain.finer_counts = ()
    assert tuned.finer_counts == (4, 8)
    spread = 0
    for meta in metas("datamix1", n=4):
        a, b = tuned.plan(meta), plain.plan(meta)
        rows = PackingConfig(mbs=1, max_seq_len=8192).build(model)(meta.table.lengths, meta.step).num_micro_batches
        assert a.predicted_s <= b.predicted_s + 1e-12 and a.lower_bound_s <= b.lower_bound_s + 1e-12
        assert sorted(int(s) for mb in a.micro_batches for s in mb) == sorted(int(s) for s in meta.table.ids)
        if a.num_micro_batches > rows:
            assert a.mbs == 1 and a.predicted_s < b.predicted_s
            spread += 1
    assert spread >= 2


def test_the_best_static_configuration_may_fix_a_micro_batch_count(setup13b):
    """The fixed configurations pipetune is compared with include the balanced packer at mbs 1
    with each count pipetune may spread a batch over (co-located layouts) and, on the separated
    layout, every size with every count up to four rounds of the ranks, on interleaved layouts every
    size with each count torch's ``Interleaved1F1B`` runs; a fixed count packs at least that many
    micro-batches."""
    from pipetune.plan.layout.compare import StaticKey, static_planners
    from pipetune.plan.layout.planner_config import SplitBackward

    model, cost = setup13b
    static = static_planners(model, cost, max_seq_len=8192, memory_bytes=A100.memory_bytes)
    assert {k for k in static if k.min_micro_batches > 1} == {StaticKey(Mode.BALANCED, 1, n, SplitBackward.OFF) for n in (4, 8)}
    meta = metas("datamix1", n=1)[0]
    assert static[StaticKey(Mode.BALANCED, 1, 8, SplitBackward.OFF)].plan(meta).num_micro_batches >= 8
    assert StaticKey(Mode.BALANCED, 1, 8, SplitBackward.OFF).describe() == "balanced mbs=1 >= 8 micro-batches"
    with pytest.raises(ValueError, match="needs the balanced packer"):
        PlannerConfig(mode="original", max_seq_len=8192, memory_bytes=A100.memory_bytes, min_micro_batches=2)
    separated = CostModel(cost.table, StageLayout.even(40, 4).separated(model.encoder.n_layers, 1, 4))
    fixed = static_planners(model, separated, max_seq_len=8192, memory_bytes=A100.memory_bytes)
    counts = {k.min_micro_batches for k in fixed if k.packer is Mode.BALANCED and k.mbs == 2}
    assert counts == set(range(1, 17))
    assert fixed[StaticKey(Mode.BALANCED, 2, 16, SplitBackward.OFF)].plan(meta).num_micro_batches >= 16
    interleaved = CostModel(cost.table, StageLayout.even(40, 8, chunks_per_rank=2))
    fixed = static_planners(model, interleaved, max_seq_len=8192, memory_bytes=A100.memory_bytes)
    counts = {k.min_micro_batches for k in fixed if k.packer is Mode.BALANCED and k.mbs == 2}
    assert counts == {1, 4, 5, 6, 7, 8, 10, 12, 15, 16}  # torch's Interleaved1F1B at 4 ranks: n a multiple of its n // 4 rounds


@pytest.mark.timeout(90)
def test_a_replica_whose_planner_dies_or_is_late_falls_back_alone(setup13b):
    """DP 3: each replica's lead plans its own share in its own process. Replica 1's process is
    killed and replica 2's search has no time: each runs its planner's fallback of its own share of
    the same split, saying why, replica 0 its searched plan, and the three partition the batch."""
    ms = metas("datamix2", n=2)
    shares = [ReplicaShare(3, r, ShareCost(setup13b[1], packed_tokens=8192)) for r in range(3)]

    def start(s):
        return AsyncPlanner(SharePlanner(planner(setup13b), s), ms.__getitem__, budget_s=0.0 if s.replica == 2 else None, lookahead=0)

    with ThreadPoolExecutor(3) as pool:  # the three processes start at once, as the replicas' leads start theirs
        sources = [PlanSource(tuned, read=ms.__getitem__, share=s) for tuned, s in zip(pool.map(start, shares), shares)]
    os.kill(sources[1].tuned._proc.pid, signal.SIGKILL)
    made = [src(1) for src in sources]
    plans = [m.plan for m in made]
    steps = [src.pop(1) for src in sources]
    assert [p.fallback for p in plans] == [False, True, True]
    assert steps[0].fallback_reason == ""
    assert "exited with code -9" in steps[1].fallback_reason and "time budget" in steps[2].fallback_reason
    ids = [s for p in plans for s in p.sample_ids()]
    assert sorted(ids) == sorted(ms[1].table.ids.tolist())
    for m, s in zip(made, shares):
        assert sorted(m.plan.sample_ids()) == sorted(m.share.table.ids.tolist()) == sorted(s.of(ms[1]).table.ids.tolist())
        assert m.share.whole == ms[1].totals
    for src in sources:
        src.tuned.close()
