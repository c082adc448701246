"""pipetune vs TorchTitan's stock pipeline on the same job (a row of the README's main job).

Jobs through TorchTitan's own entry point (``torchrun -m torchtitan.train --module configs``), on
2 gloo ranks, same model (Muse Glimmer ``debugmodel_mm``), data stream, optimizer, seed and
initial weights:

* ``torchtitan``: ``muse_glimmer_mm_stock``, TorchTitan's trainer and pipeline as a user runs
  them: its own stage split, torch's ``Schedule1F1B`` over micro-batches of one row of
  ``seq_len`` tokens, samples packed as TorchTitan's multimodal packer packs them, rows padded and
  streamed (``torchtitan_patches.titan.fixed_shape_loader``), as many rows per step as pipetune's
  global batches pack into on average (at least one per stage, which 1F1B needs), so both train
  about the same samples per step;
* ``pipetune``: ``muse_glimmer_mm``, ``PipeTuneTrainer`` with its defaults (no CPU testbed; the
  stock job has none either), GBS samples per step.

They alternate over ``--rounds`` rounds. Steps differ in size between the two, so the figure of
merit is real (non-padding) tokens per second of pipeline time (the pipeline step alone on the
slowest rank, optimizer and data loading excluded, as both trainers record it); it also prints
the mean pipeline time per step and the padding share. The first ``--warmup`` steps of each job
are left out. A one-step stock job with ``pad_steps`` (step 1 = pipetune's first global batch,
padded with empty rows) checks that the two trainers compute the same loss on the same samples
from the same weights.

    .venv/bin/python benchmarks/vs_torchtitan.py --out out/titan
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

from titan_jobs import corpus, corpus_tokenizer, job_arguments, prepare, run_job

STAGES = 2
"""The stock job's pipeline stages: its 1F1B needs at least one row (micro-batch) per stage."""


def _batches(out: Path, args) -> tuple[list[int], list[int]]:
    """Rows each global batch of the run packs into, and its real tokens (metadata only)."""
    from configs import config_registry
    from pipetune.packing import PackingConfig
    from torchtitan_patches.data import DataLoaderConfig
    from torchtitan_patches.titan.fixed_shape_loader import rows_needed
    from torchtitan_patches.titan.model_spec import planning_model_config

    config = config_registry.muse_glimmer_mm()
    model = planning_model_config(config.model_spec, image_grid=config.pipetune.image_grid)
    loader = DataLoaderConfig(data=corpus(out)["dataloader.dataset_path"], gbs=args.gbs, max_seq_len=args.seq_len, seed=0,
                              packing=PackingConfig(max_seq_len=args.seq_len)).build(model, tokenizer=corpus_tokenizer(out))
    return rows_needed(loader, args.steps, args.seq_len), [int(loader.meta(s).table.lengths.sum()) for s in range(args.steps)]


def _stock(dump: Path, out: Path, args, rows: int, *, steps: int, pad_steps: bool = False) -> list[dict]:
    shutil.rmtree(dump, ignore_errors=True)  # records are appended
    run_job(dump, {**corpus(out), "training.steps": steps, "debug.seed": 0, "dataloader.gbs": args.gbs,
                   "training.seq_len": args.seq_len, "dataloader.rows_per_step": rows, "training.local_batch_size": rows,
                   **({"dataloader.pad_steps": True} if pad_steps else {})}, config="muse_glimmer_mm_stock", records=False)
    lines = [json.loads(line) for line in (dump / "stock" / "steps.jsonl").read_text().splitlines()]
    return sorted(lines, key=lambda r: r["step"])


def _pipetune(dump: Path, out: Path, args, tokens: list[int]) -> list[dict]:
    shutil.rmtree(dump, ignore_errors=True)
    records = run_job(dump, {**corpus(out), "pipetune.latency_table": out / "table.json",
                             "training.steps": args.steps, "debug.seed": 0, "dataloader.gbs": args.gbs,
                             "training.seq_len": args.seq_len}, config="muse_glimmer_mm")
    return [{"pipeline_s": r.measured_s, "loss": r.loss, "real_tokens": tokens[r.batch]} for r in sorted(records, key=lambda r: r.step)]


def main(argv=None) -> int:
    args = job_arguments(__doc__, rounds=3).parse_args(argv)
    prepare(args.out)
    rows, tokens = _batches(args.out, args)
    streamed = max(STAGES, round(float(np.mean(rows))))
    runs: dict[str, list[list[dict]]] = {"torchtitan": [], "pipetune": []}
    for k in range(args.rounds):
        runs["torchtitan"].append(_stock(args.out / f"vs_torchtitan_{k}", args.out, args, streamed, steps=args.steps))
        runs["pipetune"].append(_pipetune(args.out / f"vs_pipetune_{k}", args.out, args, tokens))
    first = _stock(args.out / "vs_torchtitan_step1", args.out, args, max(STAGES, rows[0]), steps=1, pad_steps=True)[0]
    print(f"TorchTitan muse_glimmer debugmodel_mm, 2 gloo ranks, seq_len {args.seq_len}, {args.steps} steps x {args.rounds} "
          f"round(s), first {args.warmup} steps of each job left out; TorchTitan: 1F1B over {streamed} rows of {args.seq_len} "
          f"tokens per step (streamed); pipetune: GBS {args.gbs}")
    print(f"{'job':11} {'pipeline (ms)':>14} {'real tokens/step':>17} {'real tokens/s':>14} {'padding':>8}")
    rate = {}
    for job, jobs in runs.items():
        steps = [r for run in jobs for r in run[args.warmup:]]
        t, n = np.array([r["pipeline_s"] for r in steps]), np.array([r["real_tokens"] for r in steps], dtype=float)
        rate[job] = n.sum() / t.sum()
        padding = 1 - n.mean() / (streamed * args.seq_len) if job == "torchtitan" else 0.0
        print(f"{job:11} {t.mean() * 1e3:14.1f} {n.mean():17.0f} {rate[job]:14.0f} {padding:8.1%}")
    print(f"pipetune vs TorchTitan's stock pipeline: {rate['pipetune'] / rate['torchtitan']:.2f}x the real tokens per second "
          f"of pipeline time")
    a, b = first["loss"], runs["pipetune"][0][0]["loss"]
    print(f"step-1 loss on the same samples and weights: TorchTitan {a:.6f}, pipetune {b:.6f}, |difference| {abs(a - b):.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
