"""Keep freed CPU memory in the process instead of returning it to the OS (glibc ``mallopt``).

By default glibc serves every buffer over 128 KiB-32 MiB with a fresh ``mmap`` and unmaps it on
free, so each training step page-faults its activations back in. On CPU that costs ~20 % of a
stage's time and grows with the number of live tensors, which makes a stage slower than the sum
of its separately profiled layers. Profiling, stage timing and the trainer on CPU (``titan.cpu_device``) all call
``retain_freed_memory`` first so that they run under the same allocator behaviour. No effect
(and no error) where glibc is absent.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def retain_freed_memory() -> bool:
    """Returns whether the settings took effect."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    ok &= mallopt(_M_TOP_PAD, 256 << 20) == 1
    return bool(ok)
