"""The device's link to pinned host memory: ``latency + bytes / bandwidth`` of one copy, what an
activation offload or reload costs (``LatencyTable.host``).

CUDA only: copies of growing size between a device buffer and a pinned host buffer, each way,
timed with CUDA events; the slower direction's fastest repeat per size is fitted as in
``profiling.p2p`` (noise only ever adds time). A CPU has no such link: its tables have no ``host``
and a job on them does not offload. Not yet run on a GPU in pipetune's tests (no GPU in CI).
"""

from __future__ import annotations

import torch

from profiling.p2p import fit_message_cost

SIZES = tuple(1 << k for k in range(20, 29, 2))  # 1 MiB .. 256 MiB
REPEATS = 5


def measure_host_link(device: torch.device) -> dict[str, float] | None:
    """``{"latency_s", "bytes_per_s"}`` of one copy between ``device`` and pinned host memory; None off CUDA."""
    if device.type != "cuda":
        return None
    top = SIZES[-1]
    dev = torch.empty(top, dtype=torch.uint8, device=device)
    host = torch.empty(top, dtype=torch.uint8, pin_memory=True)
    times = []
    for n in SIZES:
        best = {}
        for direction in ("out", "in"):
            src, dst = (dev[:n], host[:n]) if direction == "out" else (host[:n], dev[:n])
            dst.copy_(src, non_blocking=True)  # warm-up
            runs = []
            for _ in range(REPEATS):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                runs.append(start.elapsed_time(end) / 1e3)
            best[direction] = min(runs)
        times.append(max(best.values()))
    latency, bandwidth = fit_message_cost(SIZES, times)
    return {"latency_s": latency, "bytes_per_s": bandwidth}
