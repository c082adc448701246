"""Point-to-point message cost between two pipeline ranks: ``latency + bytes / bandwidth``.

Two processes ping-pong tensors of growing size over the backend the runtime uses (gloo on CPU,
NCCL when two GPUs are visible); one-way time is half the round trip (median of repeats), and a
least-squares line through (bytes, seconds) gives latency and bandwidth.
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, sizes: list[int], repeats: int, backend: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=2)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    out = []
    for n in sizes:
        buf = torch.zeros(n // 4, dtype=torch.float32, device=device)
        times = []
        for i in range(repeats + 2):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 2:
                times.append((time.perf_counter() - t0) / 2)
        out.append(statistics.median(times))
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def measure_p2p(max_bytes: int, repeats: int = 9) -> dict:
    """``{"latency_s", "bytes_per_s", "backend"}`` measured between two local processes."""
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"
    sizes = sorted({int(x) // 4 * 4 for x in np.geomspace(4096, max(max_bytes, 8192), 8)})
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, sizes, repeats, backend, queue)) for r in range(2)]
    for p in procs:
        p.start()
    times = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    slope, intercept = np.polyfit(np.asarray(sizes, float), np.asarray(times), 1)
    return {
        "latency_s": float(max(intercept, min(times) * 0.5)),
        "bytes_per_s": float(1.0 / max(slope, 1e-15)),
        "backend": backend,
    }
