"""Measured vs simulated iteration time of real pipelined training on 2 gloo ranks (this CPU).

1. Profile the tiny model here (or take ``--table``).
2. For each data mix, ``torchrun`` two ranks of ``torchtitan_patches.train``: a calibration phase
   (balanced plans at every mbs; it fits the table's scales and per-call overheads from the
   measured action times), then ``--steps`` iterations in each of the modes original, balanced
   and pipetune. Every iteration is a different plan (micro-batch count, sizes, order, encoder
   placement).
   After training, every step's plan is run again in the same order until it has
   ``--timing-rounds`` timed runs taken minutes apart; its measured time is their median.
3. Print, over all iterations after the warm-up steps: mean absolute % error of the simulated
   iteration time and the Spearman rank correlation, per mix and mode and overall, and the
   measured cut of pipetune vs original per mix. Goal (issue 6): error <= 5 %, Spearman >= 0.9.
   Two simulations: the planner's own prediction, made online before the step ran with the table
   as calibrated on the steps before it; and the simulator under the profiled table calibrated on
   every timed run of all the other plans (leave-one-plan-out), which takes the planner's lag
   behind a drifting machine out of the comparison. Both are also given against the first run of each
   plan alone (the training step itself), i.e. what one unrepeated measurement would show.
4. Noise: the mean |difference| between one run of a plan and the median of its runs, and
   between two medians of the same original plans (the original mode runs a second time, in
   lockstep with the others, on the same batches).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

from pipetune.config import load_model_config  # noqa: E402
from pipetune.data import make_mix, write_dataset  # noqa: E402
from profiling.profile_layers import ProfileConfig, run_profile  # noqa: E402

MIXES = ("datamix1", "datamix2", "datamix3")
MODES = ("original", "balanced", "pipetune")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", help="latency table of the tiny model on this CPU (default: profile now)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--calibrate-steps", type=int, default=8)
    ap.add_argument("--gbs", type=int, default=32)
    ap.add_argument("--timing-rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="pipetune-sim-vs-real-"))
    work.mkdir(parents=True, exist_ok=True)
    table = args.table
    if table is None:
        table = str(work / "tiny_cpu.json")
        run_profile(load_model_config("tiny"), ProfileConfig(max_seq_len=512, max_tokens=2048), table, progress=False)
    pairs = {}
    cuts = {}
    noise = {}
    for k, mix in enumerate(MIXES):
        data = work / mix
        if not (data / "pipetune.json").is_file():
            write_dataset(make_mix(mix, 20_000, seed=k), data, {"mix": mix, "seed": k})
        out = work / f"run_{mix}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "torchtitan_patches.train",
               "--data", str(data), "--latency-table", table, "--out", str(out), "--steps", str(args.steps),
               "--warmup-steps", str(args.warmup_steps), "--calibrate-steps", str(args.calibrate_steps),
               "--gbs", str(args.gbs), "--timing-rounds", str(args.timing_rounds), "--modes", ",".join(MODES + ("original",))]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"{mix}: training job failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
        print(next(line for line in res.stdout.splitlines() if line.startswith("calibration")), f"[{mix}]")
        summary = json.loads((out / "summary.json").read_text())
        for mode in MODES:
            steps = [s for s in summary[mode]["steps"] if s["step"] >= args.warmup_steps]
            pairs[(mix, mode)] = [(s["measured_s"], s["predicted_s"], s["measured_runs_s"], s["held_out_s"]) for s in steps]
        cuts[mix] = 1 - summary["pipetune"]["measured_mean_s"] / summary["original"]["measured_mean_s"]
        again = [s["measured_s"] for s in summary["original#2"]["steps"] if s["step"] >= args.warmup_steps]
        first = [r[0] for r in pairs[(mix, "original")]]
        noise[mix] = float(np.mean(np.abs(np.array(again) - first) / np.array(first)) * 100)

    def stats(rows):
        m = np.array([r[0] for r in rows])
        p = np.array([r[1] for r in rows])
        return float(np.mean(np.abs(p - m) / m) * 100), float(spearmanr(m, p).statistic), float(m.mean()), float(p.mean())

    def held_out(rows):
        return [(r[0], r[3]) for r in rows]

    print(f"\n{'':20} {'':12} {'planner, online':>34} {'held-out calibration':>22}")
    print(f"{'mix':9} {'mode':9} {'plans':>5} {'measured (s)':>12} {'simulated (s)':>13} {'|error|':>8} {'spearman':>9} "
          f"{'|error|':>9} {'spearman':>9}")
    for (mix, mode), rows in pairs.items():
        e, rho, m, p = stats(rows)
        he, hrho, _, _ = stats(held_out(rows))
        print(f"{mix:9} {mode:9} {len(rows):5d} {m:12.3f} {p:13.3f} {e:7.1f}% {rho:9.3f} {he:8.1f}% {hrho:9.3f}")
    every = [r for rows in pairs.values() for r in rows]
    e, rho, _, _ = stats(every)
    he, hrho, _, _ = stats(held_out(every))
    print(f"{'all':9} {'':9} {len(every):5d} {'':12} {'':13} {e:7.1f}% {rho:9.3f} {he:8.1f}% {hrho:9.3f}")
    e1, rho1, _, _ = stats([(r[2][0], r[1]) for r in every])
    he1, hrho1, _, _ = stats([(r[2][0], r[3]) for r in every])
    print(f"{'all':9} {'1st run':9} {len(every):5d} {'':12} {'':13} {e1:7.1f}% {rho1:9.3f} {he1:8.1f}% {hrho1:9.3f}"
          "   (against each plan's first run alone)")
    spread = np.mean([abs(x - r[0]) / r[0] for r in every for x in r[2]]) * 100
    print(f"noise: one run vs the median of its plan's {args.timing_rounds} runs, mean |difference| {spread:.1f}%")
    print("measured cut of pipetune vs original: " + ", ".join(f"{mix} {c:.1%}" for mix, c in cuts.items()))
    print("noise: the same original plans measured twice (medians), mean |difference|: "
          + ", ".join(f"{mix} {v:.1f}%" for mix, v in noise.items()))
    print(f"runs and timelines in {work}")


if __name__ == "__main__":
    main()
