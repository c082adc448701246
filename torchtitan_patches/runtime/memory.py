"""Activation memory of a step, measured on any device (CPU included): what the plan's memory model
(``pipetune.schedule.table.ScheduleTable.buffers``, timed by the simulator) predicts.

``SavedActivations`` follows every tensor autograd saves for backward while it is active
(``torch.autograd.graph.saved_tensors_hooks``) through a weak reference to its storage, each storage
counted once, whole (a saved slice keeps all of it alive); ``live_bytes`` sums those still alive.
Weights, buffers and the step's inputs are not activations and are left out. A storage dies when
the last graph node saving it does, so the count follows what torch really frees: at a backward,
or, with a split backward, when the weight-gradient action drops the graph the input-gradient
action kept. Not seen: tensors saved inside activation checkpointing (it installs hooks of its
own, and only the innermost pair runs) and memory that is not a saved tensor (messages in flight,
the gradients a split backward holds for its weight gradients; the executor counts those itself).
Activation offload (``runtime.offload``) installs hooks inside the tracker's and reports to it
(``track``): what it saves and what it reloads; what it copies to the host dies, so it drops out.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["SavedActivations", "storage_bytes"]


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (each counted once, whole)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class SavedActivations:
    """``with tracker: ...`` follows the tensors saved for backward inside the block (see the
    module doc); ``exclude``: tensors whose storages are not activations (weights, buffers, inputs)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}

    def track(self, t: torch.Tensor) -> None:
        """Follow ``t``'s storage (unless excluded): for hooks that sit inside the tracker's (activation offload's)."""
        s = t.untyped_storage()
        ptr, n = s.data_ptr(), s.nbytes()
        if n and ptr not in self.exclude:
            known = self._live.get(ptr)
            if known is None or known[0].expired():  # a freed storage's address reused
                self._live[ptr] = (StorageWeakRef(s), n)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.track(t)
        return t.detach()  # holding ``t`` itself would tie a saved output to its own graph node (a cycle)

    def __enter__(self) -> "SavedActivations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def live_bytes(self) -> int:
        """Bytes of the saved storages still alive (dead ones are forgotten)."""
        dead = [ptr for ptr, (ref, _) in self._live.items() if ref.expired()]
        for ptr in dead:
            del self._live[ptr]
        return sum(n for _, n in self._live.values())
