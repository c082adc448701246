"""Launch a pipetune TorchTitan job the way a user does, and read its per-step records.

Every benchmark that measures real training goes through TorchTitan's own entry point
(``torchrun -m torchtitan.train --module pipetune_configs --config <fn>``) on 2 gloo
ranks, with job options given as TorchTitan command-line overrides, so what is timed is the
trainer path a user runs, with the CPU testbed's config (``torchtitan_patches/testbed``). ``prepare``
makes the data set and latency table once per config.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from torchtitan_patches.testbed.learning import TestbedRecord

ROOT = Path(__file__).resolve().parents[1]


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 256,512,1024") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be positive")
    return values


def job_arguments(doc: str, *, rounds: int, seq_lens: list[int] | None = None) -> argparse.ArgumentParser:
    """The options every job comparison takes: output folder, steps per job, alternating rounds,
    steps left out at the start of each job, global batch and sequence length (a list to sweep,
    with ``seq_lens`` as its default)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "out" / "titan", help="prepared job folder (data, table) and the jobs' dumps")
    p.add_argument("--steps", type=int, default=20, help="training steps per job")
    p.add_argument("--rounds", type=int, default=rounds, help="rounds of alternating jobs")
    p.add_argument("--warmup", type=int, default=2, help="steps left out at the start of each job")
    p.add_argument("--gbs", type=int, default=16, help="samples per global batch")
    if seq_lens is None:
        p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    else:
        p.add_argument("--seq-len", type=int_list, default=seq_lens, help="sequence lengths to sweep (comma-separated)")
    return p


def prepare(out: Path, config: str = "muse_glimmer_mm", *extra: str) -> None:
    """``<out>/data`` and ``<out>/table.json`` for ``config`` (kept when they exist)."""
    subprocess.run([sys.executable, "-m", "profiling.prepare_job", "--config", config, "--out", str(out), *extra],
                   check=True, cwd=ROOT)


def corpus(out: Path, *, generated: bool = False) -> dict[str, object]:
    """The data options of a job prepared in ``out``: the corpus of real files (``prepare``) read
    through its metadata index, or the generated mix (``--mix``), with the corpus's tokenizer."""
    return {"dataloader.dataset_path": out / "data" if generated else corpus_index(out), "hf_assets_path": out / "fixture" / "tokenizer"}


def corpus_index(out: Path) -> Path:
    """The corpus's index, built once as a user builds one (``pipetune data index`` with the job's
    tokenizer): the jobs then open the corpus without tokenizing it or reading an image header."""
    import shutil

    from pipetune.data.index.manifest import StaleIndex, check_fresh, read_manifest

    index = out / "fixture" / "index"
    try:
        check_fresh(read_manifest(index), index)
        return index
    except (OSError, StaleIndex):
        shutil.rmtree(index, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pipetune", "data", "index", str(out / "fixture" / "data"), "--out", str(index),
                    "--tokenizer", str(out / "fixture" / "tokenizer")], check=True, cwd=ROOT)
    return index


def corpus_tokenizer(out: Path):
    """The job's tokenizer (the corpus's) as pipetune's data path uses it."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from torchtitan_patches.titan.tokenizer import text_tokenizer

    return text_tokenizer(HuggingFaceTokenizer(tokenizer_path=str(out / "fixture" / "tokenizer")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(dump: Path, overrides: dict[str, object], *, config: str = "muse_glimmer_mm_testbed", nproc: int = 2,
            timeout: float | None = None, records: bool = True) -> list[TestbedRecord]:
    """Train one job into ``dump`` and return its pipetune records (``<dump>/pipetune/steps.jsonl``;
    none with ``records=False``, for a job of another trainer).

    ``overrides`` maps TorchTitan option names to values (``{"pipetune.mode": "original"}`` ->
    ``--pipetune.mode original``); ``True`` is a bare flag. Prints a line per training step (and
    one every ``PROGRESS_S`` seconds while none comes); a failed job exits with its log tail.
    """
    args = []
    for key, value in overrides.items():
        args += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(_free_port()),
           "-m", "torchtitan.train", "--module", "pipetune_configs", "--config", config, "--dump_folder", str(dump), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    tail = _follow(proc, dump.name, overrides.get("training.steps"), timeout)
    if proc.returncode:
        sys.exit(f"job {dump.name} failed (exit {proc.returncode}):\n" + "".join(tail)[-4000:])
    return read_records(dump) if records else []


PROGRESS_S = 20.0
STEP_LINE = re.compile(r"pipetune step (\d+):|step:\s*(\d+)\s+loss:")  # pipetune's step line, or TorchTitan's metrics line
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _follow(proc: subprocess.Popen, name: str, steps, timeout: float | None) -> deque:
    """Read a job's output to its end: print each training step once (from pipetune's or
    TorchTitan's step line, of any rank), and a heartbeat when no step came for ``PROGRESS_S``
    seconds; return the output's tail."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for x in proc.stdout:
            lines.put(x)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    tail, start, last, shown = deque(maxlen=200), time.monotonic(), time.monotonic(), 0
    print(f"  {name}: started", flush=True)
    while True:
        try:
            line = lines.get(timeout=PROGRESS_S)
        except queue.Empty:
            line = ""
        now = time.monotonic()
        if timeout is not None and now - start > timeout:
            proc.kill()
            sys.exit(f"job {name} passed its {timeout:.0f} s timeout:\n" + "".join(tail)[-4000:])
        if line is None:
            break
        tail.append(line)
        m = STEP_LINE.search(ANSI.sub("", line))
        step = int(m.group(1) or m.group(2)) if m else 0
        if step > shown:
            shown, last = step, now
            print(f"  {name}: step {shown}{f'/{steps}' if steps else ''}, {now - start:.0f} s", flush=True)
        elif now - last >= PROGRESS_S:
            last = now
            print(f"  {name}: {'starting' if not shown else f'step {shown + 1}'}, {now - start:.0f} s", flush=True)
    proc.wait()
    return tail


def read_records(dump: Path) -> list[TestbedRecord]:
    return TestbedRecord.read(dump / "pipetune" / "steps.jsonl")
