"""Arguments shared by several subcommands: model, data source, batch shape."""

from __future__ import annotations

import argparse
import json
import sys

from pipetune.config import ModelConfig, load_model_config
from pipetune.data import Overlong, SampleTable, make_mix, open_dataset


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (``--iters 0``, ``--mbs 0`` are refused with a message, not run)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


def add_model_args(p: argparse.ArgumentParser, default: str = "13b") -> None:
    p.add_argument("--model", default=default, help="model preset name (3b, 7b, 13b, tiny) or a model TOML file")
    p.add_argument("--model-config", help="model TOML file; overrides --model")


def model_from_args(args) -> ModelConfig:
    return load_model_config(args.model_config or args.model)


def add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--data", help="data set: a `pipetune data make` directory, .jsonl/.parquet file(s)")
    g.add_argument("--mix", help="generate a mix in memory instead: datamix1|datamix2|datamix3 or weights mmc4:coyo:flan")
    p.add_argument("--samples", type=positive_int, default=100_000, help="samples to generate with --mix")
    p.add_argument("--data-seed", type=non_negative_int, default=0, help="seed of the generated mix and of the batch order")


def table_from_args(args) -> SampleTable:
    if args.data:
        return open_dataset(args.data).table
    return make_mix(args.mix or "datamix2", args.samples, args.data_seed)


def add_batch_args(p: argparse.ArgumentParser, *, mbs: int | None = 2) -> None:
    p.add_argument("--gbs", type=positive_int, default=128, help="global batch size in samples")
    p.add_argument("--max-seq-len", type=positive_int, default=8192)
    if mbs is not None:
        p.add_argument("--mbs", type=positive_int, default=mbs, help="micro-batch size: a micro-batch holds mbs x max-seq-len tokens")
    p.add_argument("--overlong", default="truncate", choices=[o.value for o in Overlong], help="policy for samples over max-seq-len")
    p.add_argument("--iters", type=positive_int, default=10, help="iterations (global batches) to process")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def emit_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def add_cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", default="a100", help="analytical preset (a100, h100, h200) or hardware TOML; used without --latency-table")
    p.add_argument("--latency-table", help="measured latency table (pipetune profile); overrides --hardware")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree per stage (must divide every head count)")
    p.add_argument("--pp", type=positive_int, default=4, help="pipeline stages (one per rank)")


def cost_model_from_args(args, model: ModelConfig):
    """The stage cost model the job asked for: a measured table, or an analytical estimate."""
    from pipetune.config import load_hardware
    from pipetune.cost import CostModel, StageLayout, analytical_table, load_latency_table

    model.check_tp(args.tp)
    if args.latency_table:
        table = load_latency_table(args.latency_table, model=model, tp=args.tp)
    else:
        table = analytical_table(model, load_hardware(args.hardware), tp=args.tp)
    return CostModel(table, StageLayout.even(model.backbone.n_layers, args.pp))
