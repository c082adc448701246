"""Bad inputs get a clear error naming what is wrong, never a traceback, a hang or a wrong plan.

Table-driven: each case is a command line (or a call) and the message it must print. The
multi-rank plan-channel cases run two gloo processes (this file is also their worker script)
with a short job timeout and a hard test timeout, so a regression fails instead of hanging.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 10


# ---------------------------------------------------------------- plan channel (two gloo ranks)

def _channel_worker(scenario: str, rank: int, port: int) -> None:
    """One rank of a plan-channel scenario; prints ``ERROR <message>`` or ``OK``."""
    import torch.distributed as dist

    from pipetune.data import BatchStream, batch_meta, make_mix
    from pipetune.plan.plan import PlanError, build_plan
    from torchtitan_patches.pipeline.plan_channel import PlanChannel

    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=timedelta(seconds=JOB_TIMEOUT_S))
    data = make_mix("datamix3", 64, seed=0)
    stream = BatchStream(num_rows=len(data), gbs=8, seed=0)

    def meta(step):
        return batch_meta(data, stream, step, tokens_per_image=16, max_seq_len=1 << 20)

    def planner(m):
        return build_plan(step=m.step, micro_batches=[m.table.ids.tolist()], order=[0], num_stages=2, encoder=False,
                          mbs=1, max_seq_len=1 << 20)

    try:
        if scenario == "agree":
            ch = PlanChannel(planner if rank == 0 else None)
            groups = [ch(meta(s)) for s in range(3)]
            assert sorted(groups[2][0]) == sorted(meta(2).table.ids.tolist())
        elif scenario == "steps":  # rank 1 skipped a step (other --steps / --modes)
            ch = PlanChannel(planner if rank == 0 else None)
            ch(meta(0 if rank == 0 else 1))
        elif scenario == "no_planner":  # rank 0 started without a planner
            PlanChannel(None)
        elif scenario == "modes":  # rank 0 runs two modes, rank 1 one: rank 0 opens a second channel
            first = PlanChannel(planner if rank == 0 else None)
            if rank == 0:
                PlanChannel(planner)
            first(meta(0))
        print("OK", flush=True)
    except PlanError as e:
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
    finally:
        os._exit(0)  # a rank whose peer failed must not wait in destroy_process_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_channel(scenario: str) -> list[str]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, scenario, str(r), str(port)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=3 * JOB_TIMEOUT_S + 20)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"plan channel scenario {scenario!r} hung past the job timeout")
    return outs


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "scenario, messages",
    [
        ("agree", ["OK", "OK"]),
        ("steps", ["ranks ask for the plans of different steps (rank 0: step 0, rank 1: step 1)"] * 2),
        ("no_planner", ["rank 0 must own the planner and only it, but ranks [] have one"] * 2),
        ("modes", ["no answer from the other ranks within 10 s"] * 2),
    ],
)
def test_plan_channel_mismatch_fails_on_every_rank_within_the_timeout(scenario, messages):
    outs = _run_channel(scenario)
    for rank, (out, msg) in enumerate(zip(outs, messages)):
        assert msg in out, f"rank {rank}:\n{out}"
        assert "Traceback" not in out, f"rank {rank}:\n{out}"


if __name__ == "__main__":
    _channel_worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
