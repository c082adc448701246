"""Entry point: ``pipetune <command> ...``."""

from __future__ import annotations

import argparse
import sys

from pipetune.cli import calibrate_cmd, data_cmd, layout_cmd, pack_cmd, plan_cmd, profile_cmd, trace_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipetune", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (data_cmd, pack_cmd, profile_cmd, calibrate_cmd, trace_cmd, plan_cmd, layout_cmd):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"pipetune: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
