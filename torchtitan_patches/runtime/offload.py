"""Activation offload: a plan's ``O`` and ``R`` actions (``pipetune.schedule.table``) on this rank.

In the forward of an offloaded backbone ``(chunk, unit)``, ``torch.autograd.graph.saved_tensors_hooks``
hand every tensor autograd saves to that pair's ``SavedOnHost``, which keeps its storage and gives
autograd a handle; the backward's unpack returns the tensor wherever the storage then is. ``O`` copies
the storages to host memory and drops the device ones, ``R`` copies them back, and the gradient
action waits for its ``R`` (``ActivationCopies.ready``). Whole storages move, each once: tensors
saved as views of one storage (a slice, a transpose, the same tensor saved by two operations) stay
views of one storage after the reload, and device memory is freed only where the storage goes.

Left on the device (passed to autograd as they are): parameters and their views (recognised as
views of an ``nn.Parameter``, so FSDP's unsharded parameters count too) and buffers; the step's
inputs (tokens, positions, document metadata, labels: every chunk of the micro-batch shares them);
image features (a buffer of their own in the plan's memory model, until backbone chunk 0's
backward); tensors another chunk of this rank handed over (that chunk holds them for its own
backward); tensors that are not plain strided tensors on the compute device (host scalars of a
CUDA run; tensor subclasses such as tensor parallelism's ``DTensor``: a tensor-parallel chunk
offloads only what autograd saves as plain tensors). The chunk's input received from another rank
is a leaf the graph's gradient accumulator holds (its gradient is the message back), so dropping
the saved reference would free nothing: ``O`` empties the leaf itself (``.data``), ``R`` refills
it. Autograd does not check the version of tensors saved through hooks, so an in-place change of a
saved tensor, which it would otherwise refuse at the backward, goes unnoticed in an offloaded
forward (and is copied as it is at the ``O``).

On CUDA the copies run on a copy stream of their own, in the list's order: each first waits on an
event recorded on the compute stream where the list reaches it (the ``O`` after its forward's
kernels, the ``R`` after its predecessor's); ``O`` copies into pinned host buffers with
``non_blocking=True`` and ``record_stream`` tells the caching allocator that the device storage is
free only once the copy stream is past the copy; ``R`` allocates on the compute stream (at its place
in the list) and fills on the copy stream, recording an event that the gradient action's compute
stream waits on. These streams are untested on the CPU machines this was written on.

On CPU the copy is a real copy into new host tensors, so the mechanism and the gradients are
exercised, but it saves no memory: host and device are one. The step's activation tracker
(``runtime.memory.SavedActivations``) sees it anyway: its hooks sit outside these, so ``pack`` tells
it every saved tensor, and ``R`` every reloaded storage; after an ``O`` the offloaded storages are
dead and its live bytes drop by the pair's activations, after an ``R`` they are back.

Verified on CPU (``tests/unit/test_offload_runtime.py``): bitwise the gradients of the stage
without offload, with a plain stage and with a stage whose layers run under non-reentrant
``torch.utils.checkpoint`` (TorchTitan's full activation checkpointing; its own hooks sit inside
these, so the forward saves only each checkpointed region's inputs here, and the recomputation in
backward reads them through ``unpack`` after the ``R``) or under selective checkpointing (the
operator outputs it keeps are held by the checkpoint itself, not saved through hooks, and stay on
the device); and on 2 and 4 gloo ranks (``tests/integration/test_pipeline_runtime.py``, plain
stages): reference gradients, and each ``O`` freeing exactly what its forward saved but for the
image features and hand-overs above.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext

import torch
from torch import nn

from pipetune.schedule.table import Action, Op
from torchtitan_patches.runtime.memory import SavedActivations
from torchtitan_patches.runtime.timing import ActionTimeline

__all__ = ["ActivationCopies", "SavedOnHost"]

_View = tuple[int, torch.dtype, torch.Size, tuple[int, ...], int]  # storage address at capture, dtype, size, stride, offset


class SavedOnHost:
    """The tensors one forward saved for backward, as whole storages (flat bytes, by their address
    at capture) on the device or the host; ``pack`` and ``unpack`` are its saved-tensor hooks.
    ``keep``: tensors whose storages stay where they are (see the module doc)."""

    def __init__(self, device: torch.device, keep: Iterable[torch.Tensor], tracker: SavedActivations | None):
        self.device = device
        self.keep = {t.untyped_storage().data_ptr() for t in keep if type(t) in (torch.Tensor, nn.Parameter)}  # subclasses pass anyway
        self.tracker = tracker
        self.storages: dict[int, torch.Tensor] = {}
        self.saved: list[_View] = []
        self.leaves: list[tuple[torch.Tensor, _View]] = []
        self.on_host = False

    def _view(self, t: torch.Tensor) -> _View:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in self.storages:
            self.storages[ptr] = torch.empty(0, dtype=torch.uint8, device=self.device).set_(s)
        return ptr, t.dtype, t.size(), t.stride(), t.storage_offset()

    def pack(self, t: torch.Tensor) -> torch.Tensor | int:
        if self.tracker is not None:
            self.tracker.track(t)
        if (type(t) is not torch.Tensor or isinstance(t._base, nn.Parameter) or t.device.type != self.device.type
                or t.layout is not torch.strided or not t.untyped_storage().nbytes() or t.untyped_storage().data_ptr() in self.keep):
            return t.detach()  # holding ``t`` itself would tie a saved output to its own graph node (a cycle)
        self.saved.append(self._view(t))
        return len(self.saved) - 1

    def _tensor(self, view: _View) -> torch.Tensor:
        ptr, dtype, size, stride, offset = view
        return torch.empty(0, dtype=dtype, device=self.device).set_(self.storages[ptr].untyped_storage(), offset, size, stride)

    def unpack(self, packed: torch.Tensor | int) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if self.on_host:
            raise RuntimeError("a backward reads activations that are on the host: the plan's R must come before the gradient action")
        return self._tensor(self.saved[packed])

    def hold(self, leaf: torch.Tensor) -> None:
        """Move ``leaf`` (the chunk's received input) with the saved tensors: ``O`` empties it, ``R`` refills it."""
        self.leaves.append((leaf, self._view(leaf)))

    def to_host(self, pinned: bool) -> None:
        """``O`` on the current stream (pinned, non-blocking copies on CUDA); the device storages go."""
        for ptr, flat in self.storages.items():
            host = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=pinned)
            host.copy_(flat, non_blocking=pinned)
            if pinned:  # the allocator reuses the device memory only once the copy stream is past this copy
                flat.record_stream(torch.cuda.current_stream())
            self.storages[ptr] = host
        for leaf, _ in self.leaves:
            leaf.data = torch.empty(0, dtype=leaf.dtype, device=self.device)
        self.on_host = True

    def allocate(self) -> dict[int, torch.Tensor]:
        """``R``'s device storages, on the current (compute) stream: the memory is taken where the list reaches ``R``."""
        return {ptr: torch.empty(host.shape, dtype=torch.uint8, device=self.device) for ptr, host in self.storages.items()}

    def to_device(self, flats: dict[int, torch.Tensor], stream: torch.cuda.Stream | None) -> None:
        """``R`` on the current stream into ``flats`` (``allocate``); ``stream``: the copy stream on CUDA."""
        for ptr, flat in flats.items():
            flat.copy_(self.storages[ptr], non_blocking=stream is not None)
            if stream is not None:
                flat.record_stream(stream)
        self.storages = flats
        for leaf, view in self.leaves:
            leaf.data = self._tensor(view)
        self.on_host = False
        if self.tracker is not None:
            for ptr in {view[0] for view in self.saved}:
                self.tracker.track(flats[ptr])


class ActivationCopies:
    """One step's offloaded backbone ``(chunk, unit)`` pairs (``pairs``): their ``SavedOnHost`` from
    the forward to the gradient action, and the copy stream ``stream`` (CUDA; None on CPU, where
    copies run on the host in the list's order). ``tracker``: the step's activation tracker, if any."""

    def __init__(self, pairs: frozenset[tuple[int, int]], device: torch.device, stream: torch.cuda.Stream | None,
                 tracker: SavedActivations | None):
        self.pairs = pairs
        self.device = device
        self.stream = stream
        self.tracker = tracker
        self.saved: dict[tuple[int, int], SavedOnHost] = {}
        self.reloaded: dict[tuple[int, int], torch.cuda.Event] = {}

    def capture(self, pair: tuple[int, int], keep: Iterable[torch.Tensor], received: torch.Tensor | None):
        """Hooks for ``pair``'s forward (``keep``: tensors that stay; ``received``: the input leaf that moves too)."""
        saved = self.saved[pair] = SavedOnHost(self.device, keep, self.tracker)
        if received is not None:
            saved.hold(received)
        return torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack)

    def run(self, a: Action, timeline: ActionTimeline) -> None:
        """An ``O`` or ``R``, timed on the copy stream (on CUDA from when that stream gets to it)."""
        pair = a.chunk, a.unit
        saved = self.saved[pair]
        flats = saved.allocate() if a.op is Op.RELOAD else None
        if self.stream is not None:
            here = torch.cuda.Event()
            here.record()
            self.stream.wait_event(here)
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            timeline.begin()
            if flats is None:
                saved.to_host(pinned=self.stream is not None)
            else:
                saved.to_device(flats, self.stream)
            timeline.end()
        if flats is not None and self.stream is not None:
            done = torch.cuda.Event()
            done.record(self.stream)
            self.reloaded[pair] = done

    def ready(self, pair: tuple[int, int]) -> None:
        """Before ``pair``'s gradient action: the compute stream waits for its ``R``. From here the
        graph alone holds the ``SavedOnHost`` (through its hooks), until the chunk's last backward."""
        del self.saved[pair]
        if self.stream is not None:
            torch.cuda.current_stream().wait_event(self.reloaded.pop(pair))
