"""Stage layouts in real TorchTitan training, 2 gloo ranks: even, the searched co-located split,
and DIP's separated layout.

The job is ``muse_glimmer_heavy_vit_testbed`` (``configs/config_registry.py``): a
Muse Glimmer whose trained ViT costs more than its backbone on a DataMix3 batch (1.5 x the FLOPs),
so the even split leaves stage 0 (encoder + half the layers) the straggler. The layout search
moves backbone layers off stage 0 (``split``: the best co-located layout, issue 12), and the
partitioner spreads the encoder in chunks over both ranks (``separated``, issue 13); the trainer's
``auto`` takes whichever it predicts faster. The benchmark prepares the job's data and latency
table once, then launches TorchTitan's trainer (``benchmarks/titan_jobs.py``) once per layout
and round, the order rotating between rounds so that drift in the machine's speed hits every
layout alike. From the per-step records it prints:

* what the search predicted before training (8 sampled batches, profiled table): each layout's
  expected iteration time and per-rank busy fraction;
* per job: mean measured and predicted pipeline time (the planner's online prediction, made before
  the step) and mean |error|, the first ``--warmup`` steps left out;
* measured vs predicted cut of ``split`` and ``separated`` against ``even``, and of ``separated``
  against ``split``, with the noise (the cut measured in each round; the same layout's mean in
  different rounds).

Even and split train the same batches from the same weights (a backbone split changes no
gradient), so their loss curves agree up to float rounding (printed as a check). A separated job's
parts are initialised by TorchTitan part by part, so it starts from other weights; its gradients
are tested against the unsplit model in ``tests/test_titan_trainer.py``.

    .venv/bin/python benchmarks/layout_real.py --rounds 2 --steps 20
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from titan_jobs import ROOT, prepare, run_job

CONFIG = "muse_glimmer_heavy_vit_testbed"
LAYOUTS = ("even", "split", "separated")


def search_prediction(out: Path):
    """The layout search exactly as the trainer runs it on this job's defaults (``auto`` picks the
    faster of ``split`` and ``separated``)."""
    from pipetune.cost import load_latency_table
    from pipetune_configs import config_registry
    from torchtitan_patches.models.model_spec import planning_model_config
    from torchtitan_patches.titan.model_parts import layout_search, sample_job_batches

    config = getattr(config_registry, CONFIG)()
    config.dataloader.dataset_path = str(out / "data")
    pt = config.pipetune
    model = planning_model_config(config.model_spec, image_grid=pt.image_grid, encoder_frozen=pt.freeze_vision_encoder)
    table = load_latency_table(out / "table.json", model=model, tp=1)
    return layout_search(config, model, table, sample_job_batches(config, model)).search(separated=True)


def run_layout(name: str, layout: str, out: Path, args) -> list[dict]:
    dump = out / f"layout_{name}_{len(list(out.glob(f'layout_{name}_*')))}"  # a new folder: records are appended
    return run_job(dump, {"dataloader.dataset_path": out / "data", "pipetune.latency_table": out / "table.json",
                          "pipetune.layout": layout, "training.steps": args.steps, "debug.seed": 0},
                   config=CONFIG, timeout=900)


def timing(records: list[dict]) -> tuple[float, float, float]:
    """Mean measured and predicted pipeline time, and mean |predicted - measured| / measured."""
    m = np.array([r.measured_s for r in records])
    p = np.array([r.predicted_s for r in records])
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
    predicted = {"even": search.even, "split": search.split, "separated": search.separated}
    for tag, sc in predicted.items():
        print(f"  {tag:9}: layers per stage {sc.layout.layers_per_stage()}"
              + (f", encoder blocks per chunk {[hi - lo for lo, hi in sc.layout.encoder_chunks]}" if sc.layout.is_separated else "")
              + f", expected iteration {sc.iter_s * 1e3:.0f} ms, busy per rank {np.round(sc.busy, 2).tolist()}")
    print(f"  auto picks {'separated' if search.best.layout.is_separated else 'split'}")
    flags = {"even": "even", "split": ",".join(map(str, search.split.layout.layers_per_stage())), "separated": "separated"}

    runs: dict[str, list[list[dict]]] = {name: [] for name in LAYOUTS}
    for r in range(args.rounds):
        for name in LAYOUTS[r % len(LAYOUTS):] + LAYOUTS[: r % len(LAYOUTS)]:
            runs[name].append(run_layout(name, flags[name], args.out, args))

    print(f"\n{args.steps} steps per job, first {args.warmup} left out; times are pipeline times (first action start to last end)")
    print(f"{'layout':10} {'round':>5} {'measured (ms)':>14} {'predicted (ms)':>15} {'|error|':>8} {'micro-batches':>14}")
    mean = {}
    for name, jobs in runs.items():
        for r, job in enumerate(jobs):
            m, pr, err = timing(job[args.warmup:])
            mbs = np.mean([x["micro_batches"] for x in job[args.warmup:]])
            print(f"{name:10} {r:5} {m * 1e3:14.1f} {pr * 1e3:15.1f} {err:8.1%} {mbs:14.1f}")
        mean[name] = timing([x for job in jobs for x in job[args.warmup:]])
        m, pr, err = mean[name]
        print(f"{name:10} {'all':>5} {m * 1e3:14.1f} {pr * 1e3:15.1f} {err:8.1%}")

    print()
    for a, b in (("split", "even"), ("separated", "even"), ("separated", "split")):
        cut = 1 - mean[a][0] / mean[b][0]
        predicted_cut = 1 - mean[a][1] / mean[b][1]
        rounds = [1 - timing(x[args.warmup:])[0] / timing(y[args.warmup:])[0] for x, y in zip(runs[a], runs[b])]
        print(f"{a} vs {b}: measured cut {cut:.1%}, predicted cut {predicted_cut:.1%} (difference {abs(cut - predicted_cut):.1%}); "
              f"measured per round {', '.join(f'{c:.1%}' for c in rounds)}")
    if args.rounds > 1:
        spread = {name: [timing(job[args.warmup:])[0] for job in jobs] for name, jobs in runs.items()}
        print("noise: the same layout's mean differs between rounds by " + ", ".join(
            f"{(max(v) - min(v)) / np.mean(v):.1%} ({k})" for k, v in spread.items()))
    a = np.array([x["loss"] for x in runs["even"][0]])
    b = np.array([x["loss"] for x in runs["split"][0]])
    print(f"loss curves, even vs split (round 0): step 1 |difference| {abs(a[0] - b[0]):.1e}, largest {np.abs(a - b).max():.1e} over "
          f"{len(a)} steps (plans differ per layout, so summation order does; AdamW amplifies the rounding; losses {a[0]:.4f} -> {a[-1]:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
