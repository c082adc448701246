"""List the torch names that modules under the given folders import and this torch lacks, one per
line (``module <name>`` for a missing module), into ``missing.txt`` beside this file; run it on
the GPU machine with the TorchTitan to be shimmed (``python scan.py <site-packages>/torchtitan``)."""

import ast
import importlib
import sys
from pathlib import Path

missing: set[str] = set()
for root in map(Path, sys.argv[1:]):
    for f in root.rglob("*.py"):
        if "tests" in f.parts:
            continue
        try:
            tree = ast.parse(f.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch"):
                continue
            try:
                mod = importlib.import_module(node.module)
            except ImportError:
                missing.add(f"module {node.module}")
                continue
            for alias in node.names:
                if alias.name != "*" and not hasattr(mod, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.add(f"{node.module}.{alias.name}")
out = Path(__file__).with_name("missing.txt")
out.write_text("".join(f"{m}\n" for m in sorted(missing)))
print(f"{len(missing)} missing names written to {out}:", *sorted(missing), sep="\n")
