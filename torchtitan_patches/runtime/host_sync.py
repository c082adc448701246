"""Counting the host-device synchronisations of a step's hot loop (a check, off by default).

A synchronisation stalls the host until the device has caught up, so the host stops running
ahead to queue kernels: a few per micro-batch make a GPU pipeline wait on Python.

* CUDA: torch's sync debug mode warns at every synchronising call (``item``, ``tolist``, copies
  to the host, ``nonzero``, uploads from pageable memory without ``non_blocking``); each warning
  counts. Not seen by it: ``non_blocking`` copies from pageable memory (they may stall the host
  too) and CUDA event or stream ``synchronize`` calls. The mode and the warning capture are
  process-wide, so another thread's synchronisations in the block count too.
* CPU: nothing synchronises, so the counter counts what would on a GPU, treating every tensor as
  a device tensor: reads of tensor data into Python (``item``, ``tolist``, ``numpy``, ``cpu``, a
  tensor's truth value), operators whose output shape depends on tensor data (``nonzero``,
  boolean masking, ``unique``, ``repeat_interleave`` without a size), comparisons answered on the
  host (``equal``) and tensors made from Python data (``torch.tensor``: an upload). Stricter than
  CUDA on purpose; host work belongs before the loop (the executor prepares spans, lengths and
  metadata from the batch's host tensors there). A copy by ``to`` has no direction on a CPU and is
  not counted.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_DATA_DEPENDENT = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique2, aten.unique_dim,
                   aten.unique_consecutive, aten.equal, aten.lift_fresh}


class _CpuSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if (packet in _DATA_DEPENDENT
                or (packet is aten.repeat_interleave and isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None)
                or (packet in (aten.index, aten.index_put, aten.index_put_)
                    and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None))):
            self.count += 1
        return func(*args, **kwargs)


class HostSyncCounter:
    """``with counter: ...`` adds the synchronisations of the block to ``counter.count``."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.count = 0

    def __enter__(self) -> "HostSyncCounter":
        if self.device.type == "cuda":
            self._warnings = warnings.catch_warnings(record=True)
            self._caught = self._warnings.__enter__()
            warnings.simplefilter("always")
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        else:
            self._dispatch = _CpuSyncs().__enter__()
            self._host_reads = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}
            for name, read in self._host_reads.items():
                setattr(torch.Tensor, name, self._counted(read))
        return self

    def _counted(self, read):
        def call(tensor, *args, **kwargs):
            self.count += 1
            return read(tensor, *args, **kwargs)
        return call

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode(self._mode)
            self._warnings.__exit__(*exc)
            self.count += sum("synchronizing" in str(w.message) for w in self._caught)
        else:
            for name, read in self._host_reads.items():
                setattr(torch.Tensor, name, read)
            self._dispatch.__exit__(*exc)
            self.count += self._dispatch.count
