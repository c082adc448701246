"""Arguments shared by several subcommands: model, data source, batch shape."""

from __future__ import annotations

import argparse
import json
import sys

from pipetune.config import ModelConfig, load_model_config
from pipetune.config.presets import available_hardware, available_models
from pipetune.data import Overlong, SampleTable, make_mix, open_dataset
from pipetune.data.image_files import BadImages
from pipetune.data.text import BYTE_TOKENIZER, TextTokenizer
from pipetune.data.tokenizer_files import load_tokenizer


def _number(convert, kind: str, bound: str, ok):
    """argparse type: ``convert(text)`` within ``bound`` (e.g. ``--iters 0`` and ``--mbs 0`` are
    refused with a message instead of meaning something else)."""

    def parse(text: str):
        try:
            v = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {kind} {bound}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"must be {'a finite number ' if convert is float else ''}{bound}, got {v}")
        return v

    return parse


positive_int = _number(int, "an integer", ">= 1", lambda v: v >= 1)
non_negative_int = _number(int, "an integer", ">= 0", lambda v: v >= 0)
positive_float = _number(float, "a number", "> 0", lambda v: 0 < v < float("inf"))


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that shows every option's default, unless its text already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is argparse.SUPPRESS or action.default is False or action.default == []
        if not action.option_strings or "default" in text or unset:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def add_model_args(p: argparse.ArgumentParser, default: str = "13b") -> None:
    p.add_argument("--model", default=default, help=f"model preset ({', '.join(available_models())}) or a model TOML file")
    p.add_argument("--model-config", help="model TOML file; overrides --model")


def model_from_args(args) -> ModelConfig:
    return load_model_config(args.model_config or args.model)


def add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--data", help="data set: a `pipetune data make` directory, .jsonl/.parquet file(s), webdataset .tar "
                                  "shards, a save_to_disk directory, a directory of such data sets, or an index of one "
                                  "(`pipetune data index`)")
    g.add_argument("--mix", help="generate a mix in memory instead: datamix1|datamix2|datamix3, webdocs, video or weights mmc4:coyo:flan")
    p.add_argument("--samples", type=positive_int, default=100_000, help="samples to generate with --mix")
    p.add_argument("--data-seed", type=non_negative_int, default=0, help="seed of the generated mix and of the batch order")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="tokenizer that counts raw text in --data: the job's HuggingFace tokenizer folder or its tokenizer.json "
                        "(default: pipetune's byte tokenizer, one token per UTF-8 byte)")
    p.add_argument("--bad-images", default="error", choices=[b.value for b in BadImages],
                   help="a row with an unreadable image in --data: stop naming it, or leave the row out (default: error)")


def tokenizer_from_args(args) -> TextTokenizer:
    """What raw text is counted with: ``--tokenizer`` (refused in one line if unreadable), else pipetune's byte tokenizer."""
    return load_tokenizer(args.tokenizer) if args.tokenizer else BYTE_TOKENIZER


def table_from_args(args) -> SampleTable:
    if args.data:
        store = open_dataset(args.data, tokenizer=tokenizer_from_args(args), bad_images=args.bad_images)
        if store.tokenizer is BYTE_TOKENIZER and store.raw_text:  # the counts would silently be ~4x the job's
            print("note: raw text counted in UTF-8 bytes with pipetune's byte tokenizer (about 4x a BPE tokenizer's "
                  "count); pass --tokenizer PATH for the job's tokenizer", file=sys.stderr)
        if store.skipped:
            where, why = store.skipped[0]
            print(f"note: {len(store.skipped)} rows left out (no text, or an unreadable image under --bad-images skip), "
                  f"e.g. row {where}: {why}", file=sys.stderr)
        return store.table
    return make_mix(args.mix or "datamix2", args.samples, args.data_seed)


def add_batch_args(p: argparse.ArgumentParser, *, mbs: int | None = 2) -> None:
    p.add_argument("--gbs", type=positive_int, default=128, help="global batch size in samples")
    p.add_argument("--max-seq-len", type=positive_int, default=8192, help="longest packed sequence (tokens); longer samples meet --overlong")
    if mbs is not None:
        p.add_argument("--mbs", type=positive_int, default=mbs, help="micro-batch size: a micro-batch holds mbs x max-seq-len tokens")
    p.add_argument("--overlong", default="truncate", choices=[o.value for o in Overlong], help="policy for samples over max-seq-len")
    p.add_argument("--iters", type=positive_int, default=10, help="iterations (global batches) to process")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def emit_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def add_cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", default="a100",
                   help=f"analytical preset ({', '.join(available_hardware())}) or hardware TOML; used without --latency-table")
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
