"""Keep freed CPU memory in the process and touch it before training (glibc ``mallopt``).

By default glibc serves every buffer over 128 KiB-32 MiB with a fresh ``mmap`` and unmaps it on
free, so each training step page-faults its activations back in. On CPU that costs ~20 % of a
stage's time and grows with the number of live tensors, which makes a stage slower than the sum
of its separately profiled layers. Profiling, stage timing and the trainer on CPU
(``compat.cpu_device``) all call ``retain_freed_memory`` first so that they run under the same
allocator behaviour.

Retained memory still has to be faulted in once: while the heap grows to the job's peak, every
step that needs more than any step before it writes to fresh pages (measured on 2 gloo ranks:
elementwise ops 30x their usual time; a step's first run at 4 samples per micro-batch 2.7x the
same batch at 1 sample, and a 21-image batch at 4 samples 1.25x, where with the heap touched
beforehand both ran 1.01x). Those costs follow the history of the run, not the plan, so the
trainer's online calibration would fit them to whatever plans happened to grow the heap.
``reserve_bytes`` touches that much heap up front (memset, about 0.5 s per GiB); with trimming off
it stays resident for the whole run. A job whose heap outgrows it faults in the rest as before.
No effect (and no error) where glibc is absent.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_CHUNK = 64 << 20  # below the mmap threshold set here, so chunks come from the heap


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        libc.mallopt  # noqa: B018 (absent outside glibc)
    except (OSError, AttributeError):
        return None
    return libc


def retain_freed_memory(reserve_bytes: int = 0) -> bool:
    """Returns whether the settings took effect (and the reserve, if asked, was touched)."""
    if reserve_bytes < 0:
        raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
    libc = _libc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1
    ok &= libc.mallopt(_M_TRIM_THRESHOLD, -1) == 1  # -1: never trim
    ok &= libc.mallopt(_M_TOP_PAD, 256 << 20) == 1
    if ok and reserve_bytes:
        chunks = [libc.malloc(_CHUNK) for _ in range(-(-reserve_bytes // _CHUNK))]
        if not all(chunks):
            for c in filter(None, chunks):
                libc.free(c)
            return False
        for c in chunks:
            libc.memset(c, 0, _CHUNK)
        for c in chunks:
            libc.free(c)
    return bool(ok)
