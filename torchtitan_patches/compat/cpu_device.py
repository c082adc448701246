"""Let TorchTitan 0.3.0's trainer run on a machine without an accelerator (CPU + gloo).

TorchTitan picks its device type once, at import (``torchtitan.tools.utils.device_type``), and
falls back to ``"cuda"`` when no accelerator is found; several of its modules copy that name and
the device module into their own globals, and its memory monitor calls ``torch.cuda``-only
functions. There is no CPU switch to call, so ``use_cpu`` rebinds those globals to ``"cpu"`` and a
device module whose memory statistics read this process's resident set size (peak RSS stands in
for peak reserved memory). Process groups then default to gloo for ``cpu`` (TorchTitan asks torch's
``default_device_backend_map``). Call it before the ``Trainer`` is built; it does nothing when CUDA
is available.
"""

from __future__ import annotations

import importlib
import os
import resource
import types

import torch

_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.tools.profiler",
    "torchtitan.models.common.token_dispatcher",
)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cpu_device_module() -> types.SimpleNamespace:
    props = types.SimpleNamespace(total_memory=_total_memory())
    return types.SimpleNamespace(
        set_device=lambda device: None,
        current_device=lambda: 0,
        device_count=lambda: 1,
        synchronize=lambda *a, **k: None,
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: props,
        reset_peak_memory_stats=lambda *a, **k: None,
        empty_cache=lambda: None,
        memory_stats=lambda device=None: {"active_bytes.all.peak": _peak_rss_bytes(), "reserved_bytes.all.peak": _peak_rss_bytes(),
                                          "num_alloc_retries": 0, "num_ooms": 0},
    )


def use_cpu() -> bool:
    """Point TorchTitan at the CPU when there is no CUDA device; True if it did."""
    if torch.cuda.is_available():
        return False
    module = _cpu_device_module()
    for name in _MODULES:
        mod = importlib.import_module(name)
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = module
    return True
