"""The one clock of profiler, stage timer and pipeline runtime: CUDA events on a GPU (recorded on
the compute stream, so they time kernels, not their launches), ``perf_counter`` on CPU. It lives in
the runtime, whose executor times every action with it; ``profiling`` imports it from here."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Hashable

import torch


QUEUE_AHEAD_CYCLES = (1 << 20, 1 << 25)  # a sleep kernel's first and largest length, in GPU clock cycles (about 0.6 and 20 ms)


class Clock:
    """Elapsed seconds of a region: CUDA events on a GPU, ``perf_counter`` on CPU.

    On a GPU a region is timed as it runs inside a pipeline step, whose host runs ahead of the
    device: a sleep kernel first keeps the device busy while the host queues the region's kernels,
    so the events time kernels back to back, not the host launching them. Timed from an idle
    device instead, a decoder layer of an 8B model's width (bf16 under autocast, 256-4096 tokens,
    an H100) read 13-67 % longer in forward and 16-46 % in backward than per layer of a chain of
    eight run back to back. When the device reached the region
    before its kernels were all queued, the sleep doubles for the next region of the same ``key``
    (up to ``QUEUE_AHEAD_CYCLES[1]``), so warm-up calls set it; ``torch.cuda._sleep`` is torch's
    own test helper for this. Queueing a region takes about as long whatever its size, but regions
    differ (a decoder layer's backward launches many more kernels than an embedding's forward), so
    callers key the sleep by region: one sleep for all made every region wait as long as the one
    slowest to queue (a GPU check run, wheel installation included, took about 200 s that way and
    164 s keyed, on H100s)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.cycles: dict[Hashable, int] = {}

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, fn: Callable[[], object], key: Hashable = None) -> tuple[object, float]:
        if self.cuda:
            cycles = self.cycles.get(key, QUEUE_AHEAD_CYCLES[0])
            torch.cuda._sleep(cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            if start.query():  # the device got to the region while the host was still queueing it
                cycles = min(2 * cycles, QUEUE_AHEAD_CYCLES[1])
            self.cycles[key] = cycles
            end.synchronize()
            return out, start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0

    def timeline(self) -> "ActionTimeline":
        return ActionTimeline(self.cuda)


class ActionTimeline:
    """Start and end of every action of one step, in the simulator's terms: an action starts when
    its rank could work on it (its previous action's end, pushed back by any wait for an incoming
    message) and ends when its work is done.

    On a GPU, an event is recorded on the current stream before and after each action; since a
    wait for a message makes that stream wait, the start event marks exactly that moment, and
    gaps between events are idle time. Events are read once, in ``finish``, after the step (no
    host synchronisation inside it). On CPU, the host clock, with time spent in ``waiting``
    pushing the next start back. ``finish`` gives times relative to the step's start on this
    rank's own clock: ranks on other nodes share no clock, but they start a step together (the
    executor starts it right after the ranks' digest exchange, a synchronisation point), so
    relative times line up across nodes whatever their clocks' offsets.
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._spans: list[tuple] = []

    def start(self) -> None:
        """Begin the step (on a GPU after the device has drained, so that host and event clocks
        share an origin)."""
        if self.cuda:
            torch.cuda.synchronize()
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
        self.t0 = time.perf_counter()
        self._ready = self.t0

    @contextmanager
    def waiting(self):
        """Around a blocking wait for a message (host-side on CPU; on a GPU the stream waits)."""
        t = time.perf_counter()
        yield
        if not self.cuda:
            self._ready += time.perf_counter() - t

    def begin(self) -> None:
        """Right before an action's work (after the waits for its inputs)."""
        if self.cuda:
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()
        else:
            self._open = self._ready

    def end(self) -> None:
        if self.cuda:
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            self._spans.append((self._open, done))
        else:
            self._ready = time.perf_counter()
            self._spans.append((self._open, self._ready))

    def finish(self) -> tuple[list[tuple[float, float]], float]:
        """(start, end) of every action in order and the step's length, in seconds from the
        step's start: read after the step."""
        if self.cuda:
            last = torch.cuda.Event(enable_timing=True)
            last.record()
            last.synchronize()

            def at(e):
                return self._origin.elapsed_time(e) / 1e3

            return [(at(a), at(b)) for a, b in self._spans], at(last)
        return [(a - self.t0, b - self.t0) for a, b in self._spans], time.perf_counter() - self.t0


def fwd_bwd_sample(clock: Clock, make_inputs: Callable[[], tuple], forward: Callable[..., torch.Tensor], *, backward: bool,
                   key: Hashable = None) -> tuple[float, float]:
    """One timed forward (and backward) on freshly built inputs (building them is not timed);
    ``key`` names the region for the clock's sleep (``Clock``)."""
    inputs = make_inputs()
    clock.sync()
    if not backward:
        with torch.no_grad():
            _, tf = clock.measure(lambda: forward(*inputs), (key, "forward"))
        return tf, 0.0
    out, tf = clock.measure(lambda: forward(*inputs), (key, "forward"))
    grad = torch.ones_like(out)
    clock.sync()
    _, tb = clock.measure(lambda: out.backward(grad), (key, "backward"))
    return tf, tb


def input_grad_sample(clock: Clock, make_inputs: Callable[[], tuple], forward: Callable[..., torch.Tensor], *,
                      key: Hashable = None) -> float:
    """Seconds of the input-gradient part of one backward (a split backward's ``I``) on freshly
    built inputs: ``autograd.grad`` towards the inputs that require grad runs no weight-gradient
    kernel they do not need. The forward is not timed; 0 when no input is differentiable."""
    inputs = make_inputs()
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not wanted:
        return 0.0
    out = forward(*inputs)
    grad = torch.ones_like(out)
    clock.sync()
    _, ti = clock.measure(lambda: torch.autograd.grad(out, wanted, grad_outputs=grad), (key, "input_grad"))
    return ti


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
