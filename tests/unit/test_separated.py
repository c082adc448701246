"""The separated layout (DIP): partitioner rules, the dual-queue greedy interleaver, the separated
planner and ``pipetune plan --layout separated``."""

import json
from dataclasses import replace

import numpy as np
import pytest

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.cost.cost_model import MicroBatchShapes
from pipetune.cost.latency_table import Curve
from pipetune.data import BatchStream, batch_meta, make_mix
from pipetune.packing.sub_batches import SubBatches
from pipetune.plan import IterationPlan
from pipetune.plan.layout.planner_config import PlannerConfig
from pipetune.plan.separated.interleave import Problem
from pipetune.plan.separated.partitioner import image_sub_batch_size, partition
from pipetune.plan.separated.separated_planner import SeparatedPlanner
from pipetune.schedule import Placement, ScheduleTable
from pipetune.schedule.table import Buffer
from pipetune.schedule.lowering import lower_all
from pipetune.simulate import Latencies, compile_schedule, simulate
from pipetune.simulate.simulator import buffer_bytes
from test_lowering_fifo import check
from pipetune.data.images import ImageSizing

H100 = load_hardware("h100")


def random_case(rng, *, trained=None):
    P, K, m = int(rng.integers(2, 6)), int(rng.integers(1, 4)), int(rng.integers(1, 12))
    sub = SubBatches.split(rng.integers(0, 9, m) * (rng.random(m) < 0.85), int(rng.integers(1, 5)))
    n, E = sub.count, P * K
    trained = bool(rng.random() < 0.5) if trained is None else trained
    lat = Latencies(rng.random((m, P)), 2 * rng.random((m, P)), 0.5 * rng.random((n, E)), 0.05 * rng.random(m), rng.random((m, P)),
                    rng.random(n), encoder_bwd=rng.random((n, E)) if trained else None, encoder_p2p=0.05 * rng.random(n),
                    feature_p2p=0.05 * rng.random(n), encoder_activation_bytes=rng.random((n, E)) if trained else None)
    return Placement.separated(P, E, encoder_trained=trained), tuple(sub.parent.tolist()), lat


def one_micro_batch_needs(placement, parent, lat) -> np.ndarray:
    """The most memory any one micro-batch (with its images) allocates on each rank."""
    proto = ScheduleTable(placement=placement, num_micro_batches=lat.fwd.shape[0], ranks=(), sub_mb_parent=parent)
    need = np.zeros((proto.num_micro_batches, placement.num_ranks))
    for kind, c, u, made, _ in proto.buffers():
        arr = buffer_bytes(lat, kind)
        j = u if kind is Buffer.ACTIVATION else parent[u]
        need[j, placement.rank_of(made)] += arr[u, c] if arr.ndim == 2 else arr[u]
    return need.max(axis=0)


def test_greedy_tables_are_valid_fit_memory_and_time_like_the_simulator():
    """Every action once, in dependency order (``validate``, no deadlock), peak under the limit in
    the greedy's own accounting, and the simulator times the table to the greedy's makespan and
    peak; the lowered messages run on the strict in-order transports."""
    rng = np.random.default_rng(11)
    for t in range(150):
        placement, parent, lat = random_case(rng)
        order = rng.permutation(lat.fwd.shape[0])
        lead = int(rng.integers(0, 3))
        need = one_micro_batch_needs(placement, parent, lat)
        limit = need * rng.uniform(1.0, 3.0) if t % 3 else None
        problem = Problem(placement, parent, lat)
        g = problem.run(problem.point_keys(order, lead, -lead), limit)
        assert g is not None, "a table must exist when one micro-batch fits on its own"
        g.table.validate()
        assert sorted(map(str, (a for r in g.table.ranks for a in r))) == sorted(map(str, g.table.expected_actions()))
        compile_schedule(g.table)
        if limit is not None:
            assert (g.peak_bytes <= limit + 1e-9).all()
        res = simulate(g.table, lat)
        assert res.makespan == pytest.approx(g.makespan, rel=1e-12)
        assert res.peak_bytes == pytest.approx(g.peak_bytes, rel=1e-12, abs=1e-12)
        if t % 10 == 0:
            check(g.table)


def test_greedy_refuses_a_limit_no_micro_batch_fits():
    placement, parent, lat = random_case(np.random.default_rng(2), trained=True)
    need = one_micro_batch_needs(placement, parent, lat)
    problem = Problem(placement, parent, lat)
    assert problem.run(problem.point_keys(np.arange(lat.fwd.shape[0]), 0, 0), need * 0.5) is None


def _per_action(placement, parent, lat):
    """``Problem``'s lists, derived action by action from ``ScheduleTable``'s definitions
    (``producers``, ``consumers``, ``buffers``) and the simulator's durations and message times."""
    from pipetune.schedule.lowering import Message
    from pipetune.schedule.table import Op
    from pipetune.simulate.simulator import durations, message_costs

    proto = ScheduleTable(placement=placement, num_micro_batches=lat.fwd.shape[0], ranks=(), sub_mb_parent=tuple(parent))
    acts = proto.expected_actions()
    index = {a: i for i, a in enumerate(acts)}
    rank = [placement.rank_of(a) for a in acts]
    group = [parent[a.unit] if a.is_encoder else a.unit for a in acts]
    dur = [float(durations(lat, a.module, a.op)[a.unit, a.chunk]) for a in acts]
    alloc, free, need = [0.0] * len(acts), [0.0] * len(acts), np.zeros((proto.num_micro_batches, placement.num_ranks))
    for kind, c, u, made, freed in proto.buffers():
        arr = buffer_bytes(lat, kind)
        nbytes = float(arr[u, c] if arr.ndim == 2 else arr[u])
        alloc[index[made]] += nbytes
        free[index[freed]] += nbytes
        need[group[index[made]], rank[index[made]]] += nbytes
    out = tuple(tuple((index[c], 0.0 if rank[index[c]] == rank[i] else float(message_costs(lat, Message(a, c).kind)[Message(a, c).unit]))
                      for c in proto.consumers(a)) for i, a in enumerate(acts))
    work = [0.0] * placement.num_ranks
    for r, d in zip(rank, dur):
        work[r] += d
    return dict(acts=acts, rank=rank, dur=dur, forward=[a.op is Op.FORWARD for a in acts], group=group, alloc=alloc, free=free,
                need=need.tolist(), out=out, waiting=[len(proto.producers(a)) for a in acts], work=work)


def test_the_greedy_s_problem_is_the_table_s_actions_messages_and_buffers():
    """``Problem`` builds its lists with numpy from the table's index arithmetic; they equal, bit
    for bit, what each action's own definitions give, on separated (trained and frozen encoder)
    and co-located placements."""
    rng = np.random.default_rng(62)
    cases = [random_case(rng) for _ in range(150)]
    for _ in range(30):
        m, S, trained = int(rng.integers(1, 6)), int(rng.integers(1, 4)), bool(rng.random() < 0.5)
        lat = Latencies(rng.random((m, S)), rng.random((m, S)), rng.random((m, 1)), rng.random(m), rng.random((m, S)), rng.random(m),
                        encoder_bwd=rng.random((m, 1)) if trained else None, feature_p2p=rng.random(m),
                        encoder_activation_bytes=rng.random((m, 1)) if trained else None)
        cases.append((Placement.colocated(S, encoder=True, encoder_trained=trained), tuple(range(m)), lat))
    for placement, parent, lat in cases:
        problem = Problem(placement, parent, lat)
        for name, expected in _per_action(placement, parent, lat).items():
            assert getattr(problem, name) == expected, name


def _rule_by_rule(problem, prio, limit):
    """The module doc's greedy, each round over every action (no queues, no caching): the rank
    that can start an action first (ties: the lower rank), on it a forward and a backward that can
    start at once alternating, else the one that can, else the one that can start first (ties:
    priority); a forward of a micro-batch not yet admitted only when all its forward memory fits
    every rank. Returns each rank's list, or None when no action may run."""
    n, R = problem.num_actions, problem.num_ranks
    producers = [[] for _ in range(n)]
    for i, edges in enumerate(problem.out):
        for j, comm in edges:
            producers[j].append((i, comm))
    on_rank = [[i for i in range(n) if problem.rank[i] == r] for r in range(R)]
    end, done = [None] * n, [False] * n
    t_last, last_fwd, held = [0.0] * R, [False] * R, [0.0] * R
    admitted = set()
    lists = [[] for _ in range(R)]
    for _ in range(n):
        best = None
        for r in range(R):
            kinds = {True: [], False: []}
            for i in on_rank[r]:
                if done[i] or any(end[p] is None for p, _ in producers[i]):
                    continue
                g = problem.group[i]
                if problem.forward[i] and limit is not None and g not in admitted and any(
                        held[x] + problem.need[g][x] > limit[x] for x in range(R)):
                    continue
                ready = max([end[p] + c for p, c in producers[i]], default=0.0)
                kinds[problem.forward[i]].append((max(ready, t_last[r]), prio[i], i))
            now = {f: min((e for e in es if e[0] == t_last[r]), default=None) for f, es in kinds.items()}
            if now[True] and now[False]:
                pick = now[not last_fwd[r]]
            else:
                pick = now[True] or now[False] or min((min(es) for es in kinds.values() if es), default=None)
            if pick is not None and (best is None or pick[0] < best[0]):
                best = (pick[0], r, pick[2])
        if best is None:
            return None
        start, r, i = best
        g = problem.group[i]
        if g not in admitted:
            admitted.add(g)
            held = [h + x for h, x in zip(held, problem.need[g])]
        held[r] -= problem.free[i]
        end[i], done[i] = start + problem.dur[i], True
        t_last[r], last_fwd[r] = end[i], problem.forward[i]
        lists[r].append(i)
    return tuple(map(tuple, lists))


def test_the_greedy_follows_its_rules():
    """The greedy (queues by rank and kind, each rank's next action found again only when something
    it depends on changed, forwards that do not fit set aside) makes the choices its rules make
    one by one, with and without a memory limit (``_rule_by_rule``); a third of the cases in whole
    seconds, where ties between ranks and kinds are common."""
    rng = np.random.default_rng(7)
    limited = 0
    for t in range(150):
        placement, parent, lat = random_case(rng)
        if t % 3 == 0:
            whole = {f: np.ceil(3 * getattr(lat, f)) for f in ("fwd", "bwd", "encoder", "encoder_bwd", "p2p", "encoder_p2p", "feature_p2p")}
            lat = replace(lat, **whole, bwd_input=whole["bwd"] / 2)
        problem = Problem(placement, parent, lat)
        m = lat.fwd.shape[0]
        keys = problem.point_keys(rng.permutation(m), int(rng.integers(0, 4)), int(rng.integers(-3, m + 1)))
        limit = one_micro_batch_needs(placement, parent, lat) * rng.uniform(1.0, 2.0) if t % 2 else None
        g = problem.run(keys, limit)
        assert _rule_by_rule(problem, keys, limit) == g.lists
        limited += limit is not None and not (problem.run(keys).peak_bytes <= limit).all()
    assert limited >= 20, limited  # cases where the limit binds (the greedy without it passes it)

def test_greedy_alternates_forward_and_backward_when_both_can_start():
    """One rank, no encoder work: once a backward is ready, forwards and backwards alternate (1F1B)."""
    m = 5
    placement = Placement.separated(1, 1, encoder_trained=False)
    lat = Latencies(np.ones((m, 1)), np.ones((m, 1)), np.zeros((0, 1)), np.zeros(m))
    problem = Problem(placement, (), lat)
    g = problem.run(problem.point_keys(np.arange(m), 0, 0))
    assert [str(a) for a in g.table.ranks[0]] == ["0F0", "0B0", "0F1", "0B1", "0F2", "0B2", "0F3", "0B3", "0F4", "0B4"]
    assert g.makespan == pytest.approx(2 * m)


def test_sub_batches_split_images_and_pad_the_last():
    sub = SubBatches.split(np.array([5, 0, 4, 1]), 2)
    assert sub.as_tuples() == ((0, 0, 2), (0, 2, 2), (0, 4, 1), (2, 0, 2), (2, 2, 2), (3, 0, 1))
    assert sub.charged.tolist() == [2] * 6
    assert SubBatches.one_per_micro_batch(np.array([3, 0])).charged.tolist() == [3, 0]


def test_image_sub_batch_size_is_the_smallest_within_95_percent_of_peak_throughput(tiny):
    """Encoder seconds ``a + b x`` for ``x`` images: throughput ``x / (a + b x)`` rises towards
    ``1 / b``; the rule's answer is the smallest integer ``x`` with throughput >= 0.95 of the
    best over 1..X, which is X's: ``x >= 0.95 a X / (a + b X - 0.95 b X)``."""
    model = load_model_config("13b")
    table = analytical_table(model, load_hardware("a100"), tp=1)
    a, b, X = 0.2, 0.01, 48
    grid = np.arange(1.0, 1025.0)
    curves = dict(table.curves, encoder=Curve("images", grid, a + b * grid, np.zeros_like(grid)))
    from dataclasses import replace

    cost = CostModel(replace(table, curves=curves), StageLayout.even(40, 4))
    want = int(np.ceil(0.95 * a * X / (a + b * X - 0.95 * b * X) - 1e-12))
    assert image_sub_batch_size(cost, X) == want == 41
    assert image_sub_batch_size(cost, X, threshold=0.5) == int(np.ceil(0.5 * a * X / (a + b * X - 0.5 * b * X) - 1e-12))


def test_segments_follow_the_encoder_to_backbone_ratio():
    model = load_model_config("dip_5b_8b")
    cost = CostModel(analytical_table(model, H100, tp=4), StageLayout.even(32, 4))
    shapes = MicroBatchShapes(np.array([4096, 4096]), np.array([0, 0]), np.array([8192]), np.array([10]))
    part = partition(model, cost, [shapes], max_seq_len=8192)
    c = cost.stage_costs(shapes)
    assert part.backbone_s == pytest.approx((c.fwd + c.bwd).sum())
    one = cost.stage_costs(MicroBatchShapes(np.array([1]), np.array([0]), np.array([1]), np.array([part.image_sub_batch])))
    assert part.encoder_s == pytest.approx(one.encoder.sum() + one.encoder_bwd.sum())
    assert part.segments == max(1, int(part.encoder_s // part.backbone_s))
    assert len(part.layout.encoder_chunks) == 4 * part.segments and part.layout.encoder_chunks[-1][1] == model.encoder.n_layers
    with pytest.raises(ValueError, match="has none"):
        partition(load_model_config("13b").__class__(name="text", backbone=model.backbone), cost, [shapes], max_seq_len=8192)


@pytest.fixture(scope="module")
def heavy():
    model = load_model_config("dip_5b_8b")
    cost = CostModel(analytical_table(model, H100, tp=4), StageLayout.even(32, 4), recompute_encoder=True)
    data = make_mix("datamix3", 4000, 0)
    stream = BatchStream(num_rows=len(data), gbs=64, seed=0)
    metas = [batch_meta(data, stream, s, images=ImageSizing.for_model(model), max_seq_len=4096) for s in range(2)]
    layout = StageLayout.even(32, 4).separated(model.encoder.n_layers, 1, 8)
    return model, cost.with_layout(layout), metas


def test_separated_plans_fit_simulate_to_their_prediction_and_round_trip(heavy):
    model, cost, metas = heavy
    planner = PlannerConfig(max_seq_len=4096, memory_bytes=H100.memory_bytes).build(model, cost)
    balanced = PlannerConfig(mode="balanced", max_seq_len=4096, memory_bytes=H100.memory_bytes).build(model, cost)
    assert isinstance(planner, SeparatedPlanner)
    for meta in metas:
        plan = planner.plan(meta)
        assert plan.separated and plan.image_sub_batch == 8 and max(plan.peak_bytes) <= planner.budget
        costs = cost.stage_costs(plan.shapes(meta))
        assert simulate(plan.table(), Latencies.from_costs(costs)).makespan == pytest.approx(plan.predicted_s)
        assert plan.lower_bound_s <= plan.predicted_s
        assert plan.image_ranges(plan.shapes(meta).images) == list(costs.sub_batches.as_tuples())
        assert plan.predicted_s <= balanced.plan(meta).predicted_s + 1e-9
        back = IterationPlan.from_json(plan.to_json(), meta.table.ids)
        assert back == plan
        check(plan.table())
        assert len(lower_all(plan.table())) == 4


def test_separated_plans_predict_contention_like_the_simulator(heavy):
    model, cost, metas = heavy
    hot = CostModel(replace(cost.table, contention=0.3), cost.layout, recompute_encoder=True)
    plan = PlannerConfig(max_seq_len=4096, memory_bytes=H100.memory_bytes).build(model, hot).plan(metas[0])
    lat = Latencies.from_costs(hot.stage_costs(plan.shapes(metas[0])))
    assert plan.predicted_s == pytest.approx(simulate(plan.table(), lat).makespan)
    assert plan.predicted_s > simulate(plan.table(), replace(lat, contention=0.0)).makespan


def test_malformed_separated_plans_are_refused_by_name(heavy):
    from pipetune.plan import PlanError

    model, cost, metas = heavy
    plan = PlannerConfig(mode="balanced", mbs=1, max_seq_len=4096, memory_bytes=H100.memory_bytes).build(model, cost).plan(metas[0])
    assert len(set(plan.sub_mb_parent)) > 1
    for edit, message in (
        (lambda r: r.update(image_sub_batch=0), "a separated plan needs image_sub_batch >= 1"),
        (lambda r: r.update(sub_mb_parent=r["sub_mb_parent"][1:] + [r["sub_mb_parent"][0]]), "numbered micro-batch by micro-batch"),
        (lambda r: r["placement"].update(encoder=r["placement"]["encoder"][:-1]), "is missing|out of range"),
        (lambda r: r["ranks"][1].remove(next(a for a in reversed(r["ranks"][1]) if a.startswith("E"))), "action E1B.* is missing"),
        (lambda r: r["ranks"][0].insert(0, r["ranks"][0].pop()), "has not run before it"),
    ):
        raw = json.loads(plan.to_json())
        edit(raw)
        with pytest.raises(PlanError, match=message):
            IterationPlan.from_json(json.dumps(raw))
    images = plan.shapes(metas[0]).images.copy()
    images[int(np.argmax(images))] += 8
    with pytest.raises(PlanError, match="needs .* sub-microbatches"):
        plan.image_ranges(images)
    with pytest.raises(PlanError, match="only a co-located plan .* runs serially"):
        plan.serialised()


def test_separated_layout_wins_on_the_heavy_encoder_in_simulation(capsys):
    """DIP's setting: a trained 5B encoder, Llama3-8B, TP 4, PP 4, H100 estimate, image-heavy
    DataMix3: the separated layout beats both co-located layouts (here by far: stage 0 of a
    co-located layout carries the whole encoder)."""
    from pipetune.cli.main import main

    assert main(["plan", "--layout", "separated", "--model", "dip_5b_8b", "--tp", "4", "--pp", "4", "--hardware", "h100",
                 "--mix", "datamix3", "--samples", "3000", "--gbs", "64", "--max-seq-len", "4096", "--iters", "2",
                 "--recompute-encoder", "--layout-sample", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["partition"]["image_sub_batch"] >= 1 and out["partition"]["segments"] >= 1
    assert out["separated"]["encoder_layers_per_chunk"] and sum(out["separated"]["encoder_layers_per_chunk"]) == 40
    assert out["separated"]["mean_iter_s"] < min(out["even"]["mean_iter_s"], out["split"]["mean_iter_s"])
    assert out["separated"]["cut_vs_best_colocated"] > 0.2


@pytest.mark.parametrize("argv,message", [
    (["--layout", "diagonal"], "--layout 'diagonal': expected auto, even, separated or layers per stage"),
    (["--layout", "separated", "--dp", "2"], "leave out --dp"),
    (["--layout", "7,1"], "needs 2 stages summing to the model's 4 layers"),
])
def test_plan_cli_refuses_bad_layouts_in_one_line(capsys, argv, message):
    from pipetune.cli.main import main

    assert main(["plan", "--model", "tiny", "--pp", "2", "--gbs", "16", "--max-seq-len", "1024", "--mix", "datamix2",
                 "--samples", "200", "--iters", "1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pipetune: error: ") and message in err[0]


def test_separated_layout_needs_an_encoder(tmp_path, capsys):
    from pipetune.cli.main import main

    f = tmp_path / "text.toml"
    f.write_text('name = "text"\n[backbone]\nn_layers = 4\ndim = 128\nffn_dim = 384\nn_heads = 4\nn_kv_heads = 2\nvocab_size = 512\n')
    assert main(["plan", "--model", str(f), "--pp", "2", "--gbs", "16", "--max-seq-len", "1024", "--mix", "0:0:1", "--samples", "200",
                 "--iters", "1", "--layout", "separated"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a model with a vision encoder" in err[0]
