"""Point-to-point message cost between two pipeline ranks: ``latency + bytes / bandwidth``.

Two processes ping-pong tensors of growing size over the backend the runtime uses (gloo on CPU,
NCCL when two GPUs are visible); one-way time is half the fastest round trip of the repeats
(contention from other processes only ever adds time, so the minimum is the transport's own cost,
and a busy 2-core machine no longer hides the growth with size), and a least-squares line through
(bytes, seconds) gives latency and bandwidth. Messages go up to at least ``MIN_TOP_BYTES`` so
that the bandwidth term dominates the largest ones; when the times still do not grow with size (a
machine too noisy to measure) the benchmark fails with a message instead of reporting a made-up
bandwidth.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time

from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


MIN_TOP_BYTES = 16 << 20


class P2PMeasurementError(ValueError):
    """The message benchmark could not measure a bandwidth; the message says what to do."""


def fit_message_cost(sizes, times) -> tuple[float, float]:
    """(latency_s, bytes_per_s) of ``time = latency + bytes / bandwidth`` fitted to one-way times."""
    sizes, times = np.asarray(sizes, float), np.asarray(times, float)
    if not np.isfinite(times).all() or (times <= 0).any():
        raise P2PMeasurementError(f"p2p benchmark: invalid message times {times.tolist()}")
    slope, intercept = np.polyfit(sizes, times, 1)
    # The largest message must take clearly longer than the smallest, else the slope is noise.
    if not slope > 0 or times[-1] < 1.5 * times[0]:
        raise P2PMeasurementError(
            "p2p benchmark: message time does not grow with size "
            f"({', '.join(f'{int(b)} B: {t * 1e6:.1f} us' for b, t in zip(sizes, times))}), so no bandwidth can be "
            "measured (the machine is too busy); re-run `pipetune profile` on a quieter machine, or pass --no-p2p "
            "to use the assumed 20 us + bytes / 25 GB/s"
        )
    return float(max(intercept, times.min() * 0.5)), float(1.0 / slope)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, sizes: list[int], repeats: int, backend: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=2, timeout=timedelta(seconds=120))
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
        out.append(min(times))
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def measure_p2p(max_bytes: int, repeats: int = 9) -> dict:
    """``{"latency_s", "bytes_per_s", "backend"}`` measured between two local processes."""
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"
    sizes = sorted({int(x) // 4 * 4 for x in np.geomspace(4096, max(max_bytes, MIN_TOP_BYTES), 8)})
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, sizes, repeats, backend, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        times = queue.get(timeout=300)
    except queue_mod.Empty:
        raise P2PMeasurementError(
            "p2p benchmark: the two message processes gave no result within 300 s; pass --no-p2p to skip it"
        ) from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    latency, bandwidth = fit_message_cost(sizes, times)
    return {"latency_s": latency, "bytes_per_s": bandwidth, "backend": backend}
