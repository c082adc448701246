"""pipetune over the wider schedule space (issue #39), in simulation: 13B + SigLIP (A100 estimate,
TP 4, GBS 128, max_seq_len 8192) at PP 4 and PP 8 on DataMix1/2/3.

Spaces compared, each planned per iteration by pipetune and, as the baseline, by the best static
configuration of the same space (one packer, micro-batch size and, where the space has it,
backward split, chosen once for the run over the same iterations; ``pipetune.plan.layout.compare``):

* ``1F1B``: one chunk per rank, whole backwards (the space before #39);
* ``+ZB``: the planner chooses per iteration between 1F1B and its zero-bubble twin (ZB-H1);
* ``V=2 +ZB``: the same over an interleaved layout with two chunks per rank (``--chunks-per-rank``:
  one such space per count given, e.g. ``2 3 4``);
* ``V-shape``: two chunks per rank in a V (TorchTitan's ``ZBVZeroBubble`` / ``DualPipeV``
  placement), backwards split as those jobs always do.

Then one memory-bound row (OptPipe's activation offload, ``--memory-gib``): 13B on an H100
estimate (PCIe Gen5 host link), PP 8, rows of 2,048 tokens, DataMix3, whole backwards, and a
memory limit at which 1F1B fits only one row per micro-batch while the search would pick more:
pipetune and the best static configuration, each without and with offload where memory binds.

TorchTitan's own V schedules are priced too: torch's ``ZBVZeroBubble`` and ``DualPipeV`` tables
(``pipetune.schedule.schedules.zbv_zero_bubble``, ``dual_pipe_v``) over the packings of every
fixed configuration of the V-shape space, in packing order, the best configuration chosen once for
the run (DualPipeV only where every batch has at least ``2P`` micro-batches, as torch requires).

The "best static" column is the best over all the spaces (it may itself interleave or split).
Printed per row: mean iteration time (s) of pipetune in each space and of that best static
configuration; pipetune's cut against it; pipetune's mean gap to its lower bound; the ceiling
``best static / pipetune's bound - 1``: no plan the planner could find for those packings beats
the bound, so pipetune cannot cut the best static configuration by more than that (the bound is
``placement_lower_bound`` of the space's split table, which holds for whole backwards too); search
time per iteration, the p50 of the space where it is largest / the max over all (ms, one thread;
noisy unless the machine is quiet; automatic GC off, as TorchTitan's trainer runs, unless
``--python-gc``). Compiled tables are cached per
micro-batch count, so early iterations of a run search slower than later ones: all are counted.
``--gbs 1024`` measures the search at the issue's larger batch.
"""

from __future__ import annotations

import argparse
import gc

import numpy as np

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.cost.memory import model_state_bytes
from pipetune.data import make_mix
from pipetune.data import batch_meta
from pipetune.data.images import ImageSizing
from pipetune.data.stream import BatchStream
from pipetune.plan.layout.compare import compare_modes, static_planners
from pipetune.plan.mode import Mode
from pipetune.schedule.schedules import dual_pipe_v, zbv_zero_bubble
from pipetune.schedule.table import ChunkStyle, ScheduleError
from pipetune.simulate import simulate


def torch_v_tables(model, cost, data, *, gbs: int, max_seq_len: int, memory_bytes: float, iters: int) -> dict[str, tuple[float, str]]:
    """Mean iteration time of torch's ZB-V and DualPipeV tables at their best fixed configuration
    (module doc), with the configuration: ``{name: (mean s, description)}``; memory is checked by
    each table's simulated peak."""
    stream = BatchStream(num_rows=len(data), gbs=gbs, seed=0)
    metas = [batch_meta(data, stream, step, images=ImageSizing.for_model(model), max_seq_len=max_seq_len) for step in range(iters)]
    P, trained, states = cost.num_stages // 2, cost.encoder_trainable, model_state_bytes(cost)
    best: dict[str, tuple[float, str]] = {}
    for key, planner in static_planners(model, cost, max_seq_len=max_seq_len, memory_bytes=memory_bytes, split_backward="on").items():
        spans: dict[str, list[float]] = {"ZBVZeroBubble": [], "DualPipeV": []}
        for meta in metas:
            plan = planner.plan(meta)
            lat = plan.latencies(cost, meta)
            for name, build in (("ZBVZeroBubble", zbv_zero_bubble), ("DualPipeV", dual_pipe_v)):
                try:
                    sim = simulate(build(P, range(plan.num_micro_batches), encoder=True, encoder_trained=trained), lat)
                except ScheduleError:  # DualPipeV: fewer than 2P micro-batches
                    continue
                fits = (sim.peak_bytes + states).max() <= planner.budget
                spans[name].append(sim.makespan if fits else np.inf)
        for name, row in spans.items():
            if len(row) == len(metas) and np.mean(row) < best.get(name, (np.inf,))[0]:
                best[name] = (float(np.mean(row)), key.describe())
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--pp", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--mixes", nargs="+", default=["datamix1", "datamix2", "datamix3"])
    ap.add_argument("--gbs", type=int, default=128)
    ap.add_argument("--chunks-per-rank", type=int, nargs="+", default=[2], help="interleaved spaces (with split backward): chunks per rank of each")
    ap.add_argument("--python-gc", action="store_true", help="time the search with Python's automatic GC on (a TorchTitan job turns it off)")
    ap.add_argument("--memory-gib", type=float, default=14.0, help="the memory-bound row's memory per GPU")
    args = ap.parse_args()
    loop = ChunkStyle.LOOP
    spaces = ([("1F1B", 1, "off", loop), ("+ZB", 1, "auto", loop)] + [(f"V={v} +ZB", v, "auto", loop) for v in args.chunks_per_rank]
              + [("V-shape", 2, "on", ChunkStyle.V)])
    if not args.python_gc:
        gc.disable()  # as in a TorchTitan job: its trainer collects every training.gc_freq steps, outside the step
    model = load_model_config("13b")
    hw = load_hardware("a100")
    table = analytical_table(model, hw, tp=4)
    print(f"13b + SigLIP, A100 estimate, TP 4, GBS {args.gbs}, max_seq_len 8192, {args.iters} iterations; times in s")
    print(f"{'PP':>2} {'mix':9} " + " ".join(f"{name:>8}" for name, *_ in spaces)
          + f" {'best static':>12} {'(its space)':40} {'cut':>6} {'gap LB':>7} {'ceiling':>8} {'search p50/max':>15}"
          f" {'torch ZBV':>10} {'DualPipeV':>10}")
    for pp in args.pp:
        for mix in args.mixes:
            data = make_mix(mix, args.samples, seed=0)
            runs = {}
            for name, V, split, style in spaces:
                gc.collect()  # what the job's periodic collection does between steps, outside the timed search
                cost = CostModel(table, StageLayout.even(model.backbone.n_layers, pp * V, chunks_per_rank=V, style=style))
                runs[name] = compare_modes(model, cost, data, gbs=args.gbs, max_seq_len=8192, memory_bytes=hw.memory_bytes, iters=args.iters,
                                           modes=(Mode.PIPETUNE,), split_backward=split)
            v_cost = CostModel(table, StageLayout.even(model.backbone.n_layers, pp * 2, chunks_per_rank=2, style=ChunkStyle.V))
            stock = torch_v_tables(model, v_cost, data, gbs=args.gbs, max_seq_len=8192, memory_bytes=hw.memory_bytes, iters=args.iters)
            best_name = min(runs, key=lambda n: runs[n]["best-static"].iter_s.mean())
            static = runs[best_name]["best-static"]
            name, pt = min(((n, r["pipetune"]) for n, r in runs.items()), key=lambda x: x[1].iter_s.mean())
            cut = 1 - pt.iter_s.mean() / static.iter_s.mean()
            gap = float((pt.iter_s / pt.lower_bound_s - 1).mean())
            ceiling = float(static.iter_s.mean() / pt.lower_bound_s.mean() - 1)
            p50 = max(np.percentile(r["pipetune"].search_s, 50) for r in runs.values()) * 1e3  # the slowest space's
            top = max(r["pipetune"].search_s.max() for r in runs.values()) * 1e3
            print(f"{pp:2} {mix:9} " + " ".join(f"{r['pipetune'].iter_s.mean():8.3f}" for r in runs.values())
                  + f" {static.iter_s.mean():12.3f} {best_name + ': ' + static.choice:40} {cut:6.1%} {gap:7.1%} {ceiling:8.1%}"
                  f" {p50:7.0f} / {top:.0f} " + " ".join(f"{stock[k][0]:10.3f}" if k in stock else f"{'-':>10}" for k in ("ZBVZeroBubble", "DualPipeV"))
                  + f"   (pipetune's best: {name}; torch's V tables at " + "; ".join(f"{k}: {c}" for k, (_, c) in stock.items()) + ")")
    memory_bound(args)


def memory_bound(args) -> None:
    """The memory-bound row (module doc): pipetune and the best static configuration without and
    with offload, their gaps to pipetune's bound, and pipetune's search time."""
    model = load_model_config("13b")
    hw = load_hardware("h100")
    cost = CostModel(analytical_table(model, hw, tp=4), StageLayout.even(model.backbone.n_layers, 8))
    data = make_mix("datamix3", args.samples, seed=0)
    runs = {off: compare_modes(model, cost, data, gbs=args.gbs, max_seq_len=2048, memory_bytes=args.memory_gib * 2**30, iters=args.iters,
                               modes=(Mode.PIPETUNE,), offload=off) for off in (False, True)}
    print(f"\nmemory-bound: 13b, H100 estimate, TP 4, PP 8, GBS {args.gbs}, max_seq_len 2048, datamix3, {args.memory_gib:g} GiB per GPU, "
          "whole backwards; times in s")
    print(f"{'offload':8} {'pipetune':>9} {'(mbs)':16} {'gap LB':>7} {'search p50/max':>15} {'best static':>12}  (its configuration)")
    for off, r in runs.items():
        pt, st = r["pipetune"], r["best-static"]
        gap = float((pt.iter_s / pt.lower_bound_s - 1).mean())
        print(f"{'on' if off else 'off':8} {pt.iter_s.mean():9.3f} {str(dict(sorted(pt.mbs.items()))):16} {gap:7.1%} "
              f"{np.percentile(pt.search_s, 50) * 1e3:7.0f} / {pt.search_s.max() * 1e3:.0f} {st.iter_s.mean():12.3f}  ({st.choice})")


if __name__ == "__main__":
    main()
