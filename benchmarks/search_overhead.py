"""Planner search time per iteration at GBS 128 / 256 / 512 / 1024 (13B, TP 4, PP 4, A100 estimate).

Plans ``--iters`` batches of DataMix2 in ``pipetune`` mode on one thread and prints the median,
p90 and max search time and the mean number of micro-batches. Goal (issue 5): <= 0.05 s at GBS 128
and <= 0.3 s at GBS 1024 on one core; PipeTune reports < 0.2 s and < 1.5 s (Fig. 8).

Then the cost of scoring candidates by expected time under per-action jitter (issue 14): at GBS
128 and 512, search time p50 / max with ``PlannerConfig.jitter_draws`` 0, 8 and 16, and how
often the chosen plan (micro-batches, order or encoder placement) and its micro-batch size differ
from the deterministic search's, and the mean cut in expected time against the deterministic
search's plans (both scored on the same draws). Analytical tables carry no variability model, so one is
assumed (``--log-var``, ``--log-var-s``: log-ratio variance ``log_var + log_var_s / d`` of a
stage's forward + backward and of an encoder forward); it is not measured on a GPU.

Last, the cost of pricing contention (``pipetune.simulate.contention``; ``--contention`` kappa,
0.3 by default: what calibration found on the 2-core test machine with a background process) at
GBS 128 and 512: search time p50 / max with kappa 0 and kappa, and how often the plan and its
micro-batch size change.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.cost.variability import Spread, Variability
from pipetune.data import BatchStream, batch_meta, make_mix
from pipetune.plan.layout.planner_config import PlannerConfig
from pipetune.simulate.jitter import expected_time

DRAWS = (0, 8, 16)
JITTER_GBS = (128, 512)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--mix", default="datamix2")
    ap.add_argument("--log-var", type=float, default=0.0025, help="assumed log-ratio variance floor (0.0025: 5 %% sd)")
    ap.add_argument("--log-var-s", type=float, default=2.5e-4, help="assumed log-ratio variance x seconds (short actions)")
    ap.add_argument("--contention", type=float, default=0.3, help="assumed contention kappa for the last section")
    args = ap.parse_args()
    model = load_model_config("13b")
    hw = load_hardware("a100")
    spread = Spread(log_var=args.log_var, log_var_s=args.log_var_s, min_s=1e-3)
    table = replace(analytical_table(model, hw, tp=4), variability=Variability(stage=spread, encoder=spread))
    cost = CostModel(table, StageLayout.even(model.backbone.n_layers, 4))
    data = make_mix(args.mix, 200_000, seed=0)

    def metas(gbs: int) -> list:
        stream = BatchStream(num_rows=len(data), gbs=gbs, seed=0)
        return [batch_meta(data, stream, step, tokens_per_image=576, max_seq_len=8192) for step in range(args.iters)]

    def run(gbs: int, draws: int = 0, kappa: float = 0.0) -> list:
        priced = CostModel(replace(table, contention=kappa), cost.layout) if kappa else cost
        planner = PlannerConfig(max_seq_len=8192, memory_bytes=hw.memory_bytes, jitter_draws=draws).build(model, priced)
        return [planner.plan(meta) for meta in metas(gbs)]

    def changes(plans: list, base: list) -> tuple[float, float]:
        """How often ``plans`` differ from ``base``'s: the plan (micro-batches, order or encoder
        placement), and its micro-batch size."""
        return (float(np.mean([(p.micro_batches, p.ranks) != (b.micro_batches, b.ranks) for p, b in zip(plans, base)])),
                float(np.mean([p.mbs != b.mbs for p, b in zip(plans, base)])))

    def expected(plan, meta, draws: int) -> float:
        """``plan``'s expected time on the draws the planner (seed 0) uses for this step."""
        lat = plan.latencies(cost, meta)
        return expected_time(plan.table(), lat, table.variability, draws, (0, meta.step))

    print(f"13B TP4 PP4, {args.mix}, pipetune mode, {args.iters} iterations per GBS (one thread)")
    print(f"{'gbs':>5} {'p50 (s)':>8} {'p90 (s)':>8} {'max (s)':>8} {'micro-batches':>13}")
    deterministic = {}
    for gbs in (128, 256, 512, 1024):
        plans = deterministic[gbs] = run(gbs)
        t = np.array([p.search_s for p in plans])
        print(f"{gbs:5d} {np.percentile(t, 50):8.3f} {np.percentile(t, 90):8.3f} {t.max():8.3f} "
              f"{np.mean([p.num_micro_batches for p in plans]):13.1f}")
    print(f"\nexpected time under jitter (assumed spread: log-ratio variance {args.log_var:g} + {args.log_var_s:g} s / d)")
    print(f"{'gbs':>5} {'draws':>5} {'p50 (s)':>8} {'max (s)':>8} {'plan changed':>12} {'mbs changed':>11} {'expected cut':>12}")
    for gbs in JITTER_GBS:
        base = deterministic[gbs]
        for draws in DRAWS:
            plans = base if draws == 0 else run(gbs, draws)
            t = np.array([p.search_s for p in plans])
            changed, mbs = changes(plans, base)
            cut = np.mean([1 - p.predicted_s / expected(b, meta, draws) for p, b, meta in zip(plans, base, metas(gbs))]) if draws else 0.0
            print(f"{gbs:5d} {draws:5d} {np.percentile(t, 50):8.3f} {t.max():8.3f} {changed:12.0%} {mbs:11.0%} {cut:12.2%}")
    print(f"\ncontention priced (kappa {args.contention:g})")
    print(f"{'gbs':>5} {'kappa':>5} {'p50 (s)':>8} {'max (s)':>8} {'plan changed':>12} {'mbs changed':>11}")
    for gbs in JITTER_GBS:
        base = deterministic[gbs]
        for kappa in (0.0, args.contention):
            plans = base if kappa == 0 else run(gbs, kappa=kappa)
            t = np.array([p.search_s for p in plans])
            changed, mbs = changes(plans, base)
            print(f"{gbs:5d} {kappa:5.2f} {np.percentile(t, 50):8.3f} {t.max():8.3f} {changed:12.0%} {mbs:11.0%}")


if __name__ == "__main__":
    main()
