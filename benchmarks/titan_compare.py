"""pipetune vs the original plan inside a TorchTitan job (the README's main job).

For each mode (``original``: fixed micro-batch size, samples in arrival order; ``pipetune``) this
launches TorchTitan's own trainer, ``torchrun -m torchtitan.train --module pipetune_configs
--config muse_glimmer_mm_testbed``, on 2 gloo ranks, with the same data, seed and initial weights.
The two jobs alternate in ``--rounds`` rounds (original, pipetune, original, ...), so a drifting
machine speed hits both alike. From the jobs' per-step records it prints, per mode, the mean
measured pipeline time (first action start to last action end over the ranks; optimizer and data
loading excluded) and the planner's prediction, the measured and predicted cut of pipetune vs
original, and how far apart the two loss curves are (plans never change what is learned: the
same samples reach the same weights, only the summation order differs). The first
``--warmup`` steps of each job are left out of the timings.

``--dp 2`` runs each job data-parallel, DP 2 x PP 2 on 4 gloo ranks (FSDP; ``original`` splits
each global batch round-robin as TorchTitan's loader does, the other modes with pipetune's
balanced split, ``pipetune.plan.data_parallel.dp_balance``), with ``muse_glimmer_mm`` rather than the
2-rank CPU testbed: a step's time is its slowest replica's. Four ranks share two cores there, so
its times include that contention.

    .venv/bin/python benchmarks/titan_compare.py --out out/titan
    .venv/bin/python benchmarks/titan_compare.py --out out/titan --dp 2
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titan_jobs import corpus, job_arguments, prepare, run_job


def run_mode(job: str, out: Path, args) -> list[StepTime]:
    """``job`` is a planner mode, optionally with a fixed micro-batch size: ``balanced@1``."""
    mode, _, mbs = job.partition("@")
    prefix = f"{mode}{mbs}" + (f"_dp{args.dp}" if args.dp > 1 else "")
    dump = out / f"{prefix}_{len(list(out.glob(f'{prefix}_*')))}"
    overrides = {**corpus(out), "pipetune.latency_table": out / "table.json", "pipetune.mode": mode,
                 "training.steps": args.steps, "debug.seed": 0, "dataloader.gbs": args.gbs, "training.seq_len": args.seq_len,
                 **({"pipetune.mbs": mbs} if mbs else {})}
    if args.dp == 1:
        return StepTime.of(run_job(dump, overrides))
    overrides["parallelism.data_parallel_shard_degree"] = args.dp
    return StepTime.of(run_job(dump, overrides, config="muse_glimmer_mm", nproc=2 * args.dp))


@dataclass(frozen=True)
class StepTime:
    """One step of a job over its replicas: the slowest replica's measured and predicted time,
    the summed loss, mean micro-batch count and size."""

    measured_s: float
    predicted_s: float
    loss: float
    micro_batches: float
    mbs: float

    @classmethod
    def of(cls, records) -> list["StepTime"]:
        steps = defaultdict(list)
        for r in records:
            steps[r.step].append(r)
        return [cls(max(r.measured_s for r in rs), max(r.predicted_s for r in rs), sum(r.loss for r in rs),
                    float(np.mean([r.micro_batches for r in rs])), float(np.mean([r.mbs for r in rs])))
                for _, rs in sorted(steps.items())]


def main(argv=None) -> int:
    p = job_arguments(__doc__, rounds=1)
    p.add_argument("--jobs", default="original,balanced@1,pipetune",
                   help="modes to compare, mode@mbs fixes the micro-batch size (balanced@1: a careful fixed choice)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (2 pipeline ranks each)")
    args = p.parse_args(argv)
    prepare(args.out)
    runs: dict[str, list[list[StepTime]]] = {job: [] for job in args.jobs.split(",")}
    if not {"original", "pipetune"} <= set(runs):
        p.error("--jobs must include original and pipetune")
    for _ in range(args.rounds):
        for mode in runs:
            runs[mode].append(run_mode(mode, args.out, args))
    mean = {}
    ranks = "2 gloo ranks" if args.dp == 1 else f"DP {args.dp} x PP 2 on {2 * args.dp} gloo ranks"
    print(f"TorchTitan muse_glimmer debugmodel_mm, {ranks}, GBS {args.gbs}, seq_len {args.seq_len}, "
          f"{args.steps} steps x {args.rounds} round(s), first {args.warmup} steps of each job left out")
    print(f"{'job':11} {'measured (ms)':>14} {'predicted (ms)':>15} {'error':>7} {'micro-batches':>14} {'mbs':>5}")
    for mode, jobs in runs.items():
        recs = [r for job in jobs for r in job[args.warmup:]]
        m, pr = np.array([r.measured_s for r in recs]), np.array([r.predicted_s for r in recs])
        mean[mode] = (m.mean(), pr.mean())
        print(f"{mode:11} {m.mean() * 1e3:14.1f} {pr.mean() * 1e3:15.1f} {np.mean(np.abs(pr - m) / m):7.1%} "
              f"{np.mean([r.micro_batches for r in recs]):14.1f} {np.mean([r.mbs for r in recs]):5.1f}")
    for base in (job for job in runs if job != "pipetune"):
        cut = 1 - mean["pipetune"][0] / mean[base][0]
        predicted_cut = 1 - mean["pipetune"][1] / mean[base][1]
        print(f"pipetune vs {base}: measured cut {cut:.1%}, predicted cut {predicted_cut:.1%}")
    a = np.array([r.loss for r in runs["original"][0]])
    b = np.array([r.loss for r in runs["pipetune"][0]])
    print(f"loss curves, original vs pipetune (first round): step 1 |difference| {abs(a[0] - b[0]):.1e} (float rounding), "
          f"largest {np.abs(a - b).max():.1e} over {len(a)} steps (AdamW amplifies rounding of tiny gradients; losses "
          f"{a[0]:.4f} -> {a[-1]:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
