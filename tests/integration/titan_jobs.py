"""Launching TorchTitan jobs of the integration tests: arguments of the small CPU job, torchrun."""

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def job_args(job: Path, dump: Path, *extra: str, module: str = "pipetune_configs", config: str = "muse_glimmer_mm") -> list[str]:
    return ["--module", module, "--config", config, "--dump_folder", str(dump), "--hf_assets_path", str(job / "fixture" / "tokenizer"),
            "--dataloader.dataset_path", str(job / "data"), "--pipetune.latency_table", str(job / "table.json"),
            "--dataloader.gbs", "8", "--training.seq_len", "512", "--pipetune.calibration.online_window", "0", "--pipetune.budget_s", "60",
            "--pipetune.strict_order", "--debug.seed", "0", *extra]


def torchrun(target: list[str], timeout: float = 100, *, ranks: int = 2, check: bool = True) -> str:
    """``torchrun`` of ``target`` on ``ranks`` local processes (one thread each); with ``check``
    fails the test with the output's tail unless it exits 0, without it unless it fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", str(port), *target]
    here = Path(__file__).parent
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(here)])})
    assert (res.returncode == 0) == check, res.stdout[-3000:] + res.stderr[-6000:]
    return res.stdout + res.stderr


def spawn(target: list[str], timeout: float, *, ranks: int, env: dict[str, str] | None = None) -> list[tuple[int, str]]:
    """Each rank of ``target`` as its own process, meeting at a store this process holds (as
    torchrun's agent does), so that no agent stops the other ranks when one dies: as on ranks of
    separate nodes, they must stop themselves. Returns each rank's exit code and output; fails the
    test, killing them all, if any rank is still running after ``timeout`` seconds."""
    import tempfile
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, ranks, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    here = Path(__file__).parent
    base = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(here)]),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks),
            "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with tempfile.TemporaryDirectory() as logs:
        outs = [open(Path(logs) / f"rank{r}.log", "w+") for r in range(ranks)]
        procs = [subprocess.Popen([sys.executable, *target], cwd=ROOT, stdout=outs[r], stderr=subprocess.STDOUT,
                                  env={**base, "RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0"}) for r in range(ranks)]
        deadline = time.monotonic() + timeout
        try:
            codes = [p.wait(timeout=max(deadline - time.monotonic(), 0.01)) for p in procs]
        except subprocess.TimeoutExpired:
            codes = None
            for p in procs:
                p.kill()
                p.wait()
        texts = []
        for f in outs:
            f.seek(0)
            texts.append(f.read())
            f.close()
    assert codes is not None, f"ranks still running after {timeout} s: " + " | ".join(f"rank {r}: {t[-1500:]}" for r, t in enumerate(texts))
    return list(zip(codes, texts))
