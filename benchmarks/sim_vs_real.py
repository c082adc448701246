"""Measured vs simulated iteration time of real pipelined training on 2 gloo ranks (this CPU).

1. Profile the tiny model here (or take ``--table``).
2. For each data mix, ``torchrun`` two ranks of ``torchtitan_patches.train``: a calibration phase
   (balanced plans at every mbs; it fits the table's scales and per-call overheads from the
   measured action times), then ``--steps`` iterations in each of the modes original, balanced
   and pipetune. Every iteration is a different plan (micro-batch count, sizes, order, encoder
   placement).
3. Print, over all iterations after the warm-up steps: mean absolute % error of the simulator's
   prediction and the Spearman rank correlation, per mix and mode and overall, and the measured
   cut of pipetune vs original per mix. Goal (issue 6): error <= 5 %, Spearman >= 0.9.
4. The original mode runs a second time at the end on the same batches: the mean |difference|
   between the two measurements of the same plans is this machine's noise floor, printed beside.
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
               "--gbs", str(args.gbs), "--modes", ",".join(MODES + ("original",))]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"{mix}: training job failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
        print(next(line for line in res.stdout.splitlines() if line.startswith("calibration")), f"[{mix}]")
        summary = json.loads((out / "summary.json").read_text())
        for mode in MODES:
            steps = [s for s in summary[mode]["steps"] if s["step"] >= args.warmup_steps]
            pairs[(mix, mode)] = [(s["measured_s"], s["predicted_s"], s["micro_batches"]) for s in steps]
        cuts[mix] = 1 - summary["pipetune"]["measured_mean_s"] / summary["original"]["measured_mean_s"]
        again = [s["measured_s"] for s in summary["original#2"]["steps"] if s["step"] >= args.warmup_steps]
        first = [r[0] for r in pairs[(mix, "original")]]
        noise[mix] = float(np.mean(np.abs(np.array(again) - first) / np.array(first)) * 100)

    def stats(rows):
        m = np.array([r[0] for r in rows])
        p = np.array([r[1] for r in rows])
        return float(np.mean(np.abs(p - m) / m) * 100), float(spearmanr(m, p).statistic), float(m.mean()), float(p.mean())

    print(f"\n{'mix':9} {'mode':9} {'plans':>5} {'measured (s)':>12} {'simulated (s)':>13} {'|error|':>8} {'spearman':>9}")
    for (mix, mode), rows in pairs.items():
        e, rho, m, p = stats(rows)
        print(f"{mix:9} {mode:9} {len(rows):5d} {m:12.3f} {p:13.3f} {e:7.1f}% {rho:9.3f}")
    every = [r for rows in pairs.values() for r in rows]
    e, rho, _, _ = stats(every)
    print(f"{'all':9} {'':9} {len(every):5d} {'':12} {'':13} {e:7.1f}% {rho:9.3f}")
    print("measured cut of pipetune vs original: " + ", ".join(f"{mix} {c:.1%}" for mix, c in cuts.items()))
    print("noise floor, same original plans measured twice, mean |difference|: "
          + ", ".join(f"{mix} {v:.1f}%" for mix, v in noise.items()))
    print(f"runs and timelines in {work}")


if __name__ == "__main__":
    main()
