"""The CPU heap reserve: memory touched before training is reused without page faults."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from torchtitan_patches.compat.cpu_allocator import retain_freed_memory

# a fresh process per case: mallopt settings and the heap are per process
_FAULTS = """
import resource, sys, torch
from torchtitan_patches.compat.cpu_allocator import retain_freed_memory
if not retain_freed_memory(int(sys.argv[1]) << 20):
    sys.exit(print(-1))  # not glibc
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(32 << 20).fill_(1.0)  # 128 MiB of activations, say
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(reserve_mib: int) -> int:
    out = subprocess.run([sys.executable, "-c", _FAULTS, str(reserve_mib)], capture_output=True, text=True, timeout=60, check=True)
    if int(out.stdout) < 0:
        pytest.skip("no glibc mallopt on this platform")
    return int(out.stdout)


def test_a_reserved_heap_serves_a_large_tensor_without_page_faults():
    pages = (128 << 20) // 4096
    with ThreadPoolExecutor(2) as pool:  # the two processes side by side: each counts its own faults
        without, reserved = pool.map(_faults, (0, 256))
    assert without > pages // 2  # without the reserve the tensor's pages fault in on first write
    assert reserved < pages // 50


def test_a_negative_reserve_is_refused():
    with pytest.raises(ValueError, match="reserve_bytes must be >= 0"):
        retain_freed_memory(-1)
