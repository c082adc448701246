"""Launching TorchTitan jobs of the integration tests: arguments of the small CPU job, torchrun."""

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def job_args(job: Path, dump: Path, *extra: str, module: str = "configs", config: str = "muse_glimmer_mm") -> list[str]:
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
