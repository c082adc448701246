"""Data-parallel balance benchmark (simulation): each global batch split over DP pipeline replicas,
round-robin (the data loader's split) vs the balanced split (FLOPs-aware LPT refined by simulated
swaps, ``pipetune.plan.dp_balance``), every replica planned by the pipetune planner.

Per setting (``--settings``: DPxGBS, default DP 8 / 32 / 64 at GBS 1024 / 1024 / 4096) and mix:
the step's time (slowest replica, mean over ``--iters`` batches), slowest / mean replica, the
balanced split's cut vs round-robin, and the planning time on the step's critical path: the wall
clock of one ``split_and_plan`` (the split plus every replica's plan, what rank 0's planner process
makes per step), p50 / p90 over the iterations, with the plans made per step. It fits the async
budget when its p90 is within both ``--budget-s`` (the per-batch planning deadline) and the step
time (one planner process must keep up with the steps). Goal: p50 <= 0.5 s at DP 32, GBS 1024.

Planning runs on one thread: the script pins OMP / MKL / OpenBLAS to one thread before numpy
loads (and threadpoolctl's limit when installed). Latencies are analytical estimates
(``--hardware``), so step times are simulated; planning times are measured on this machine.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse
import json
import platform
import shlex
import sys

import numpy as np

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.data import make_mix
from pipetune.plan.dp_balance import compare_dp
from pipetune.plan.mode import Mode
from pipetune.plan.planner_config import PlannerConfig

try:
    from threadpoolctl import threadpool_limits
except ImportError:
    threadpool_limits = None


def parse_settings(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        dp, _, gbs = item.strip().lower().partition("x")
        if not (dp.isdigit() and gbs.isdigit()):
            raise SystemExit(f"--settings: {item!r} is not DPxGBS (e.g. 32x1024)")
        out.append((int(dp), int(gbs)))
    return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="8x1024,32x1024,64x4096", help="comma-separated DPxGBS (replicas x global batch)")
    ap.add_argument("--model", default="13b")
    ap.add_argument("--mixes", default="datamix2,datamix3")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--iters", type=int, default=20, help="batches measured per setting and mix")
    ap.add_argument("--warmup", type=int, default=2, help="batches planned first and not counted (planner caches)")
    ap.add_argument("--budget-s", type=float, default=2.0, help="per-batch planning deadline (--pipetune.budget_s)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    settings = parse_settings(args.settings)
    if threadpool_limits is not None:
        threadpool_limits(1)
    model = load_model_config(args.model)
    hw = load_hardware(args.hardware)
    cost = CostModel(analytical_table(model, hw, tp=args.tp), StageLayout.even(model.backbone.n_layers, args.pp), recompute_encoder=True)
    planner = PlannerConfig(mode=Mode.PIPETUNE, max_seq_len=args.max_seq_len, memory_bytes=hw.memory_bytes).build(model, cost)
    mixes = {mix: make_mix(mix, args.samples, 0) for mix in args.mixes.split(",")}
    results = {
        f"dp{dp}_gbs{gbs}": {
            mix: compare_dp(model, planner, data, dp=dp, gbs=gbs, max_seq_len=args.max_seq_len, iters=args.iters, warmup=args.warmup)
            for mix, data in mixes.items()
        }
        for dp, gbs in settings
    }
    command = shlex.join([os.path.relpath(sys.executable), *sys.argv])
    run = {
        "command": command,
        "settings": {**vars(args), "settings": [f"{dp}x{gbs}" for dp, gbs in settings]},
        "threads": {"env": {v: os.environ[v] for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")},
                    "threadpoolctl": threadpool_limits is not None},
        "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__},
    }
    if args.json:
        print(json.dumps({**run, "results": results}, indent=2))
        return
    print(f"command: {command}")
    print(f"{args.model} {args.hardware} TP{args.tp} PP{args.pp}, max_seq_len {args.max_seq_len}, pipetune planner; mixes {args.mixes} "
          f"({args.samples} samples); {args.iters} batches per setting after {args.warmup} warm-up; step times simulated")
    print(f"planning: one thread (OMP/MKL/OPENBLAS_NUM_THREADS=1, threadpoolctl {'on' if threadpool_limits else 'absent'}) "
          f"on {run['machine']['cpu']} ({run['machine']['cpus']} CPUs), python {run['machine']['python']}, numpy {np.__version__}; "
          f"budget: p90 <= min(--budget-s {args.budget_s:g}, step time)")
    print(f"{'setting':13} {'mix':9} {'split':11} {'step (s)':>9} {'slowest/mean':>13} {'cut vs RR':>10} {'plans/step':>11} "
          f"{'plan p50 (s)':>13} {'plan p90 (s)':>13} {'fits budget':>12}")
    for (dp, gbs), rows in zip(settings, results.values()):
        for mix, r in rows.items():
            for name in ("round_robin", "balanced"):
                d = r[name]
                budget = min(args.budget_s, d["mean_iter_s"])
                cut = f"{r['cut_vs_round_robin']:.1%}" if name == "balanced" else "-"
                fits = "yes" if d["planning_s_p90"] <= budget else "NO"
                print(f"{f'DP{dp} GBS{gbs}':13} {mix:9} {name:11} {d['mean_iter_s']:9.3f} {d['spread_max_over_mean']:13.3f} {cut:>10} "
                      f"{d['plans_per_step']:11.1f} {d['planning_s_p50']:13.3f} {d['planning_s_p90']:13.3f} {fits:>12}")


if __name__ == "__main__":
    main()
