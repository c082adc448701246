"""Entry point: ``pipetune <command> ...``.

Bad input is reported as one line, ``pipetune: error: ...``, exit code 2: every ``ValueError`` (the
project's error types all derive from it: ``ConfigError``, ``LatencyTableError``, ``PlanError``,
...) and ``OSError`` (missing or unreadable files). Such an error raised outside the project's own
code also names where it came from. Anything else is a bug and keeps its traceback;
``PIPETUNE_DEBUG=1`` shows the traceback of every error.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from pipetune.cli import calibrate_cmd, data_cmd, layout_cmd, pack_cmd, plan_cmd, profile_cmd, trace_cmd
from pipetune.cli.common import DefaultsFormatter

PROJECT_DIRS = tuple(Path(__file__).resolve().parents[2] / d for d in ("pipetune", "profiling", "torchtitan_patches"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipetune", description="Plan pipeline-parallel VLM training per iteration: make, index and pack data, profile a "
        "device, simulate and compare plans. `pipetune COMMAND --help` shows a command's options and their defaults.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (data_cmd, pack_cmd, profile_cmd, calibrate_cmd, trace_cmd, plan_cmd, layout_cmd):
        module.register(sub)
    for command in _parsers(sub):
        command.formatter_class = DefaultsFormatter
    return parser


def _parsers(sub) -> list[argparse.ArgumentParser]:
    """Every (sub)command parser under ``sub``."""
    out = []
    for p in dict.fromkeys(sub.choices.values()):
        out.append(p)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                out += _parsers(action)
    return out


def _origin(e: BaseException) -> str:
    """`` (from FILE:LINE)`` when ``e`` was raised outside the project's code, else ``""``."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return ""
    last = Path(frames[-1].filename).resolve()
    if any(last.is_relative_to(d) for d in PROJECT_DIRS):
        return ""
    return f" (from {last.name}:{frames[-1].lineno}; PIPETUNE_DEBUG=1 shows the traceback)"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as e:
        if os.environ.get("PIPETUNE_DEBUG"):
            raise
        print(f"pipetune: error: {e}{_origin(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
