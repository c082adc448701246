"""Run pipetune's GPU check where the only CUDA torch is older than the 2.13 that pipetune and
TorchTitan 0.3.0 are built for (the lent GPU machines had torch 2.11). Not part of pipetune: put
this folder first on ``PYTHONPATH`` of that one run (``run_gpu_check.sh`` does).

1. Each name in ``missing.txt`` (written by ``scan.py`` on such a machine: names TorchTitan imports
   from newer torch) becomes a placeholder class that raises when instantiated, so that its
   modules import; the single-process check never uses them (FSDP, graph-trainer passes).
2. torch 2.11's ``varlen_attn`` takes neither ``num_splits`` (TorchTitan passes 1, a workaround for
   paged KV caches, which training does not use: dropped) nor ``enable_gqa`` (grouped-query heads
   repeated to the query heads instead, as sdpa's ``enable_gqa`` computes).
Each shim used prints a ``[shim]`` line on stderr."""

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
import types
from pathlib import Path

names: dict[str, set[str]] = {}
modules: set[str] = set()
for line in (Path(__file__).with_name("missing.txt").read_text().splitlines()):
    line = line.strip()
    if line.startswith("module "):
        modules.add(line.split()[1])
    elif line:
        mod, _, name = line.rpartition(".")
        names.setdefault(mod, set()).add(name)


def placeholder(qual: str) -> type:
    class Missing:
        def __init__(self, *args, **kwargs):
            raise RuntimeError(f"{qual} is not in this torch (scripts/older_torch shims it for imports only)")

    Missing.__name__ = Missing.__qualname__ = qual.rpartition(".")[2]
    return Missing


def add_getattr(mod: types.ModuleType) -> None:
    wanted, old = names.get(mod.__name__, set()), getattr(mod, "__getattr__", None)

    def __getattr__(name):
        if name in wanted:
            print(f"[shim] {mod.__name__}.{name}", file=sys.stderr)
            return placeholder(f"{mod.__name__}.{name}")
        if old is not None:
            return old(name)
        raise AttributeError(name)

    mod.__getattr__ = __getattr__


class _AfterExec(importlib.abc.Loader):
    def __init__(self, real):
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        self.real.exec_module(module)
        add_getattr(module)


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Missing modules become empty ones whose every name is a placeholder; modules that lack
    names get a module ``__getattr__`` for them once they have run."""

    def find_spec(self, fullname, path, target=None):
        if fullname in modules:
            return importlib.machinery.ModuleSpec(fullname, self)
        if fullname not in names:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None:
                spec.loader = _AfterExec(spec.loader)
                return spec
        return None

    def create_module(self, spec):
        print(f"[shim] module {spec.name}", file=sys.stderr)
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda name: placeholder(f"{spec.name}.{name}")
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, Finder())
for loaded in [m for m in names if m in sys.modules]:
    add_getattr(sys.modules[loaded])


def _varlen_for_older_torch() -> None:
    import torch.nn.attention.varlen as varlen

    params = inspect.signature(varlen.varlen_attn).parameters
    if "num_splits" in params:
        return
    real, has_gqa = varlen.varlen_attn, "enable_gqa" in params

    @functools.wraps(real)
    def varlen_attn(q, k, v, *args, num_splits=None, enable_gqa=False, **kwargs):
        if enable_gqa and not has_gqa and k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        elif has_gqa:
            kwargs["enable_gqa"] = enable_gqa
        return real(q, k, v, *args, **kwargs)

    varlen.varlen_attn = varlen_attn
    print("[shim] torch.nn.attention.varlen.varlen_attn without num_splits (enable_gqa by repeated heads)", file=sys.stderr)


try:
    _varlen_for_older_torch()
except ImportError:
    pass
