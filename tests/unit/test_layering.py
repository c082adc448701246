"""Layers point one way: the planning core stays free of torch (planning never touches the
training process's CUDA state), the runtime never reaches up into the profiler, and the planning
core's modules import each other without a circle (a circle only loads in one order) and only
from their own floor or the floors below (the data flow, ``FLOORS``)."""

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pipetune

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (a deferred import still ties the modules),
    except under ``if TYPE_CHECKING:``; a ``from X import name`` counts ``X`` and ``X.name``."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return out


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := walk(dep)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := walk(m)):
            return found
    return None


FLOORS = ("pipetune", "config", "files", "data", "packing", "schedule", "cost", "simulate", "records", "plan", "plan.search",
          "plan.separated", "plan.layout", "plan.data_parallel", "calibrate", "serve", "cli", "__main__")
"""The planning core's floors, lowest first: samples -> packing -> cost -> simulate -> plan (the
plan IR, then the search, DIP's separated layout, which layout and planner a job runs, the
data-parallel split) -> calibrate -> serving plans to a running job -> the command line."""


def _floor(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "pipetune"
    return ".".join(parts[:2]) if ".".join(parts[:2]) in FLOORS else parts[0]


def test_planning_core_imports_only_its_own_floor_or_below():
    modules = _modules("pipetune")
    unplaced = sorted({_floor(m) for m in modules} - set(FLOORS))
    assert not unplaced, f"give these folders a floor in FLOORS: {unplaced}"
    up = sorted(f"{name} -> {dep}" for name, path in modules.items() for dep in _imports(path)
                if dep in modules and FLOORS.index(_floor(dep)) > FLOORS.index(_floor(name)))
    assert len(modules) > 10
    assert not up, "imports that point up the data flow: " + "; ".join(up)


def test_planning_core_never_imports_torch():
    modules = [m.name for m in pkgutil.walk_packages(pipetune.__path__, "pipetune.") if m.name != "pipetune.__main__"]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(k for k in sys.modules if k == 'torch' or k.startswith(('torch.', 'torchtitan')))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(modules) > 10


def test_runtime_never_imports_profiling():
    modules = _modules("torchtitan_patches")
    bad = {name: found for name, path in modules.items()
           if (found := sorted(m for m in _imports(path) if m == "profiling" or m.startswith("profiling.")))}
    assert len(modules) > 10
    assert not bad, f"the profiler builds on the runtime, not the reverse; these import it: {bad}"


def test_planning_core_has_no_import_cycle():
    modules = _modules("pipetune")
    graph = {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}
    assert len(graph) > 10
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
