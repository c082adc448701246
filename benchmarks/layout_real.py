"""Even vs searched (``auto``) stage layout in real TorchTitan training, 2 gloo ranks.

The job is ``pipetune_muse_glimmer_heavy_vit`` (``torchtitan_patches/titan/config_registry.py``): a
Muse Glimmer whose trained ViT costs more than its backbone on a DataMix3 batch (1.5 x the FLOPs),
so the even split leaves stage 0 (encoder + half the layers) the straggler and the layout search
moves layers to stage 1. The benchmark prepares the job's data and latency table once, then launches
TorchTitan's trainer (``benchmarks/titan_jobs.py``) with ``--pipetune.layout even`` and ``auto`` from
the same data, seed and initial weights, in ``--rounds`` rounds ordered even, auto / auto, even /
... so that a linear drift of the machine's speed hits both alike. From the per-step records it
prints:

* what the layout search predicted before training (the trainer's ``auto``: 8 sampled batches,
  profiled table): each layout's expected iteration time and per-stage busy fraction;
* per job: the layers per stage it ran, mean measured and predicted pipeline time (the planner's
  online prediction, made before the step) and mean |error|, the first ``--warmup`` steps left out;
* per layout over all rounds, and the measured vs predicted cut of auto against even;
* noise: the same layout's mean in different rounds, and the cut measured in each round.

Both layouts train the same batches from the same weights (the split changes no gradient), so the
loss curves agree up to float rounding; their differences are printed as a check.

    .venv/bin/python benchmarks/layout_real.py --rounds 2 --steps 20

About 50 s per job on two CPU cores (20 steps of 1.2-1.6 s pipeline time, plus start-up and the
optimizer), so ``--rounds 2`` takes about 3.5 minutes after a one-off ``prepare`` of about 40 s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from titan_jobs import ROOT, prepare, run_job

CONFIG = "pipetune_muse_glimmer_heavy_vit"
LAYOUTS = ("even", "auto")


def search_prediction(out: Path):
    """The layout search exactly as the trainer's ``auto`` runs it on this job's defaults."""
    from pipetune.cost import load_latency_table
    from torchtitan_patches.titan import config_registry
    from torchtitan_patches.titan.model_spec import planning_model_config
    from torchtitan_patches.titan.trainer import sample_job_batches, search_layout

    config = getattr(config_registry, CONFIG)()
    config.dataloader.dataset_path = str(out / "data")
    pt = config.pipetune
    model = planning_model_config(config.model_spec, image_grid=pt.image_grid, encoder_frozen=pt.freeze_vision_encoder)
    return search_layout(config, model, load_latency_table(out / "table.json", model=model, tp=1), sample_job_batches(config, model))


def run_layout(layout: str, out: Path, args) -> list[dict]:
    dump = out / f"layout_{layout}_{len(list(out.glob(f'layout_{layout}_*')))}"  # a new folder: records are appended
    return run_job(dump, {"dataloader.dataset_path": out / "data", "pipetune.latency_table": out / "table.json",
                          "pipetune.layout": layout, "training.steps": args.steps, "debug.seed": 0},
                   config=CONFIG, timeout=900)


def timing(records: list[dict]) -> tuple[float, float, float]:
    """Mean measured and predicted pipeline time, and mean |predicted - measured| / measured."""
    m = np.array([r["measured_s"] for r in records])
    p = np.array([r["predicted_s"] for r in records])
    return float(m.mean()), float(p.mean()), float(np.mean(np.abs(p - m) / m))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "out" / "titan_heavy")
    p.add_argument("--mix", default="datamix3", help="generated mix of the job's data set (made once)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
    prepare(args.out, CONFIG, "--mix", args.mix)
    search = search_prediction(args.out)
    print(f"TorchTitan {CONFIG}, 2 gloo ranks, {args.mix}; layout search before training (profiled table, 8 sampled batches):")
    for tag, s in (("even", search.even), ("auto", search.best)):
        print(f"  {tag}: layers per stage {s.layout.layers_per_stage()}, expected iteration {s.iter_s * 1e3:.0f} ms, "
              f"busy per stage {np.round(s.busy, 2).tolist()}")
    print(f"  expected cut of auto vs even: {search.cut_vs_even:.1%}")

    runs: dict[str, list[list[dict]]] = {layout: [] for layout in LAYOUTS}
    for r in range(args.rounds):
        for layout in LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]:
            runs[layout].append(run_layout(layout, args.out, args))
    auto_layout = runs["auto"][0][0]["layout"]
    if auto_layout != search.best.layout.layers_per_stage():
        print(f"warning: the auto jobs ran {auto_layout}, not the search's {search.best.layout.layers_per_stage()} (job settings differ?)")

    print(f"\n{args.steps} steps per job, first {args.warmup} left out; times are pipeline times (first action start to last end)")
    print(f"{'layout':7} {'round':>5} {'layers':>9} {'measured (ms)':>14} {'predicted (ms)':>15} {'|error|':>8} {'micro-batches':>14}")
    mean = {}
    for layout, jobs in runs.items():
        for r, job in enumerate(jobs):
            m, pr, err = timing(job[args.warmup:])
            mbs = np.mean([x["micro_batches"] for x in job[args.warmup:]])
            print(f"{layout:7} {r:5} {str(job[0]['layout']):>9} {m * 1e3:14.1f} {pr * 1e3:15.1f} {err:8.1%} {mbs:14.1f}")
        mean[layout] = timing([x for job in jobs for x in job[args.warmup:]])
        m, pr, err = mean[layout]
        print(f"{layout:7} {'all':>5} {'':9} {m * 1e3:14.1f} {pr * 1e3:15.1f} {err:8.1%}")

    cut = 1 - mean["auto"][0] / mean["even"][0]
    predicted_cut = 1 - mean["auto"][1] / mean["even"][1]
    print(f"\nauto vs even: measured cut {cut:.1%}, predicted cut {predicted_cut:.1%} (difference {abs(cut - predicted_cut):.1%}; "
          f"mean |error| of the per-step predictions: even {mean['even'][2]:.1%}, auto {mean['auto'][2]:.1%})")
    if args.rounds > 1:
        per_round = [1 - timing(a[args.warmup:])[0] / timing(e[args.warmup:])[0] for e, a in zip(runs["even"], runs["auto"])]
        spread = {layout: [timing(job[args.warmup:])[0] for job in jobs] for layout, jobs in runs.items()}
        spread = {k: (max(v) - min(v)) / np.mean(v) for k, v in spread.items()}
        print(f"noise: measured cut per round {', '.join(f'{c:.1%}' for c in per_round)}; the same layout's mean differs between rounds "
              f"by {spread['even']:.1%} (even) and {spread['auto']:.1%} (auto)")
    else:
        print("noise: run --rounds 2 or more to see it")
    a = np.array([x["loss"] for x in runs["even"][0]])
    b = np.array([x["loss"] for x in runs["auto"][0]])
    print(f"loss curves, even vs auto (round 0): step 1 |difference| {abs(a[0] - b[0]):.1e}, largest {np.abs(a - b).max():.1e} over "
          f"{len(a)} steps (plans differ per layout, so summation order does; AdamW amplifies the rounding; losses {a[0]:.4f} -> {a[-1]:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
