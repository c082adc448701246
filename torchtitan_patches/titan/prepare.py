"""Make what a pipetune TorchTitan job reads before it starts: a data set and the latency table.

    python -m torchtitan_patches.titan.prepare --config pipetune_muse_glimmer_mm --out out/titan

``<out>/data`` is a generated mix (``pipetune data make``; skip with ``--data`` for a real data
set) and ``<out>/table.json`` the latency table of this device for the job's planning shapes,
derived from the job's TorchTitan model config. The profiler times pipetune's reference blocks of
those shapes (the planner's cost model), not the TorchTitan modules themselves; the trainer's
online calibration fits the table to the measured steps of the real model. Both files are kept
when they exist, so re-runs are free.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from pipetune.cli.common import positive_int
from pipetune.data import make_mix, write_dataset
from pipetune.data.mixes import parse_mix
from torchtitan_patches.titan import config_registry
from torchtitan_patches.titan.model_spec import planning_model_config


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchtitan_patches.titan.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="pipetune_muse_glimmer_mm", help="function of torchtitan_patches.titan.config_registry")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mix", default="datamix2")
    p.add_argument("--samples", type=positive_int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads while profiling (use what training uses)")
    args = p.parse_args(argv)
    from profiling.p2p import P2PMeasurementError
    from profiling.profile_layers import ProfileConfig, run_profile

    make = getattr(config_registry, args.config, None)
    if make is None:
        p.error(f"--config {args.config}: no such function in torchtitan_patches.titan.config_registry")
    config = make()
    pt = config.pipetune
    model = planning_model_config(config.model_spec, image_grid=pt.image_grid, encoder_frozen=pt.freeze_vision_encoder)
    data = args.out / "data"
    if not data.exists():
        weights = parse_mix(args.mix)
        write_dataset(make_mix(weights, args.samples, args.seed), data, {"mix": args.mix, "weights": weights, "seed": args.seed,
                                                                          "samples": args.samples})
        print(f"wrote {args.samples} samples ({args.mix}) to {data}")
    table = args.out / "table.json"
    if not table.exists():
        seq = config.training.seq_len
        cfg = ProfileConfig(max_seq_len=seq, max_tokens=seq * pt.max_mbs, max_images=32, points=6, repeats=5, threads=args.threads)
        try:
            run_profile(model, cfg, table, progress=False)
        except P2PMeasurementError as e:
            # the job still runs; the online calibration absorbs the message cost into per-call overheads
            print(f"warning: {e}\nprofiling with the assumed message cost instead (the table's notes say so)")
            run_profile(model, dataclasses.replace(cfg, p2p=False), table, progress=False)
        print(f"wrote {table} (latency table of {model.name} on this CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
