"""pipetune vs TorchTitan's stock pipeline at its best configuration, on the same job.

Jobs through TorchTitan's own entry point (``torchrun -m torchtitan.train --module pipetune_configs``), on
2 gloo ranks, same model (Muse Glimmer ``debugmodel_mm``), data stream, optimizer, seed and
initial weights, at each sequence length of ``--seq-len`` (both trainers at that length, so both
truncate alike):

* ``torchtitan mbs m``: ``muse_glimmer_mm_stock``, TorchTitan's trainer and pipeline as a user runs
  them: its own stage split, torch's ``Schedule1F1B`` over micro-batches of ``m`` rows of
  ``seq_len`` tokens (``parallelism.pipeline_parallel_microbatch_size``), samples packed as
  TorchTitan's multimodal packer packs them, rows padded and streamed
  (``torchtitan_patches.titan.fixed_shape_loader``). Rows per step (``training.local_batch_size``)
  are what pipetune's global batches pack into on average, rounded to a multiple of ``m`` with at
  least one micro-batch per stage (1F1B's minimum); a size whose rows would differ from that average
  by more than half is not run (its steps would not train a global batch's samples). These are what
  a TorchTitan user tunes without changing what the model trains on; ``--mbs`` lists the sizes.
* ``pipetune``: ``muse_glimmer_mm``, ``PipeTuneTrainer`` with its defaults (no CPU testbed; the
  stock job has none either), GBS samples per step.

Jobs alternate over ``--rounds`` rounds. Steps differ in size, so the figure of merit is real
(non-padding) tokens per second of pipeline time (the pipeline step alone on the slowest rank,
optimizer and data loading excluded, as both trainers record it); the table also gives the mean
pipeline time per step, model GFLOP per second of pipeline time (``titan.metrics``: the vision
encoder's included, padding not) and the padding share. The first ``--warmup`` steps of each job
are left out. At each length pipetune is compared with the best stock configuration there. A
one-step stock job with ``pad_steps`` (step 1 = pipetune's first global batch, padded with empty
rows) at the longest length checks that the two trainers compute the same loss on the same
samples from the same weights.

    .venv/bin/python benchmarks/vs_torchtitan.py --out out/titan
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titan_jobs import corpus, corpus_tokenizer, int_list, job_arguments, prepare, run_job

STAGES = 2
"""The stock job's pipeline stages: its 1F1B needs at least one micro-batch per stage."""


def _batches(out: Path, args, seq_len: int) -> list[int]:
    """Rows each global batch of the run packs into at ``seq_len`` (metadata only)."""
    from pipetune_configs import config_registry
    from pipetune.packing import PackingConfig
    from torchtitan_patches.data import DataLoaderConfig
    from torchtitan_patches.titan.fixed_shape_loader import rows_needed
    from torchtitan_patches.models.model_spec import planning_model_config

    config = config_registry.muse_glimmer_mm()
    model = planning_model_config(config.model_spec, image_grid=config.pipetune.image_grid)
    loader = DataLoaderConfig(data=corpus(out)["dataloader.dataset_path"], gbs=args.gbs, max_seq_len=seq_len, seed=0,
                              packing=PackingConfig(max_seq_len=seq_len)).build(model, tokenizer=corpus_tokenizer(out))
    return rows_needed(loader, args.steps, seq_len)


def _stock(dump: Path, out: Path, args, seq_len: int, rows: int, mbs: int, *, steps: int, pad_steps: bool = False) -> list[dict]:
    shutil.rmtree(dump, ignore_errors=True)  # records are appended
    run_job(dump, {**corpus(out), "training.steps": steps, "debug.seed": 0, "dataloader.gbs": args.gbs,
                   "training.seq_len": seq_len, "dataloader.rows_per_step": rows, "training.local_batch_size": rows,
                   "parallelism.pipeline_parallel_microbatch_size": mbs, **({"dataloader.pad_steps": True} if pad_steps else {})},
            config="muse_glimmer_mm_stock", records=False)
    lines = [json.loads(line) for line in (dump / "stock" / "steps.jsonl").read_text().splitlines()]
    return sorted(lines, key=lambda r: r["step"])


def _pipetune(dump: Path, out: Path, args, seq_len: int) -> list[dict]:
    shutil.rmtree(dump, ignore_errors=True)
    records = run_job(dump, {**corpus(out), "pipetune.latency_table": out / "table.json", "training.steps": args.steps,
                             "debug.seed": 0, "dataloader.gbs": args.gbs, "training.seq_len": seq_len}, config="muse_glimmer_mm")
    return [{"pipeline_s": r.measured_s, "loss": r.loss, "real_tokens": r.real_tokens, "model_flops": r.model_flops,
             "padding_tokens": r.padding_tokens} for r in sorted(records, key=lambda r: r.step)]


@dataclass(frozen=True)
class Figures:
    """A job's steps after warm-up, over its rounds."""

    pipeline_ms: float
    real_tokens: float
    rate: float  # real tokens per second of pipeline time
    gflops: float  # model GFLOP per second of pipeline time
    padding: float

    @classmethod
    def of(cls, runs: list[list[dict]], warmup: int) -> "Figures":
        steps = [r for run in runs for r in run[warmup:]]
        t = sum(r["pipeline_s"] for r in steps)
        real, pad = (sum(r[k] for r in steps) for k in ("real_tokens", "padding_tokens"))
        return cls(1e3 * t / len(steps), real / len(steps), real / t, sum(r["model_flops"] for r in steps) / t / 1e9,
                   pad / (real + pad))


def main(argv=None) -> int:
    p = job_arguments(__doc__, rounds=2, seq_lens=[256, 512, 1024])
    p.add_argument("--mbs", type=int_list, default=[1, 2, 4], help="the stock job's micro-batch sizes (rows per micro-batch) tried")
    p.set_defaults(gbs=32)  # room for more than one stock configuration: a batch packs into 3-12 rows
    args = p.parse_args(argv)
    prepare(args.out)
    configs = {}  # sequence length -> the stock job's (mbs, rows per step) tried there
    for seq_len in args.seq_len:
        mean = max(STAGES, float(np.mean(_batches(args.out, args, seq_len))))
        tried = [(m, max(STAGES, round(mean / m)) * m) for m in args.mbs]
        configs[seq_len] = [(m, rows) for m, rows in tried if abs(rows - mean) <= mean / 2]
        for m, rows in tried:
            if (m, rows) not in configs[seq_len]:
                print(f"seq_len {seq_len}: stock mbs {m} not run: {rows} rows per step, the batches pack into {mean:.1f} on average")
    runs: dict[tuple[int, int], list[list[dict]]] = {}  # (seq_len, stock mbs or 0 for pipetune) -> runs
    for k in range(args.rounds):
        for seq_len, tried in configs.items():
            for m, rows in tried:
                runs.setdefault((seq_len, m), []).append(_stock(args.out / f"vs_torchtitan_{seq_len}_{m}_{k}", args.out, args, seq_len, rows,
                                                                m, steps=args.steps))
            runs.setdefault((seq_len, 0), []).append(_pipetune(args.out / f"vs_pipetune_{seq_len}_{k}", args.out, args, seq_len))
    longest = max(args.seq_len)
    first = _stock(args.out / "vs_torchtitan_step1", args.out, args, longest, max(STAGES, _batches(args.out, args, longest)[0]), 1,
                   steps=1, pad_steps=True)[0]
    print(f"TorchTitan muse_glimmer debugmodel_mm, 2 gloo ranks, GBS {args.gbs}, {args.steps} steps x {args.rounds} round(s) per job, "
          f"first {args.warmup} steps of each left out; TorchTitan: 1F1B over streamed rows of seq_len tokens")
    print(f"{'seq_len':>7} {'job':24} {'pipeline (ms)':>14} {'real tokens/step':>17} {'real tokens/s':>14} {'GFLOP/s':>8} {'padding':>8}")
    ratios = []
    for seq_len, tried in configs.items():
        fig = {m: Figures.of(runs[(seq_len, m)], args.warmup) for m in [0, *(m for m, _ in tried)]}
        for m, rows in [(0, 0), *tried]:
            f = fig[m]
            job = "pipetune" if m == 0 else f"torchtitan mbs {m} x {rows // m}"
            print(f"{seq_len:7} {job:24} {f.pipeline_ms:14.1f} {f.real_tokens:17.0f} {f.rate:14.0f} {f.gflops:8.2f} {f.padding:8.1%}")
        best = max((m for m, _ in tried), key=lambda m: fig[m].rate)
        ratios.append(fig[0].rate / fig[best].rate)
        rows = dict(tried)[best]
        print(f"{seq_len:7} pipetune vs best stock (mbs {best} x {rows // best} micro-batches): {ratios[-1]:.2f}x real tokens/s")
    a, b = first["loss"], runs[(longest, 0)][0][0]["loss"]
    print(f"step-1 loss on the same samples and weights at seq_len {longest}: TorchTitan {a:.6f}, pipetune {b:.6f}, |difference| {abs(a - b):.1e}")
    print(f"pipetune vs best stock: {min(ratios):.2f}-{max(ratios):.2f}x real tokens/s over sequence lengths "
          f"{', '.join(map(str, args.seq_len))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
