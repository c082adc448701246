"""Data-parallel balance benchmark (simulation): each global batch split over DP pipeline replicas,
round-robin (the data loader's split) vs the balanced split (busiest-rank LPT refined by estimated
swaps, ``pipetune.plan.data_parallel.dp_balance``), every replica planned by the pipetune planner.

Per setting (``--settings``: DPxGBS, default DP 64 / 256 / 1024 at 64 samples a replica) and mix:
the step's time (slowest replica, mean over ``--iters`` batches), slowest / mean replica, the
balanced split's cut vs round-robin, and the planning time on the step's critical path as a job
runs it: the split (every lead computes it) plus the slowest replica's own plan (each replica
plans its share on its own lead, in parallel with the others), p50 / p90 over the iterations.
Every replica's plan is made and timed here one after another on one thread; the critical path
takes the largest. It fits when its p90 is within both ``--budget-s`` (the per-batch planning
deadline) and the step time. Goal: p90 <= 0.5 s and below the step at DP 64, 256 and 1024.

Per-rank host work (``--host-work``, default DP 2 / 64 / 1024 at 64 samples a replica): what one
rank's training thread does on the host per step besides training, timed in one process for one
rank's part: receiving its replica's plan with its share's rows and the batch's totals, reading
its share's metadata from those rows, checking the plan against it and mapping its micro-batches
to rows; a replica's lead also takes its plan from its planner process (unpickling plan and
share), checksums its samples for the leads' coverage check and sends the message. The global
batch is read and split in the lead's planner process, off the training thread (that is the
split time above). Printed with the ratio to DP 2's (goal: within 1.2x).

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
import pickle
import platform
import shlex
import sys
import time

import numpy as np

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import CostModel, StageLayout, analytical_table
from pipetune.data import BatchStream, ImageSizing, make_mix
from pipetune.data.batch import BatchReader, BatchTotals, id_checksum
from pipetune.plan.data_parallel.dp_balance import ShareCost, compare_dp
from pipetune.plan.mode import Mode
from pipetune.plan.layout.planner_config import PlannerConfig
from pipetune.plan.data_parallel.replicas import ReplicaPlans, ReplicaShare, SharePlanner

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


def host_work(model, planner, share_cost: ShareCost, data, *, dp: int, gbs: int, max_seq_len: int, iters: int) -> dict:
    """One rank's host work per step in a job of ``dp`` replicas (module doc), median seconds over
    ``iters`` steps. Replica 0's plan and share are made outside the timing, as its lead's planner
    process makes them (it reads and splits the global batch, off the training thread)."""
    from torchtitan_patches.data.loader import groups_from_ids

    reader = BatchReader(data, BatchStream(num_rows=len(data), gbs=gbs), ImageSizing.for_model(model), max_seq_len)
    lead = SharePlanner(planner, ReplicaShare(dp, 0, share_cost))
    rank, extra = [], []
    for step in range(iters + 1):
        made = lead.plan(reader(step))
        answer = pickle.dumps(made, pickle.HIGHEST_PROTOCOL)  # what the lead's planner process sends it
        w = made.share.whole
        message = (made.plans.to_json(), made.share.rows.tolist(), (w.samples, w.label_tokens, w.checksum))
        t0 = time.perf_counter()
        text, rows, whole = pickle.loads(pickle.dumps(message))  # the lead's message, as send_object_list pickles it
        share = reader.rows(step, rows, BatchTotals(*whole))
        plan = ReplicaPlans.from_json(text).plans[0].validate(share.table.ids)
        groups_from_ids(share, [list(mb) for mb in plan.micro_batches])
        t1 = time.perf_counter()
        got = pickle.loads(answer)
        id_checksum(got.plan.sample_ids())
        pickle.dumps((True, got.plans.to_json(), got.share.rows.tolist(), whole))
        t2 = time.perf_counter()
        if step:  # the first is warm-up
            rank.append(t1 - t0)
            extra.append(t2 - t1)
    return {"every_rank_s": float(np.median(rank)), "lead_extra_s": float(np.median(extra))}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="64x4096,256x16384,1024x65536", help="comma-separated DPxGBS (replicas x global batch)")
    ap.add_argument("--host-work", default="2x128,64x4096,1024x65536", help="DPxGBS settings of the per-rank host work ('' : skip)")
    ap.add_argument("--model", default="13b")
    ap.add_argument("--mixes", default="datamix2,datamix3")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--samples", type=int, default=80_000)
    ap.add_argument("--iters", type=int, default=5, help="batches measured per setting and mix")
    ap.add_argument("--warmup", type=int, default=1, help="batches planned first and not counted (planner caches)")
    ap.add_argument("--budget-s", type=float, default=2.0, help="per-batch planning deadline (--pipetune.budget_s)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    settings = parse_settings(args.settings)
    host_settings = parse_settings(args.host_work) if args.host_work else []
    if threadpool_limits is not None:
        threadpool_limits(1)
    model = load_model_config(args.model)
    hw = load_hardware(args.hardware)
    cost = CostModel(analytical_table(model, hw, tp=args.tp), StageLayout.even(model.backbone.n_layers, args.pp), recompute_encoder=True)
    planner = PlannerConfig(mode=Mode.PIPETUNE, max_seq_len=args.max_seq_len, memory_bytes=hw.memory_bytes).build(model, cost)
    share_cost = ShareCost(cost, packed_tokens=args.max_seq_len)
    mixes = {mix: make_mix(mix, args.samples, 0) for mix in args.mixes.split(",")}
    results = {
        f"dp{dp}_gbs{gbs}": {
            mix: compare_dp(model, planner, data, dp=dp, gbs=gbs, max_seq_len=args.max_seq_len, iters=args.iters, warmup=args.warmup,
                            share_cost=share_cost)
            for mix, data in mixes.items()
        }
        for dp, gbs in settings
    }
    first = next(iter(mixes.values()))
    hosts = {f"dp{dp}_gbs{gbs}": host_work(model, planner, share_cost, first, dp=dp, gbs=gbs, max_seq_len=args.max_seq_len,
                                           iters=args.iters) for dp, gbs in host_settings}
    command = shlex.join([os.path.relpath(sys.executable), *sys.argv])
    run = {
        "command": command,
        "settings": {**vars(args), "settings": [f"{dp}x{gbs}" for dp, gbs in settings]},
        "threads": {"env": {v: os.environ[v] for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")},
                    "threadpoolctl": threadpool_limits is not None},
        "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__},
    }
    if args.json:
        print(json.dumps({**run, "results": results, "host_work": hosts}, indent=2))
        return
    print(f"command: {command}")
    print(f"{args.model} {args.hardware} TP{args.tp} PP{args.pp}, max_seq_len {args.max_seq_len}, pipetune planner; mixes {args.mixes} "
          f"({args.samples} samples); {args.iters} batches per setting after {args.warmup} warm-up; step times simulated")
    print(f"planning: one thread (OMP/MKL/OPENBLAS_NUM_THREADS=1, threadpoolctl {'on' if threadpool_limits else 'absent'}) "
          f"on {run['machine']['cpu']} ({run['machine']['cpus']} CPUs), python {run['machine']['python']}, numpy {np.__version__}; "
          f"budget: p90 <= min(--budget-s {args.budget_s:g}, step time)")
    print("critical path = split + slowest replica's own plan; est~plan: correlation of the split's estimate with the planned "
          "replica times (round-robin's shares differ; balanced ones hardly do)")
    print(f"{'setting':16} {'mix':9} {'split':11} {'step (s)':>9} {'slowest/mean':>13} {'cut vs RR':>10} {'split p50':>10} "
          f"{'replica plan p50':>17} {'critical p50':>13} {'critical p90':>13} {'est~plan':>9} {'fits':>5}")
    for (dp, gbs), rows in zip(settings, results.values()):
        for mix, r in rows.items():
            for name in ("round_robin", "balanced"):
                d = r[name]
                budget = min(args.budget_s, d["mean_iter_s"])
                cut = f"{r['cut_vs_round_robin']:.1%}" if name == "balanced" else "-"
                fits = "yes" if d["planning_s_p90"] <= budget else "NO"
                print(f"{f'DP{dp} GBS{gbs}':16} {mix:9} {name:11} {d['mean_iter_s']:9.3f} {d['spread_max_over_mean']:13.3f} {cut:>10} "
                      f"{d['split_s_p50']:10.3f} {d['replica_plan_s_p50']:17.3f} {d['planning_s_p50']:13.3f} {d['planning_s_p90']:13.3f} "
                      f"{d['estimate_vs_planned_corr']:9.2f} {fits:>5}")
    if hosts:
        base = next(iter(hosts.values()))
        print(f"per-rank host work per step ({next(iter(mixes))}; median of {args.iters} steps; one process timing one rank's part):")
        print(f"{'setting':16} {'every rank (ms)':>16} {'x DP' + str(host_settings[0][0]):>8} {'lead adds (ms)':>15} {'x DP' + str(host_settings[0][0]):>8}")
        for (dp, gbs), h in zip(host_settings, hosts.values()):
            print(f"{f'DP{dp} GBS{gbs}':16} {h['every_rank_s'] * 1e3:16.2f} {h['every_rank_s'] / base['every_rank_s']:8.1f} "
                  f"{h['lead_extra_s'] * 1e3:15.2f} {h['lead_extra_s'] / base['lead_extra_s']:8.1f}")


if __name__ == "__main__":
    main()
