"""Timing and memory probes for the profiler: medians over repeats, CUDA events on GPU."""

from __future__ import annotations

import time
from typing import Callable

import torch


class Clock:
    """Elapsed seconds of a region: CUDA events on a GPU, ``perf_counter`` on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, fn: Callable[[], object]) -> tuple[object, float]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0


def fwd_bwd_sample(clock: Clock, make_inputs: Callable[[], tuple], forward: Callable[..., torch.Tensor], *, backward: bool) -> tuple[float, float]:
    """One timed forward (and backward) on freshly built inputs (building them is not timed)."""
    inputs = make_inputs()
    clock.sync()
    if not backward:
        with torch.no_grad():
            _, tf = clock.measure(lambda: forward(*inputs))
        return tf, 0.0
    out, tf = clock.measure(lambda: forward(*inputs))
    grad = torch.ones_like(out)
    clock.sync()
    _, tb = clock.measure(lambda: out.backward(grad))
    return tf, tb


def saved_activation_bytes(fn: Callable[[], torch.Tensor], module: torch.nn.Module) -> int:
    """Bytes of distinct tensors autograd keeps for backward while ``fn`` runs (weights excluded)."""
    params = {p.data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = max(storages.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())
