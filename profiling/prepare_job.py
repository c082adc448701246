"""Make what a pipetune TorchTitan job reads before it starts: a data set and the latency table.

    python -m profiling.prepare_job --config muse_glimmer_mm --out out/titan
    python -m profiling.prepare_job --module my_jobs --config my_vlm_pipetune --device cuda \
        --no-data --out tables/my_vlm_h100

``<out>/fixture`` is a small real-looking corpus (``pipetune data fixture``: real JPEG/PNG files of
varied sizes and real text in TorchTitan's multimodal formats, ``<out>/fixture/data``, with its
tokenizer, ``<out>/fixture/tokenizer``), ``<out>/data`` a generated mix when ``--mix`` names one
(``pipetune data make``; ``--no-data`` for a job that trains on its own data set), and
``<out>/table.json`` the latency table of this device (``--device``) for
the job's planning shapes, derived from the job's TorchTitan model config (``--module`` and
``--config`` name it as TorchTitan's own ``--module``/``--config`` do), in the job's compute dtype
(``training.mixed_precision_param``, or ``--dtype`` for a job that overrides it on its command line:
the trainer refuses a table of another device or dtype). In reduced precision without FSDP the
weights stay float32 and the table is timed under autocast (``ProfileConfig.master_weights``),
as the job runs; a shard degree of -1 is resolved from ``WORLD_SIZE`` as torchrun would set it
(1 when unset: set it, or the shard degree, for an FSDP job). The profiler times pipetune's reference blocks of
those shapes (the planner's cost model), not the TorchTitan modules themselves, except a model's
linear-attention layers (Qwen3.5's Gated DeltaNet), which it times as the model's own layer; the
trainer's online calibration fits the table to the measured steps of the real model. Both files are kept
when they exist, so re-runs are free.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from pathlib import Path

from pipetune.cli.common import positive_int
from pipetune.data import make_mix, write_dataset
from pipetune.data.fixture import write_fixture
from pipetune.data.mixes import parse_mix
from torchtitan_patches.titan.model_parts import master_weights_of
from torchtitan_patches.models.model_spec import planning_model_config


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m profiling.prepare_job", description=__doc__.split("\n\n")[0])
    p.add_argument("--module", default="pipetune_configs", help="package whose config_registry holds --config (as TorchTitan's "
                   "--module; pipetune's own ship with it)")
    p.add_argument("--config", default="muse_glimmer_mm", help="config function returning a PipeTuneTrainer.Config")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--no-data", action="store_true", help="only the latency table (the job trains on its own data set)")
    p.add_argument("--device", default="cpu", help="cpu or cuda: the device the job trains on")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="compute dtype the job trains in (default: its "
                   "training.mixed_precision_param)")
    p.add_argument("--tp", type=positive_int, help="tensor-parallel degree the job trains with: the table times one rank's "
                   "shards (default: its parallelism.tensor_parallel_degree)")
    p.add_argument("--mix", help="also write a generated mix of this name (e.g. datamix2) to <out>/data")
    p.add_argument("--samples", type=positive_int, default=4000, help="samples of the generated mix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads while profiling (use what training uses)")
    args = p.parse_args(argv)
    from profiling.p2p import P2PMeasurementError
    from profiling.profile_layers import ProfileConfig, run_profile

    registry = None
    for name in (f"{args.module}.config_registry", args.module):
        try:
            registry = importlib.import_module(name)
            break
        except ModuleNotFoundError:
            continue
    if registry is None:
        p.error(f"--module {args.module}: neither it nor {args.module}.config_registry can be imported (is it on PYTHONPATH?)")
    make = getattr(registry, args.config, None)
    if make is None:
        p.error(f"--config {args.config}: no such function in {registry.__name__}")
    config = make()
    pt = config.pipetune
    model = planning_model_config(config.model_spec, image_grid=pt.image_grid, encoder_frozen=pt.freeze_vision_encoder)
    fixture = args.out / "fixture"
    if not args.no_data and not fixture.exists():
        info = write_fixture(fixture, seed=args.seed)
        print(f"wrote a corpus of {info['pairs']['samples']} caption pairs, {info['interleaved']['documents']} documents and "
              f"{info['interleaved']['text_only']} text-only documents ({info['images']['count']} images) to {fixture}")
    data = args.out / "data"
    if not args.no_data and args.mix and not data.exists():
        weights = parse_mix(args.mix)
        write_dataset(make_mix(weights, args.samples, args.seed), data, {"mix": args.mix, "weights": weights, "seed": args.seed,
                                                                          "samples": args.samples})
        print(f"wrote {args.samples} samples ({args.mix}) to {data}")
    table = args.out / "table.json"
    if not table.exists():
        seq = config.training.seq_len
        dtype = args.dtype or config.training.mixed_precision_param
        cfg = ProfileConfig(max_seq_len=seq, max_tokens=seq * pt.max_mbs, max_images=32, points=6, repeats=5, threads=args.threads,
                            device=args.device, dtype=dtype, tp=args.tp or config.parallelism.tensor_parallel_degree,
                            master_weights=master_weights_of(config, dtype))
        try:
            run_profile(model, cfg, table)
        except P2PMeasurementError as e:
            # the job still runs; the online calibration absorbs the message cost into per-call overheads
            print(f"warning: {e}\nprofiling with the assumed message cost instead (the table's notes say so)")
            run_profile(model, dataclasses.replace(cfg, p2p=False), table)
        print(f"wrote {table} (latency table of {model.name} on {args.device} in {cfg.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
